"""Shared-prefix groups of waiting sequences, and the prompt tokens each group costs per sequence it starts.

Waiting sequences whose next block to compute is the same block (a burst of prompts behind one system prompt or
document) form a group: one of them, the leader, computes the shared blocks and the others load them from the
prefix cache once it has (the scheduler defers them meanwhile). Starting the leader therefore buys the whole group,
and what minimises mean time to first token is serving the group whose tokens per sequence are fewest first (Smith's
ratio rule; a chain of one leader and its followers is served together). A sequence alone is a group of one, so
ordering by this cost is shortest-job-first where nothing is shared.

Block keys are chained (each hashes its parent), so two sequences share their first `n` blocks exactly when their
`n`-th keys are equal, and the shared length is found by bisection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.keys import BlockKey


@dataclass(frozen=True)
class Waiting:
    """One waiting sequence as the grouping sees it."""

    request_id: str
    block_keys: Sequence[BlockKey]  # its full blocks' chained keys
    num_tokens: int  # all its tokens (prompt and, after a preemption, output)
    num_computed: int  # tokens it has or would load from the device prefix cache now


def shared_blocks(a: Sequence[BlockKey], b: Sequence[BlockKey]) -> int:
    """How many leading blocks `a` and `b` share (chained keys: equal at `n` means equal before `n`)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tokens_per_sequence(waiting: Sequence[Waiting], block_size: int) -> dict[str, float]:
    """Each sequence's group cost: the tokens its group computes (the leader, the first in `waiting`, all of its
    own; each follower only what it does not share with the leader) divided by the group's size."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    groups: dict[BlockKey, list[Waiting]] = {}
    cost: dict[str, float] = {}
    for w in waiting:
        nxt = -(-w.num_computed // block_size)  # past a whole hit's last block, whose last token is recomputed
        if nxt < len(w.block_keys):
            groups.setdefault(w.block_keys[nxt], []).append(w)
        else:  # only a partial block left: nothing to share
            cost[w.request_id] = w.num_tokens - w.num_computed
    for members in groups.values():
        leader = members[0]
        total = leader.num_tokens - leader.num_computed
        for f in members[1:]:
            shared = min(shared_blocks(leader.block_keys, f.block_keys) * block_size, f.num_tokens - 1)
            total += f.num_tokens - max(f.num_computed, shared)
        per_seq = total / len(members)
        for m in members:
            cost[m.request_id] = per_seq
    return cost
