"""GDSF, GreedyDual-Size-Frequency (Cherkasova 1998; RAGCache's PGDSF is its prefix-aware form): keep what is
costly to recompute per byte and often used, with an inflation clock that ages what stopped being used.

A block's priority is `clock + frequency × cost / size`; the lowest goes, and the clock rises to the evicted
priority, so a block not used since is eventually overtaken by newcomers. Cost is the tokens a miss
recomputes, which for a store block is its token count: the same for every block of one model, so with equal
sizes GDSF orders by frequency with aging. Frequencies are kept only while a block is resident (the paper's form).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ucm.eviction.base import PolicyName, SizedKeys, check_capacity, check_size
from ucm.eviction.scored_heap import ScoredHeap


class GDSFPolicy(SizedKeys):
    name = PolicyName.GDSF

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self._heap = ScoredHeap()
        self._sizes: dict[Hashable, int] = {}
        self._freq: dict[Hashable, int] = {}
        self.clock = 0.0
        self.used_bytes = 0

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        self.used_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self._freq[key] = self._freq.get(key, 0) + 1
        self._rescore(key)

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._freq[key] += 1
            self._rescore(key)

    def remove(self, key: Hashable) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            del self._freq[key]
            self._heap.discard(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        found = self._heap.pop_min(can_evict)
        if found is None:
            return None
        key, priority = found
        self.clock = max(self.clock, priority)
        self.used_bytes -= self._sizes.pop(key)
        del self._freq[key]
        return key

    def _rescore(self, key: Hashable) -> None:
        # Cost per byte: one block's tokens over its bytes, the same for every block of a model: 1 / size up
        # to that constant (size 0 counts as 1 byte).
        self._heap.set(key, self.clock + self._freq[key] / max(self._sizes[key], 1) * self.capacity_bytes)
