"""/health's store field: the nodes' circuit breakers, as their heartbeats report them."""

from __future__ import annotations

import uuid

from protocol import messages as P
from router.registry import Registry
from router.store_health import REACHABLE_STAT, store_health


def _registry(nodes: dict[str, tuple[bool, float | None]]) -> Registry:
    """node id -> (has a store, reported reachable flag or None for no report yet)."""
    reg = Registry("m")
    for node_id, (has_store, reachable) in nodes.items():
        reg.register(
            P.Register(
                node_id=node_id,
                role=P.NodeRole.DECODE,
                model="m",
                model_fingerprint="fp",
                dtype="float32",
                block_size=16,
                max_model_len=512,
                capacity=4,
                num_blocks=8,
                has_store=has_store,
                instance=uuid.uuid4().hex,
            )
        )
        stats = {} if reachable is None else {REACHABLE_STAT: reachable}
        reg.heartbeat(P.Heartbeat(node_id=node_id, running=0, waiting=0, free_blocks=8, stats=stats))
    return reg


def test_store_state_from_the_nodes_breakers() -> None:
    def state(nodes: dict[str, tuple[bool, float | None]]) -> str:
        return store_health(_registry(nodes).nodes.values())["state"]

    assert state({}) == "none"
    assert state({"d0": (False, None)}) == "none"  # a node without a store says nothing about one
    assert state({"d0": (True, None)}) == "none"  # no report yet
    assert state({"d0": (True, 1.0), "d1": (True, 1.0)}) == "reachable"
    assert state({"d0": (True, 0.0), "d1": (True, 0.0), "p0": (False, None)}) == "unreachable"
    assert state({"d0": (True, 1.0), "d1": (True, 0.0)}) == "partial"
    assert store_health(_registry({"d0": (True, 0.0)}).nodes.values())["reachable_from"] == {"d0": False}
