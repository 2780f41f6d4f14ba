"""The eviction-policy interface: a tier asks its policy which block to drop next.

A policy only orders keys; the tier owns the bytes. Keys the tier cannot drop right now (pinned by an
in-flight load) are skipped through `can_evict`, and stay tracked by the policy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from typing import Protocol


class PolicyName(enum.Enum):
    LRU = "lru"
    S3FIFO = "s3fifo"
    ARC = "arc"
    TINYLFU = "tinylfu"
    ADAPTIVE = "adaptive"  # added by the eviction owner: follows the best of LRU/S3-FIFO/ARC


class EvictionPolicy(Protocol):
    name: PolicyName

    def admit(self, key: Hashable, size: int) -> bool:
        """Whether a new block is worth inserting at all (admission control); most policies say yes."""
        ...

    def insert(self, key: Hashable, size: int) -> None:
        """A block was stored under `key` (not already tracked)."""
        ...

    def touch(self, key: Hashable) -> None:
        """A tracked block was read (a hit)."""
        ...

    def remove(self, key: Hashable) -> None:
        """A tracked block left the tier for another reason (explicit remove, corruption)."""
        ...

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        """Choose a victim among evictable keys, stop tracking it and return it; None if none is evictable."""
        ...


# --- Helpers shared by the policies (additive to the interface above) ---------------------------------


def check_capacity(capacity_bytes: int) -> int:
    """Validate a policy's byte capacity (what the tier will hold at most)."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
    return capacity_bytes


def check_size(size: int) -> int:
    """Validate one block's byte size."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"block size must be a non-negative int, got {size!r}")
    return size
