"""Pin counts: a block read by an in-flight load must not be evicted under it (DESIGN.md §4)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Iterable


class PinTable:
    """Its lock is a leaf: tiers call `is_unpinned` while holding their own locks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[Hashable] = Counter()

    def pin(self, keys: Iterable[Hashable]) -> None:
        with self._lock:
            self._counts.update(keys)

    def unpin(self, keys: Iterable[Hashable]) -> None:
        with self._lock:
            for key in keys:
                assert self._counts[key] > 0, f"unpinning {key!r} which is not pinned"
                self._counts[key] -= 1
                if self._counts[key] == 0:
                    del self._counts[key]

    def is_unpinned(self, key: Hashable) -> bool:
        with self._lock:
            return key not in self._counts

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)
