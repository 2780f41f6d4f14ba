"""Progress-based failure detection without processes: a busy node that keeps stepping is never given up on."""

from __future__ import annotations

import asyncio

import pytest

from protocol import messages as P
from router.node_client import NodeClient, NodeLost
from router.progress import ProgressWatch
from router.registry import Registry


def _reg(node_id: str) -> P.Register:
    return P.Register(node_id, P.NodeRole.PREFILL, "m", "fp", "float32", 4, 1024, 8, 100, True, instance="a")


def test_watch_counts_only_busy_time_without_steps() -> None:
    w = ProgressWatch(stall_s=2.0)
    w.reported(5, now=0.0)
    assert not w.stalled(now=100.0), "an idle node is never stalled"
    w.work_started(now=100.0)
    assert not w.stalled(now=101.9)
    w.reported(6, now=101.9)  # one step: the window starts again
    assert not w.stalled(now=103.8)
    w.reported(6, now=103.8)  # a heartbeat without a step is no progress
    assert w.stalled(now=104.0) and w.stalled_for(104.0) == pytest.approx(2.1)
    w.work_ended()
    assert not w.stalled(now=200.0)
    with pytest.raises(ValueError):
        ProgressWatch(stall_s=0)


def test_registry_drops_only_the_busy_node_that_stopped_stepping() -> None:
    reg = Registry("m", timeout_s=100.0, stall_timeout_s=5.0)
    for node_id in ("slow", "stuck", "idle"):
        reg.register(_reg(node_id), now=0.0)
    for node_id in ("slow", "stuck"):
        reg.nodes[node_id].inflight.add("r-" + node_id)
        reg.nodes[node_id].progress.work_started(0.0)
    for t in range(1, 20):  # "slow" steps every 3 s (a queue behind a long batch); "stuck" heartbeats only
        for node_id in reg.nodes:
            steps = t // 3 if node_id == "slow" else 0
            reg.heartbeat(P.Heartbeat(node_id, 1, 3, 50, steps=steps), now=float(t))
        dropped = reg.drop_stalled(now=float(t))
        if dropped:
            break
    # its first heartbeat (t=1) is its last sign of progress: dropped once 5 s have passed since
    assert [n.node_id for n in dropped] == ["stuck"] and t == 7
    assert set(reg.nodes) == {"slow", "idle"}


def test_stalled_node_fails_its_requests_over() -> None:
    async def main() -> None:
        reg = Registry("m", timeout_s=0.2, stall_timeout_s=0.1)
        client = NodeClient("tcp://127.0.0.1:0", reg)
        try:
            reg.register(_reg("p0"))
            node = reg.nodes["p0"]
            queue = client.open("r1", node)
            await client.start()
            reply = await asyncio.wait_for(queue.get(), 5)  # heartbeats keep "p0" alive only until they stop
            assert isinstance(reply, NodeLost), reply
            assert "p0" not in reg.nodes and not node.inflight
        finally:
            await client.close()

    asyncio.run(main())
