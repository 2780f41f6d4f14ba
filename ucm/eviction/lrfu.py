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
from collections.abc import Callable, Hashable

from ucm.eviction.base import PolicyName, SizedKeys, check_capacity, check_size
from ucm.eviction.scored_heap import ScoredHeap


class LRFUPolicy(SizedKeys):
    name = PolicyName.LRFU

    def __init__(self, capacity_bytes: int, half_life: int | None = None) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        if half_life is not None and half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self._half_life = half_life  # None: capacity in blocks, set at the first insert
        self._heap = ScoredHeap()
        self._sizes: dict[Hashable, int] = {}
        self._clock = 0
        self.used_bytes = 0

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        if self._half_life is None:
            self._half_life = max(1, self.capacity_bytes // max(size, 1))
        self.used_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self._use(key)

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._use(key)

    def remove(self, key: Hashable) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            self._heap.discard(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        found = self._heap.pop_min(can_evict)
        if found is None:
            return None
        key = found[0]
        self.used_bytes -= self._sizes.pop(key)
        return key

    def _use(self, key: Hashable) -> None:
        assert self._half_life is not None, "the half-life is set at the first insert"
        self._clock += 1
        now = self._clock / self._half_life
        old = self._heap.score(key)
        # log2(2^old + 2^now), computed without overflow.
        score = now if old is None else max(old, now) + math.log2(1.0 + 2.0 ** -abs(old - now))
        self._heap.set(key, score)
