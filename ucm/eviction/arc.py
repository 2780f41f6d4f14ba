"""ARC (Megiddo & Modha, FAST'03), byte-weighted: balance recency against frequency adaptively.

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1/B2 are ghosts (keys only) of what
was evicted from T1/T2. A miss that hits ghost B1 means T1 was too small: the target `p` (bytes for T1)
grows; a B2 ghost hit shrinks it. Eviction takes T1's LRU while T1 holds more than `p` bytes, else T2's.
All sizes are bytes, so the bookkeeping works for blocks of any size. O(1) amortised per operation.

The tier may call `insert` before `evict` (make room after storing), so the block just inserted is the
last choice as a victim: classic ARC replaces before it inserts.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Hashable

from ucm.eviction.base import PolicyName, check_capacity, check_size


class _List(enum.Enum):
    T1 = "t1"  # resident, seen once recently
    T2 = "t2"  # resident, seen at least twice
    B1 = "b1"  # ghost of T1
    B2 = "b2"  # ghost of T2


class ARCPolicy:
    name = PolicyName.ARC

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self.p = 0.0  # target bytes for T1
        self._lists: dict[_List, OrderedDict[Hashable, int]] = {name: OrderedDict() for name in _List}  # LRU first
        self._bytes = dict.fromkeys(_List, 0)
        self._t1, self._t2, self._b1, self._b2 = (self._lists[name] for name in _List)
        self._incoming: Hashable | None = None

    @property
    def used_bytes(self) -> int:
        return self._bytes[_List.T1] + self._bytes[_List.T2]

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._t1 or key in self._t2

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        # Chains are not tracked: only the tier's deepest-first order keeps a request's new tail ahead of its root.
        check_size(size)
        self._incoming = key
        if key in self:
            self.remove(key)
            self._push(_List.T2, key, size)
            return
        if key in self._b1:
            # Recency list was too short: grow T1's target by the ghost-size ratio (ARC's delta), in bytes.
            ratio = max(self._bytes[_List.B2] / max(self._bytes[_List.B1], 1), 1.0)
            self.p = min(float(self.capacity_bytes), self.p + ratio * max(size, 1))
            self._pop(_List.B1, key)
            self._push(_List.T2, key, size)
        elif key in self._b2:
            ratio = max(self._bytes[_List.B1] / max(self._bytes[_List.B2], 1), 1.0)
            self.p = max(0.0, self.p - ratio * max(size, 1))
            self._pop(_List.B2, key)
            self._push(_List.T2, key, size)
        else:
            self._push(_List.T1, key, size)
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            self._push(_List.T2, key, self._pop(_List.T1, key))
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        for name in (_List.T1, _List.T2):
            if key in self._lists[name]:
                self._pop(name, key)
                return

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        def not_incoming(key: Hashable) -> bool:
            return key != self._incoming and can_evict(key)

        for check in (not_incoming, can_evict):
            t1_first = self._t1 and (self._bytes[_List.T1] > self.p or not self._t2)
            order = (_List.T1, _List.T2) if t1_first else (_List.T2, _List.T1)
            for name in order:
                victim = next((k for k in self._lists[name] if check(k)), None)
                if victim is not None:
                    ghost = _List.B1 if name is _List.T1 else _List.B2
                    self._push(ghost, victim, self._pop(name, victim))
                    self._trim_ghosts()
                    return victim
        return None

    def lists(self) -> dict[str, list[Hashable]]:
        """T1/T2/B1/B2 keys by lower-case name, LRU first — for tests and debugging."""
        return {name.value: list(keys) for name, keys in self._lists.items()}

    # -- internals -----------------------------------------------------------------------------------

    def _push(self, name: _List, key: Hashable, size: int) -> None:
        self._lists[name][key] = size
        self._bytes[name] += size

    def _pop(self, name: _List, key: Hashable) -> int:
        size = self._lists[name].pop(key)
        self._bytes[name] -= size
        return size

    def _trim_ghosts(self) -> None:
        # ARC's invariants in bytes: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c (ghosts give way first).
        c = self.capacity_bytes
        while self._b1 and self._bytes[_List.T1] + self._bytes[_List.B1] > c:
            self._pop(_List.B1, next(iter(self._b1)))
        while self._b2 and sum(self._bytes.values()) > 2 * c:
            self._pop(_List.B2, next(iter(self._b2)))
        while self._b1 and sum(self._bytes.values()) > 2 * c:
            self._pop(_List.B1, next(iter(self._b1)))
