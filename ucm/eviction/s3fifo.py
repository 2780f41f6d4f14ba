"""S3-FIFO (Yang et al., SOSP'23): three FIFO queues that drop one-hit wonders quickly.

New blocks enter a small FIFO (~10% of the bytes). A block read again while there is promoted to the
main FIFO when it reaches the small queue's head; one that was never read again is evicted and its key
remembered in a ghost FIFO, so that if it comes back soon it goes straight to main. Main is a FIFO with
a 2-bit frequency per block: a block with frequency > 0 at the head is reinserted with frequency - 1
(CLOCK-like), otherwise evicted. Everything is a byte-weighted OrderedDict, O(1) amortised.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from ucm.eviction.base import PolicyName, check_capacity, check_size

MAX_FREQ = 3  # two bits


class S3FIFOPolicy:
    name = PolicyName.S3FIFO

    def __init__(self, capacity_bytes: int, small_fraction: float = 0.1) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_target = max(1, int(capacity_bytes * small_fraction))
        # The ghost remembers about as many bytes as main holds (the paper sizes it like main).
        self.ghost_capacity = capacity_bytes - self.small_target
        self._small: OrderedDict[Hashable, int] = OrderedDict()  # key -> size, head = oldest
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self.small_bytes = 0
        self.main_bytes = 0
        self.ghost_bytes = 0

    @property
    def used_bytes(self) -> int:
        return self.small_bytes + self.main_bytes

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._freq

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        # Chains are not tracked: only the tier's deepest-first order keeps a request's new tail ahead of its root.
        check_size(size)
        if key in self._freq:  # a rewrite of a block we hold: a use with the new size
            self.remove(key)
            self._put(self._main, key, size)
            self._freq[key] = 1
            return
        if key in self._ghost:
            self.ghost_bytes -= self._ghost.pop(key)
            self._put(self._main, key, size)
        else:
            self._put(self._small, key, size)
        self._freq[key] = 0

    def touch(self, key: Hashable) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < MAX_FREQ:
            self._freq[key] = freq + 1

    def remove(self, key: Hashable) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            self.small_bytes -= self._small.pop(key)
        else:
            self.main_bytes -= self._main.pop(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        if self.small_bytes >= self.small_target or not self._main:
            victim = self._evict_small(can_evict)
            return victim if victim is not None else self._evict_main(can_evict)
        victim = self._evict_main(can_evict)
        return victim if victim is not None else self._evict_small(can_evict)

    def queues(self) -> tuple[list[Hashable], list[Hashable], list[Hashable]]:
        """(small, main, ghost) keys, head (next out) first — for tests and debugging."""
        return list(self._small), list(self._main), list(self._ghost)

    # -- internals -----------------------------------------------------------------------------------

    def _put(self, queue: OrderedDict[Hashable, int], key: Hashable, size: int) -> None:
        queue[key] = size
        if queue is self._small:
            self.small_bytes += size
        else:
            self.main_bytes += size

    def _evict_small(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        # One pass over small at most: each head is promoted, skipped (pinned) or evicted.
        for _ in range(len(self._small)):
            key, size = self._small.popitem(last=False)
            self.small_bytes -= size
            if self._freq[key] > 0:
                self._freq[key] = 0
                self._put(self._main, key, size)
            elif not can_evict(key):
                self._put(self._small, key, size)  # pinned: back of the queue, still tracked
            else:
                del self._freq[key]
                self._remember(key, size)
                return key
        return None

    def _evict_main(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        # Frequencies only go down, so MAX_FREQ + 1 passes always reach a victim unless all are pinned.
        for _ in range((MAX_FREQ + 1) * len(self._main)):
            key = next(iter(self._main))
            freq = self._freq[key]
            if freq > 0:
                self._freq[key] = freq - 1
                self._main.move_to_end(key)
            elif not can_evict(key):
                self._main.move_to_end(key)
            else:
                self.main_bytes -= self._main.pop(key)
                del self._freq[key]
                return key
        return None

    def _remember(self, key: Hashable, size: int) -> None:
        self._ghost[key] = size
        self.ghost_bytes += size
        while self.ghost_bytes > self.ghost_capacity and self._ghost:
            self.ghost_bytes -= self._ghost.popitem(last=False)[1]
