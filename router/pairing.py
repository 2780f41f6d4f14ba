"""Which prefill node and which decode node serve a request.

Prefill: the node whose device cache already holds the longest prefix of the prompt's block keys wins,
unless it is much busier than the least-loaded one (a hit saves compute only if the node is not the
bottleneck); otherwise the least loaded. Decode: the least loaded (fewest running + waiting per capacity),
ties broken by free KV blocks.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from common.keys import BlockKey
from router.registry import NodeState

# A prefix holder is preferred while its load is at most this much above the least-loaded node's.
PREFIX_LOAD_SLACK = 0.5


@dataclass(frozen=True)
class PrefillChoice:
    node: NodeState
    prefix_hit_blocks: int  # how many of the prompt's blocks the chosen node reported holding


def pick_prefill(
    nodes: list[NodeState], prompt_keys: list[BlockKey], exclude: Collection[str] = ()
) -> PrefillChoice | None:
    candidates = [n for n in nodes if n.node_id not in exclude]
    if not candidates:
        return None
    least = min(candidates, key=lambda n: (n.load, -n.free_blocks, n.node_id))
    best = PrefillChoice(least, least.prefix_hit_blocks(prompt_keys))
    for node in candidates:
        hits = node.prefix_hit_blocks(prompt_keys)
        if hits > best.prefix_hit_blocks and node.load <= least.load + PREFIX_LOAD_SLACK:
            best = PrefillChoice(node, hits)
    return best


def pick_decode(nodes: list[NodeState], exclude: Collection[str] = ()) -> NodeState | None:
    candidates = [n for n in nodes if n.node_id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (n.load, -n.free_blocks, n.node_id))
