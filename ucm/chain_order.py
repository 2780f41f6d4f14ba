"""The order in which a tier hands a batch of chained blocks to its eviction policy: deepest first.

A recency-based policy evicts the least recently used block first. Touched or inserted in request order, a
chain's root would be its oldest block and go first, taking every deeper block with it for a prefix lookup
while they keep their space; handed over deepest first, a chain loses its tail first instead (vLLM frees a
request's blocks in reverse order for the same reason). Reads keep it simpler: they touch the blocks in the
reverse of the caller's order, which is a request's chain order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from common.keys import BlockKey
from ucm.record import BlockRecord

T = TypeVar("T")


def deepest_first(items: Sequence[T], key: Callable[[T], BlockKey], parent: Callable[[T], BlockKey | None]) -> list[T]:
    """`items` with every block before its parent when both are in the batch, each chain deepest first;
    blocks of equal depth (unrelated ones) keep their given order."""
    index = {key(item): i for i, item in enumerate(items)}
    depth = [-1] * len(items)
    for i in range(len(items)):
        path: list[int] = []
        j: int | None = i
        while j is not None and depth[j] < 0 and len(path) <= len(items):  # bounded: a forged cycle ends too
            path.append(j)
            up = parent(items[j])
            j = index.get(up) if up is not None else None
        base = depth[j] if j is not None and depth[j] >= 0 else -1
        for k in reversed(path):
            base += 1
            depth[k] = base
    order = sorted(range(len(items)), key=lambda i: -depth[i])
    return [items[i] for i in order]


def records_deepest_first(records: Sequence[BlockRecord]) -> list[BlockRecord]:
    """`deepest_first` for stored records, chained through their headers' parent keys (what both tiers insert)."""
    return deepest_first(records, _record_key, _record_parent)


def _record_key(record: BlockRecord) -> BlockKey:
    return record.key


def _record_parent(record: BlockRecord) -> BlockKey:
    return record.header.parent
