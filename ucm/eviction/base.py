"""The eviction-policy interface: a tier asks its policy which block to drop next.

A policy only orders keys; the tier owns the bytes. Keys the tier cannot drop right now (pinned by an
in-flight load) are skipped through `can_evict`, and stay tracked by the policy.

Blocks are prefix-chained: a lookup serves block i only if blocks 0..i-1 are served too, so a block whose
parent is gone is worth nothing to a lookup that has to pass through this tier. Tiers therefore hand a
request's blocks to the policy deepest first (touches and inserts), so that in recency order every block is
more recent than its descendants, and pass each block's parent key to `insert`; a policy may use it to keep a
chain's shallower blocks at least as long as its deeper ones.
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
    GDSF = "gdsf"  # GreedyDual-Size-Frequency: cost per byte x frequency, with an aging clock
    LRFU = "lrfu"  # LMCache-style cost-aware score: recompute tokens per byte x a hit count with a half-life
    ADAPTIVE = "adaptive"  # follows the better of LRU and DENSITY on sampled shadow caches
    DENSITY = "density"  # prefix-aware: evicts chains tail first, by hit density learned per reuse class


class EvictionPolicy(Protocol):
    name: PolicyName

    def admit(self, key: Hashable, size: int) -> bool:
        """Whether a new block is worth inserting at all (admission control); most policies say yes."""
        ...

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """A block was stored under `key` (not already tracked). `parent`: the key of the block before it in its
        chain, whether or not this tier holds it (None: unknown, or the chain's first block)."""
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


class SizedKeys:
    """What the policies that keep one size per tracked key share: membership, length, and admitting every block."""

    _sizes: dict[Hashable, int]

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        return True
