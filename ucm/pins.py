"""Pin counts: a block read by an in-flight load must not be evicted under it (DESIGN.md §4)."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable


class PinTable:
    """Its lock is a leaf: tiers call `is_unpinned` while holding their own locks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # A plain dict, not a Counter: every load pins and unpins each of its blocks, and Counter's
        # Python-level __missing__/__delitem__ made that 4x slower.
        self._counts: dict[Hashable, int] = {}

    def pin(self, keys: Iterable[Hashable]) -> None:
        with self._lock:
            counts, get = self._counts, self._counts.get
            for key in keys:
                counts[key] = get(key, 0) + 1

    def unpin(self, keys: Iterable[Hashable]) -> None:
        with self._lock:
            counts = self._counts
            for key in keys:
                n = counts.get(key, 0)
                assert n > 0, f"unpinning {key!r} which is not pinned"
                if n == 1:
                    del counts[key]
                else:
                    counts[key] = n - 1

    def is_unpinned(self, key: Hashable) -> bool:
        with self._lock:
            return key not in self._counts

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)
