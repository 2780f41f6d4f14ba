"""Least-recently-used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from ucm.eviction.base import PolicyName, check_capacity, check_size


class LRUPolicy:
    """An OrderedDict from oldest to newest use; O(1) per operation, O(pinned) extra per evict."""

    name = PolicyName.LRU

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True

    def insert(self, key: Hashable, size: int) -> None:
        check_size(size)
        # A re-insert (the tier rewrote a block it still holds) counts as a use with the new size.
        self.used_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self._sizes.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        # Pinned keys keep their place, so they are next in line once their load finishes.
        for key in self._sizes:
            if can_evict(key):
                self.used_bytes -= self._sizes.pop(key)
                return key
        return None

    def size(self, key: Hashable) -> int:
        """Bytes of a tracked block (0 if untracked)."""
        return self._sizes.get(key, 0)

    def keys(self) -> list[Hashable]:
        """Tracked keys, next victim first (for tests and debugging)."""
        return list(self._sizes)
