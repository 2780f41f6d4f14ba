"""LRFU with a half-life, as LMCache's cost-aware score weighs reuse: recompute tokens per byte times a hit count
that decays by half every `half_life` accesses (Lee et al.'s LRFU, IEEE TC 2001, with the decay in accesses).

The decayed count of a block is `Σ 2^-(now - t_i)/h` over its uses t_i. Comparing blocks at one `now` only
needs `log2 Σ 2^(t_i/h)`, which never changes between uses, so the order is a heap keyed by that log (no
rescoring of every block per access). Recompute tokens per byte are the same for every block of a model, so they
drop out of the order. The half-life defaults to the tier's capacity in blocks: a block not reused within about
one cache-full of accesses counts half as much.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from ucm.eviction.base import PolicyName, check_size
from ucm.eviction.scored_heap import ScoredPolicy


class LRFUPolicy(ScoredPolicy):
    name = PolicyName.LRFU

    def __init__(self, capacity_bytes: int, half_life: int | None = None) -> None:
        super().__init__(capacity_bytes)
        if half_life is not None and half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self._half_life = half_life  # None: capacity in blocks, set at the first insert
        self._clock = 0

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        if self._half_life is None:
            self._half_life = max(1, self.capacity_bytes // max(size, 1))
        self._put(key, size)
        self._use(key)

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._use(key)

    def _use(self, key: Hashable) -> None:
        assert self._half_life is not None, "the half-life is set at the first insert"
        self._clock += 1
        now = self._clock / self._half_life
        old = self._heap.score(key)
        # log2(2^old + 2^now), computed without overflow.
        score = now if old is None else max(old, now) + math.log2(1.0 + 2.0 ** -abs(old - now))
        self._heap.set(key, score)
