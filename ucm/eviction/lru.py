"""Least-recently-used: the baseline every other policy is measured against.

Recency is a request's: a block is never older than its descendants. Tiers touch and insert a request's blocks
deepest first, and a block inserted under a resident parent refreshes the parent's chain (the request has just
used it: its hit prefix was touched at load time, before its new blocks were committed). So a chain is evicted
from its tail, like vLLM's free-block queue, rather than losing its root first and leaving the deeper blocks
behind, unreachable by a prefix lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from ucm.eviction.base import PolicyName, SizedKeys, check_capacity, check_size


class LRUPolicy(SizedKeys):
    """An OrderedDict from oldest to newest use; O(1) per operation, O(chain depth) per insert under a resident
    parent, O(pinned) extra per evict."""

    name = PolicyName.LRU

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()
        self._parents: dict[Hashable, Hashable] = {}
        self.used_bytes = 0

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        check_size(size)
        # A re-insert (the tier rewrote a block it still holds) counts as a use with the new size.
        sizes = self._sizes
        self.used_bytes += size - sizes.get(key, 0)
        sizes[key] = size
        sizes.move_to_end(key)
        if parent is not None:
            self._parents[key] = parent
        # Bounded by the number of tracked keys, so a (forged) cycle of parents cannot loop forever.
        ancestor, steps = self._parents.get(key), len(sizes)
        while ancestor in sizes and steps:
            sizes.move_to_end(ancestor)
            ancestor, steps = self._parents.get(ancestor), steps - 1

    def touch(self, key: Hashable) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            self._parents.pop(key, None)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        # Pinned keys keep their place, so they are next in line once their load finishes.
        for key in self._sizes:
            if can_evict(key):
                self.used_bytes -= self._sizes.pop(key)
                self._parents.pop(key, None)
                return key
        return None

    def size(self, key: Hashable) -> int:
        """Bytes of a tracked block (0 if untracked)."""
        return self._sizes.get(key, 0)

    def keys(self) -> list[Hashable]:
        """Tracked keys, next victim first (for tests and debugging)."""
        return list(self._sizes)
