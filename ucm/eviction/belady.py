"""Belady's MIN, the offline optimum: evict the block whose next use is farthest in the future.

For the hit-rate benchmark only (it needs the whole future). Blocks are taken to be the same size, so
capacity is a block count; with bypass (a block used later than everything cached is not stored at all)
MIN maximises the number of per-block hits, which upper-bounds any online policy.

Requests are sequences of prefix-chained keys and the store serves a hit only for a prefix, so ties
on next use (a parent and its child are next used by the same request) evict the deeper block first;
then the cache stays prefix-closed and MIN's prefix hits equal its per-block hits. Both are reported.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

NEVER = float("inf")


@dataclass(frozen=True)
class BeladyResult:
    accesses: int
    block_hits: int  # blocks present when requested
    prefix_hits: int  # blocks in the present prefix of each request (what a prefix lookup serves)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.accesses if self.accesses else 0.0


def belady(requests: Sequence[Sequence[Hashable]], capacity_blocks: int) -> BeladyResult:
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    flat = [(key, depth) for request in requests for depth, key in enumerate(request)]
    next_use: list[float] = [NEVER] * len(flat)
    seen: dict[Hashable, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        key = flat[pos][0]
        next_use[pos] = seen.get(key, NEVER)
        seen[key] = pos

    cached: dict[Hashable, tuple[float, int]] = {}  # key -> (next use, depth) priority now in force
    heap: list[tuple[float, int, Hashable]] = []  # (-next use, -depth, key); stale entries skipped
    block_hits = prefix_hits = 0
    pos = 0
    for request in requests:
        in_prefix = True
        for depth, key in enumerate(request):
            nu = next_use[pos]
            pos += 1
            prio = (nu, depth)
            if key in cached:
                block_hits += 1
                prefix_hits += in_prefix
                cached[key] = prio
                heapq.heappush(heap, (-nu, -depth, key))
                continue
            in_prefix = False
            if nu == NEVER or capacity_blocks == 0:
                continue  # bypass: never used again, storing it cannot help
            if len(cached) >= capacity_blocks:
                while True:
                    neg_nu, neg_depth, far = heap[0]
                    if cached.get(far) == (-neg_nu, -neg_depth):
                        break
                    heapq.heappop(heap)  # stale
                if (-neg_nu, -neg_depth) <= prio:
                    continue  # bypass: the newcomer is the farthest-used of all
                heapq.heappop(heap)
                del cached[far]
            cached[key] = prio
            heapq.heappush(heap, (-nu, -depth, key))
    return BeladyResult(accesses=pos, block_hits=block_hits, prefix_hits=prefix_hits)
