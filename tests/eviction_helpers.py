"""Eviction-policy test helpers: what a tier does with a policy, in a few lines (tests/ucm/test_eviction*.py)."""

from __future__ import annotations

from typing import Any


def everything(key: object) -> bool:
    return True


def drain(policy: Any, can_evict: Any = everything) -> list[Any]:
    out = []
    while (victim := policy.evict(can_evict)) is not None:
        out.append(victim)
    return out


def put(policy: Any, key: Any, capacity: int, size: int = 1) -> list[Any]:
    """What a tier does: admit, insert, then evict while over capacity; returns the victims."""
    if not policy.admit(key, size):
        return []
    policy.insert(key, size)
    victims = []
    while policy.used_bytes > capacity:
        victims.append(policy.evict(everything))
    return victims
