"""`ucm-serve router --insecure` (the off path): a node without keys registers and serves a request end to end.
The node here is a fake on real sockets (no model), answering the router's DecodeJob itself."""

from __future__ import annotations

import sys
import threading

import httpx
import pytest
import zmq

from launch.child import Child
from launch.ports import free_port
from protocol import messages as P
from protocol.peer_identity import Channel, PeerIdentity

pytestmark = pytest.mark.slow


def test_insecure_router_serves_a_node_without_keys() -> None:
    port, nodes = free_port(), f"tcp://127.0.0.1:{free_port()}"
    router = Child(
        "router",
        [
            sys.executable,
            "-m",
            "launch.cli",
            "router",
            "--port",
            str(port),
            "--bind-nodes",
            nodes,
            "--insecure",
            "--node-timeout",
            "600",
        ],
        sink=open("/dev/null", "w"),
    )
    ctx = zmq.Context()
    hb, job = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        router.wait_for(r"nodes connect to", 120)
        assert "without authentication" in router.output()
        for sock, channel in ((hb, Channel.HEARTBEAT), (job, Channel.JOB)):
            sock.setsockopt(zmq.IDENTITY, PeerIdentity("decode-0", channel, "i1").encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(nodes)
        hb.send(
            P.encode(
                P.Register(
                    "decode-0",
                    P.NodeRole.DECODE,
                    "smollm2-135m",
                    "fp",
                    "float32",
                    16,
                    2048,
                    4,
                    100,
                    False,
                    instance="i1",
                )
            )
        )
        assert hb.poll(60_000) and P.decode(hb.recv()).accepted
        result: dict[str, httpx.Response] = {}
        body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        ask = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
            )
        )
        ask.start()
        assert job.poll(60_000), "no job reached the node"
        decode = P.decode(job.recv())
        assert isinstance(decode, P.DecodeJob) and decode.params.max_tokens == 2
        job.send(
            P.encode(P.TokenBatch(decode.request_id, [28, 29], finished=True, finish_reason=P.FinishReason.LENGTH))
        )
        ask.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        hb.close(0)
        job.close(0)
        ctx.term()
        router.stop()
