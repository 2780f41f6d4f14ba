"""ARC (Megiddo & Modha, FAST'03), byte-weighted: balance recency against frequency adaptively.

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1/B2 are ghosts (keys only) of what
was evicted from T1/T2. A miss that hits ghost B1 means T1 was too small: the target `p` (bytes for T1)
grows; a B2 ghost hit shrinks it. Eviction takes T1's LRU while T1 holds more than `p` bytes, else T2's.
All sizes are bytes, so the bookkeeping works for blocks of any size. O(1) amortised per operation.

The tier may call `insert` before `evict` (make room after storing), so the block just inserted is the
last choice as a victim: classic ARC replaces before it inserts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from ucm.eviction.base import PolicyName, check_capacity, check_size


class ARCPolicy:
    name = PolicyName.ARC

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self.p = 0.0  # target bytes for T1
        self._t1: OrderedDict[Hashable, int] = OrderedDict()  # key -> size, LRU first
        self._t2: OrderedDict[Hashable, int] = OrderedDict()
        self._b1: OrderedDict[Hashable, int] = OrderedDict()
        self._b2: OrderedDict[Hashable, int] = OrderedDict()
        self._bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self._incoming: Hashable | None = None

    @property
    def used_bytes(self) -> int:
        return self._bytes["t1"] + self._bytes["t2"]

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._t1 or key in self._t2

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True

    def insert(self, key: Hashable, size: int) -> None:
        check_size(size)
        self._incoming = key
        if key in self:
            self.remove(key)
            self._push("t2", key, size)
            return
        if key in self._b1:
            # Recency list was too short: grow T1's target by the ghost-size ratio (ARC's delta), in bytes.
            ratio = max(self._bytes["b2"] / max(self._bytes["b1"], 1), 1.0)
            self.p = min(float(self.capacity_bytes), self.p + ratio * max(size, 1))
            self._pop("b1", key)
            self._push("t2", key, size)
        elif key in self._b2:
            ratio = max(self._bytes["b1"] / max(self._bytes["b2"], 1), 1.0)
            self.p = max(0.0, self.p - ratio * max(size, 1))
            self._pop("b2", key)
            self._push("t2", key, size)
        else:
            self._push("t1", key, size)
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            self._push("t2", key, self._pop("t1", key))
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        for name in ("t1", "t2"):
            if key in self._list(name):
                self._pop(name, key)
                return

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        def not_incoming(key: Hashable) -> bool:
            return key != self._incoming and can_evict(key)

        for check in (not_incoming, can_evict):
            t1_first = self._t1 and (self._bytes["t1"] > self.p or not self._t2)
            order = ("t1", "t2") if t1_first else ("t2", "t1")
            for name in order:
                victim = next((k for k in self._list(name) if check(k)), None)
                if victim is not None:
                    ghost = "b1" if name == "t1" else "b2"
                    self._push(ghost, victim, self._pop(name, victim))
                    self._trim_ghosts()
                    return victim
        return None

    def lists(self) -> dict[str, list[Hashable]]:
        """T1/T2/B1/B2 keys, LRU first — for tests and debugging."""
        return {name: list(self._list(name)) for name in ("t1", "t2", "b1", "b2")}

    # -- internals -----------------------------------------------------------------------------------

    def _list(self, name: str) -> OrderedDict[Hashable, int]:
        return {"t1": self._t1, "t2": self._t2, "b1": self._b1, "b2": self._b2}[name]

    def _push(self, name: str, key: Hashable, size: int) -> None:
        self._list(name)[key] = size
        self._bytes[name] += size

    def _pop(self, name: str, key: Hashable) -> int:
        size = self._list(name).pop(key)
        self._bytes[name] -= size
        return size

    def _trim_ghosts(self) -> None:
        # ARC's invariants in bytes: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c (ghosts give way first).
        c = self.capacity_bytes
        while self._b1 and self._bytes["t1"] + self._bytes["b1"] > c:
            self._pop("b1", next(iter(self._b1)))
        while self._b2 and sum(self._bytes.values()) > 2 * c:
            self._pop("b2", next(iter(self._b2)))
        while self._b1 and sum(self._bytes.values()) > 2 * c:
            self._pop("b1", next(iter(self._b1)))
