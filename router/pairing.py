"""Which prefill node and which decode node serve a request.

Prefill: the node whose device cache already holds the longest prefix of the prompt's block keys wins,
unless it is much busier than the least-loaded one (a hit saves compute only if the node is not the
bottleneck); otherwise the least loaded. What a node holds comes from the KV event index where the node publishes
events (`hits`, router/kv_index.py), else from the recent keys in its heartbeats. Decode: the least loaded (fewest
running + waiting per capacity), ties broken by free KV blocks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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
    nodes: list[NodeState],
    prompt_keys: list[BlockKey],
    exclude: Collection[str] = (),
    hits: Mapping[str, int] | None = None,
) -> PrefillChoice | None:
    """`hits`: node id -> leading prompt blocks it holds, for the nodes whose KV events are indexed; the others
    answer from their heartbeat summaries."""
    candidates = [n for n in nodes if n.node_id not in exclude]
    if not candidates:
        return None

    def held(node: NodeState) -> int:
        if hits is not None and node.node_id in hits:
            return hits[node.node_id]
        return node.prefix_hit_blocks(prompt_keys)

    least = min(candidates, key=lambda n: (n.load, -n.free_blocks, n.node_id))
    best = PrefillChoice(least, held(least))
    for node in candidates:
        hits_here = held(node)
        if hits_here > best.prefix_hit_blocks and node.load <= least.load + PREFIX_LOAD_SLACK:
            best = PrefillChoice(node, hits_here)
    return best


def pick_decode(nodes: list[NodeState], exclude: Collection[str] = ()) -> NodeState | None:
    candidates = [n for n in nodes if n.node_id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (n.load, -n.free_blocks, n.node_id))
