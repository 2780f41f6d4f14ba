"""Pluggable eviction policies for the store's tiers; `make_policy` is the one way to build one."""

from __future__ import annotations

from ucm.eviction.base import EvictionPolicy, PolicyName
from ucm.eviction.lru import LRUPolicy

__all__ = ["EvictionPolicy", "LRUPolicy", "PolicyName", "make_policy"]


def make_policy(name: PolicyName, capacity_bytes: int) -> EvictionPolicy:
    """A fresh policy for a tier holding at most `capacity_bytes`."""
    if not isinstance(name, PolicyName):
        raise ValueError(f"policy name must be a PolicyName, got {name!r} (try PolicyName({name!r}))")
    if name is PolicyName.LRU:
        return LRUPolicy(capacity_bytes)
    raise ValueError(f"policy {name.value!r} is not implemented yet")
