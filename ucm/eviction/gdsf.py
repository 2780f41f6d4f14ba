"""GDSF, GreedyDual-Size-Frequency (Cherkasova 1998; RAGCache's PGDSF is its prefix-aware form): keep what is
costly to recompute per byte and often used, with an inflation clock that ages what stopped being used.

A block's priority is `clock + frequency × cost / size`; the lowest goes, and the clock rises to the evicted
priority, so a block not used since is eventually overtaken by newcomers. Cost is the tokens a miss
recomputes, which for a store block is its token count: the same for every block of one model, so with equal
sizes GDSF orders by frequency with aging. Frequencies are kept only while a block is resident (the paper's form).
"""

from __future__ import annotations

from collections.abc import Hashable

from ucm.eviction.base import PolicyName, check_size
from ucm.eviction.scored_heap import ScoredPolicy


class GDSFPolicy(ScoredPolicy):
    name = PolicyName.GDSF

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._freq: dict[Hashable, int] = {}
        self.clock = 0.0

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        self._put(key, size)
        self._freq[key] = self._freq.get(key, 0) + 1
        self._rescore(key)

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._freq[key] += 1
            self._rescore(key)

    def _left(self, key: Hashable, score: float | None) -> None:
        del self._freq[key]
        if score is not None:
            self.clock = max(self.clock, score)

    def _rescore(self, key: Hashable) -> None:
        # Cost per byte: one block's tokens over its bytes, the same for every block of a model: 1 / size up
        # to that constant (size 0 counts as 1 byte).
        self._heap.set(key, self.clock + self._freq[key] / max(self._sizes[key], 1) * self.capacity_bytes)
