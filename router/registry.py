"""The router's view of its nodes: who registered, their load and prefix-cache summary, who went silent or stuck.

A node that misses heartbeats for `timeout_s`, or holds the router's requests without its step counter moving
for `stall_timeout_s` (router/progress.py), is dropped (its in-flight jobs fail over, see NodeClient); when its
heartbeats come back it is told to register again and is re-added.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from common.keys import BlockKey, KeyNamespace, block_keys, root_key
from protocol import messages as P
from router.config import RouterConfig
from router.progress import ProgressWatch
from router.step_cost import StepCost

log = logging.getLogger(__name__)


@dataclass
class NodeState:
    info: P.Register
    last_seen: float
    progress: ProgressWatch
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    cached_keys: frozenset[bytes] = frozenset()
    stats: dict[str, float] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)  # request ids the router has outstanding on this node
    # Prompt tokens of the router's prefill jobs on this node not answered yet, as pairing counted them to compute
    # (the queue ahead of the next prompt); the dispatcher adds and subtracts them.
    queued_tokens: int = 0
    cost: StepCost = field(default_factory=StepCost)  # this process's measured step costs (its heartbeats)

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def role(self) -> P.NodeRole:
        return self.info.role

    @property
    def namespace(self) -> KeyNamespace:
        return KeyNamespace(self.info.model_fingerprint, self.info.dtype, self.info.block_size)

    @property
    def in_flight(self) -> int:
        return len(self.inflight)

    @property
    def load(self) -> float:
        """Fraction of capacity in use; the router's own in-flight count covers heartbeat lag."""
        busy = max(self.running + self.waiting, len(self.inflight))
        return busy / max(1, self.info.capacity)

    def prefix_hit_blocks(self, keys: list[BlockKey]) -> int:
        n = 0
        for key in keys:
            if key not in self.cached_keys:
                break
            n += 1
        return n


class Registry:
    def __init__(
        self,
        model_name: str,
        timeout_s: float = RouterConfig.node_timeout_s,
        stall_timeout_s: float = RouterConfig.stall_timeout_s,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"node timeout must be positive, got {timeout_s}")
        if stall_timeout_s <= 0:
            raise ValueError(f"stall timeout must be positive, got {stall_timeout_s}")
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.nodes: dict[str, NodeState] = {}
        # node id -> the incarnation being drained (router/drain.py): alive() skips it, so it gets no new jobs
        self.draining: dict[str, str] = {}

    def register(self, msg: P.Register, now: float | None = None) -> tuple[P.Welcome, NodeState | None]:
        """Add or refresh a node. Also returns the state of a previous incarnation with the same id (restarted
        process) whose in-flight jobs are lost, or None."""
        if msg.protocol_version != P.PROTOCOL_VERSION:
            reason = f"protocol version {msg.protocol_version} != {P.PROTOCOL_VERSION}"
            return P.Welcome(msg.node_id, P.WelcomeCode.PROTOCOL_MISMATCH, reason), None
        if msg.model != self.model_name:
            reason = f"node serves model {msg.model!r}, router serves {self.model_name!r}"
            return P.Welcome(msg.node_id, P.WelcomeCode.MODEL_MISMATCH, reason), None
        others = [n for n in self.nodes.values() if n.node_id != msg.node_id]
        if others and others[0].namespace != KeyNamespace(msg.model_fingerprint, msg.dtype, msg.block_size):
            # Mixed namespaces would make every store lookup miss between the two groups.
            reason = "model fingerprint / dtype / block size differ from other nodes"
            return P.Welcome(msg.node_id, P.WelcomeCode.NAMESPACE_MISMATCH, reason), None
        old = self.nodes.get(msg.node_id)
        now = now or time.monotonic()
        state = NodeState(
            info=msg, last_seen=now, progress=ProgressWatch(self.stall_timeout_s), free_blocks=msg.num_blocks
        )
        lost = None
        if old is not None and old.info.instance == msg.instance:
            state.inflight = old.inflight  # the same process registering again: its jobs are still running
            state.progress = old.progress
            state.queued_tokens, state.cost = old.queued_tokens, old.cost
        else:
            lost = old
        self.nodes[msg.node_id] = state
        log.info("node %s registered (%s, capacity %d)", msg.node_id, msg.role.value, msg.capacity)
        return P.Welcome(msg.node_id, P.WelcomeCode.ACCEPTED), lost

    def heartbeat(self, msg: P.Heartbeat, now: float | None = None) -> P.Welcome | None:
        """Update a node's load; a Welcome(UNKNOWN_NODE) asks an unknown node to register."""
        node = self.nodes.get(msg.node_id)
        if node is None:
            return P.Welcome(msg.node_id, P.WelcomeCode.UNKNOWN_NODE, "unknown node; register again")
        node.last_seen = now or time.monotonic()
        node.progress.reported(msg.steps, node.last_seen)
        node.running, node.waiting, node.free_blocks = msg.running, msg.waiting, msg.free_blocks
        node.stats = msg.stats
        node.cost.observe(msg.stats, node.last_seen)
        if msg.cached_keys is not None:
            node.cached_keys = frozenset(msg.cached_keys)
        return None

    def expire(self, now: float | None = None) -> list[NodeState]:
        """Drop nodes that missed heartbeats; returns them so their jobs can fail over."""
        now = now or time.monotonic()
        dead = [n for n in self.nodes.values() if now - n.last_seen > self.timeout_s]
        for node in dead:
            log.warning("node %s missed heartbeats for %.1fs: dropped", node.node_id, now - node.last_seen)
            del self.nodes[node.node_id]
        return dead

    def drop_stalled(self, now: float | None = None) -> list[NodeState]:
        """Drop nodes that hold our requests but made no step for the stall window; returns them."""
        now = now or time.monotonic()
        stuck = [n for n in self.nodes.values() if n.progress.stalled(now)]
        for node in stuck:
            log.warning(
                "node %s made no progress for %.1fs with %d requests: dropped",
                node.node_id,
                node.progress.stalled_for(now),
                len(node.inflight),
            )
            del self.nodes[node.node_id]
        return stuck

    def drop(self, node_id: str) -> NodeState | None:
        return self.nodes.pop(node_id, None)

    def alive(self, *roles: P.NodeRole) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.role in roles and not self.is_draining(n)]

    def is_draining(self, node: NodeState) -> bool:
        return self.draining.get(node.node_id) == node.info.instance

    def capacity(self) -> int:
        """Sequences the nodes hold at once: each request passes a prefill slot, then a decode slot, so the sum
        over all nodes keeps both stages fed."""
        return sum(n.info.capacity for n in self.nodes.values() if not self.is_draining(n))

    def any_node(self) -> NodeState | None:
        return next(iter(self.nodes.values()), None)

    def max_model_len(self) -> int | None:
        lens = [n.info.max_model_len for n in self.nodes.values()]
        return min(lens) if lens else None

    def prompt_keys(self, token_ids: list[int], cache_salt: str | None) -> list[BlockKey]:
        node = self.any_node()
        if node is None:
            return []
        ns = node.namespace
        return block_keys(root_key(ns, cache_salt), token_ids, ns.block_size)
