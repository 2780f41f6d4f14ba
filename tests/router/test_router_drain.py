"""Draining a node (router/drain.py): no new jobs and no admission capacity for the drained incarnation, its
in-flight count visible until it reaches zero; a restarted incarnation under the same id is not draining."""

from __future__ import annotations

from protocol import messages as P
from router.drain import drain, node_views
from router.pairing import pick_decode
from router.registry import Registry


def _reg(node_id: str, role: P.NodeRole, instance: str) -> P.Register:
    return P.Register(node_id, role, "m", "fp", "float32", 4, 1024, 8, 100, True, instance=instance)


def test_drained_node_gets_no_jobs_until_it_leaves() -> None:
    reg = Registry("m")
    for node_id in ("d0", "d1"):
        reg.register(_reg(node_id, P.NodeRole.DECODE, "a"))
    reg.nodes["d1"].inflight.update({"r1", "r2"})
    assert reg.capacity() == 16
    view = drain(reg, "d1")
    assert view is not None and view.draining and view.inflight == 2
    assert [n.node_id for n in reg.alive(P.NodeRole.DECODE)] == ["d0"]
    assert reg.capacity() == 8  # the drained node's slots no longer admit requests
    # Even the least loaded pick never lands on it.
    reg.nodes["d0"].inflight.update({f"x{i}" for i in range(8)})
    assert pick_decode(reg.alive(P.NodeRole.DECODE)).node_id == "d0"
    reg.nodes["d1"].inflight.clear()
    views = {v.node_id: v for v in node_views(reg)}
    assert views["d1"].inflight == 0 and views["d1"].draining and not views["d0"].draining
    assert drain(reg, "nope") is None


def test_restarted_incarnation_is_not_draining() -> None:
    reg = Registry("m")
    reg.register(_reg("d0", P.NodeRole.DECODE, "a"))
    drain(reg, "d0")
    assert reg.alive(P.NodeRole.DECODE) == []
    reg.register(_reg("d0", P.NodeRole.DECODE, "b"))  # a new process under the same id (Ray restarted it)
    assert [n.node_id for n in reg.alive(P.NodeRole.DECODE)] == ["d0"]
