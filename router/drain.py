"""Draining a node: it gets no new jobs, finishes the ones it holds, then may leave (`ucm-serve scale --decode -1`).

The registry remembers which incarnation is draining (`Registry.draining`: node id -> instance); `Registry.alive`,
which every pick (router/pairing.py, via the dispatcher) and the admission capacity go through, skips it. A node
restarted under the same id is a new incarnation and is not draining. A pick and the job's `NodeClient.open` run
without an await between them, so once `drain` returned on the event loop the node's in-flight count only falls:
zero means it holds none of the router's requests and can be stopped without failing one.

Call these on the router's event loop (the registry is not locked).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import messages as P
from router.registry import NodeState, Registry


@dataclass(frozen=True)
class NodeView:
    """One registered node as the router sees it (what `ucm-serve status` shows)."""

    node_id: str
    role: P.NodeRole
    instance: str
    running: int
    waiting: int
    load: float
    inflight: int  # requests the router has outstanding on it
    free_blocks: int
    draining: bool


def view(registry: Registry, node: NodeState) -> NodeView:
    return NodeView(
        node.node_id,
        node.role,
        node.info.instance,
        node.running,
        node.waiting,
        node.load,
        len(node.inflight),
        node.free_blocks,
        registry.is_draining(node),
    )


def node_views(registry: Registry) -> list[NodeView]:
    return [view(registry, n) for n in registry.nodes.values()]


def drain(registry: Registry, node_id: str) -> NodeView | None:
    """Send `node_id`'s current incarnation no new jobs; its view, or None if it is not registered."""
    node = registry.nodes.get(node_id)
    if node is None:
        return None
    registry.draining[node_id] = node.info.instance
    return view(registry, node)
