"""The KV store's state as the nodes see it, for `/health`: each node's store client runs a circuit breaker
(ucm/circuit_breaker.py) and reports `connector_store_reachable` in its heartbeat stats."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

from router.registry import NodeState

REACHABLE_STAT = "connector_store_reachable"


class StoreState(enum.Enum):
    REACHABLE = "reachable"  # every node with a store reaches it
    UNREACHABLE = "unreachable"  # no node does: every prompt is recomputed, outputs unchanged
    PARTIAL = "partial"  # some nodes do (a network split, or a breaker that has not probed yet)
    NONE = "none"  # no node uses a store (or none has reported yet)


def store_health(nodes: Iterable[NodeState]) -> dict[str, Any]:
    seen = {n.node_id: n.stats[REACHABLE_STAT] >= 1 for n in nodes if n.info.has_store and REACHABLE_STAT in n.stats}
    if not seen:
        state = StoreState.NONE
    elif all(seen.values()):
        state = StoreState.REACHABLE
    elif not any(seen.values()):
        state = StoreState.UNREACHABLE
    else:
        state = StoreState.PARTIAL
    return {"state": state.value, "reachable_from": dict(sorted(seen.items()))}
