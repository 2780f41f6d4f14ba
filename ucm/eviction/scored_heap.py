"""A min-heap of keys by a float score, with lazy deletion, and `ScoredPolicy`: the shared core of the policies
that evict the lowest score (GDSF, LRFU).

A key's score can only be replaced, never edited in place: the new (score, seq, key) entry shadows the old one,
which is skipped when it surfaces. Stale entries are compacted once they outnumber live ones, so memory stays
O(tracked keys).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable

from ucm.eviction.base import SizedKeys, check_capacity

_COMPACT_SLACK = 1024


class ScoredHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._live: dict[Hashable, tuple[float, int]] = {}  # key -> its current (score, seq)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def score(self, key: Hashable) -> float | None:
        entry = self._live.get(key)
        return entry[0] if entry is not None else None

    def set(self, key: Hashable, score: float) -> None:
        entry = (score, next(self._seq))
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._live) + _COMPACT_SLACK:
            self._heap = [(s, q, k) for k, (s, q) in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def pop_min(self, can_evict: Callable[[Hashable], bool]) -> tuple[Hashable, float] | None:
        """The lowest-scored evictable key and its score, no longer tracked; pinned keys keep their place."""
        pinned: list[tuple[float, int, Hashable]] = []
        found = None
        while self._heap:
            score, seq, key = heapq.heappop(self._heap)
            if self._live.get(key) != (score, seq):
                continue  # stale
            if can_evict(key):
                del self._live[key]
                found = (key, score)
                break
            pinned.append((score, seq, key))
        for entry in pinned:
            heapq.heappush(self._heap, entry)
        return found


class ScoredPolicy(SizedKeys):
    """Sizes, used bytes and the heap of a policy that evicts its lowest-scored key; a subclass scores (`_heap.set`)
    and hears of each key that leaves through `_left`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self._heap = ScoredHeap()
        self._sizes: dict[Hashable, int] = {}
        self.used_bytes = 0

    def _put(self, key: Hashable, size: int) -> None:
        self.used_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size

    def remove(self, key: Hashable) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            self._heap.discard(key)
            self._left(key, None)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        found = self._heap.pop_min(can_evict)
        if found is None:
            return None
        key, score = found
        self.used_bytes -= self._sizes.pop(key)
        self._left(key, score)
        return key

    def _left(self, key: Hashable, score: float | None) -> None:
        """`key` is no longer tracked: evicted at `score`, or removed (None)."""
