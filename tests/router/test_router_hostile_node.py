"""Issue 11, "one bad request must not kill the cluster", at the router: the real app over real HTTP (uvicorn on a
thread) in front of a real node runtime (NodeServer, JobRunner, heartbeats over ZeroMQ) whose engine is a fake
(tests/node_helpers.py), so every case runs in milliseconds.

- jobs out of bounds sent straight to the node over ZeroMQ get JobFailed; a step that raises fails its requests
  only; the node goes on serving
- garbage on the router's node socket (deep nesting, random bytes, oversized frames) is counted, not fatal
- a non-streaming client that disconnects has its request aborted on the node
- metric labels stay bounded: unknown paths collapse to one label, departed nodes' series go
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import uuid
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from protocol import messages as P
from tests.node_helpers import EXPLODE, HOLD, VOCAB, FakeNode
from tests.router.hostile_live import CHAT, MODEL, NODE, C, Live, assert_served, metric, wait_until

# ------------------------------------------------------------------ the node


async def _ask(live: Live, job: P.PrefillJob | P.DecodeJob) -> list[Any]:
    """Send `job` straight to the node through the router's NodeClient; every reply until the job ends."""
    client = live.app.state.node_client
    node = client.registry.nodes[NODE]
    queue = client.open(job.request_id, node)
    replies: list[Any] = []
    try:
        await client.send(NODE, job)
        while True:
            reply = await asyncio.wait_for(queue.get(), 30)
            replies.append(reply)
            if isinstance(reply, P.JobFailed) or getattr(reply, "finished", False):
                return replies
    finally:
        client.close_stream(job.request_id)


def _job(salt: str | None = None, **params: Any) -> P.DecodeJob:
    spec = P.SamplingSpec(**{"max_tokens": 3, **params})
    return P.DecodeJob(uuid.uuid4().hex, [1, 2, 3], spec, cache_salt=salt)


BAD_JOBS = [
    {"top_k": 2**63, "temperature": 1.0},
    {"top_k": -5},
    {"logprobs": 10**6},
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"top_p": 0.0},
    {"max_tokens": 0},
    {"seed": 2**63},
    {"stop_token_ids": [2**63]},
    {"stop_token_ids": [VOCAB]},
]


@pytest.mark.parametrize("params", BAD_JOBS, ids=[next(iter(p)) + "=" + str(next(iter(p.values()))) for p in BAD_JOBS])
def test_out_of_bounds_job_gets_job_failed_and_the_node_serves_on(live: Live, params: dict[str, Any]) -> None:
    replies = live.run(_ask(live, _job(**params)))
    assert len(replies) == 1 and isinstance(replies[0], P.JobFailed), replies
    assert replies[0].message.startswith("bad job: " + next(iter(params))), replies[0].message
    good = live.run(_ask(live, _job()))
    assert isinstance(good[-1], P.TokenBatch) and good[-1].finished
    assert sum(len(b.token_ids) for b in good) == 3


def test_bad_token_ids_and_transfer_params_are_refused(live: Live) -> None:
    for job in (
        P.DecodeJob(uuid.uuid4().hex, [VOCAB], P.SamplingSpec(max_tokens=2)),
        P.DecodeJob(uuid.uuid4().hex, [-1], P.SamplingSpec(max_tokens=2)),
        P.DecodeJob(uuid.uuid4().hex, [1], P.SamplingSpec(max_tokens=2), first_token_id=2**40),
        P.DecodeJob(uuid.uuid4().hex, [1], P.SamplingSpec(max_tokens=2), kv_transfer_params=_deep_dict(40)),
    ):
        replies = live.run(_ask(live, job))
        assert isinstance(replies[-1], P.JobFailed), replies
    assert isinstance(live.run(_ask(live, _job()))[-1], P.TokenBatch)


def _deep_dict(depth: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(depth):
        d = {"a": d}
    return d


def test_a_step_that_raises_fails_its_requests_only(live: Live) -> None:
    held = _job(HOLD)
    held_task = asyncio.run_coroutine_threadsafe(_ask(live, held), live.loop)
    wait_until("the held job to reach the engine", lambda: held.request_id in _added(live))
    replies = live.run(_ask(live, _job(EXPLODE)))
    assert isinstance(replies[-1], P.JobFailed) and "engine step failed" in replies[-1].message, replies
    assert not held_task.done(), "a request outside the failed step was failed too"
    live.run(live.app.state.node_client.abort(NODE, [held.request_id]))
    wait_until("the held job to be aborted", lambda: held.request_id in _aborted(live))
    held_task.cancel()
    assert isinstance(live.run(_ask(live, _job()))[-1], P.TokenBatch)
    wait_until(
        "the heartbeat to report the step error",
        lambda: metric(live, "ucm_node_jobs_step_errors_total", node=NODE) >= 1,
    )
    assert_served(live)


def test_a_stream_that_fails_midway_leaves_an_access_line(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.access")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "cache_salt": EXPLODE}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        text = "".join(r.iter_text())
    assert r.status_code == 200 and "engine step failed" in text, text  # the error arrives in-band

    def line() -> str | None:
        return next(
            (m.getMessage() for m in caplog.records if m.name == "router.access" and "in-band" in m.getMessage()), None
        )

    wait_until("the failed stream's access line", lambda: line() is not None)
    found = line()
    assert found is not None and re.match(r"cmpl-\w+ POST /v1/completions 200 prompt=\d+ ", found), found
    assert "engine step failed" in found, found
    assert_served(live)


def _added(live: Live) -> list[str]:
    with live.node.engine.lock:
        return list(live.node.engine.added)


def _aborted(live: Live) -> list[str]:
    with live.node.engine.lock:
        return list(live.node.engine.aborted)


# ------------------------------------------------------------------ the router's node socket


def _deep_prefill_done(depth: int) -> bytes:
    head = msgspec.msgpack.encode({"type": "prefill_done", "request_id": "x", "first_token_id": 1, "finished": False})
    assert head[0] == 0x84, "a 4-entry fixmap"
    return b"\x85" + head[1:] + msgspec.msgpack.encode("kv_transfer_params") + b"\x81\xa1a" + b"\x91" * depth + b"\xc0"


def test_garbage_on_the_node_socket_is_counted_and_the_router_serves_on(live: Live) -> None:
    before = metric(live, "ucm_node_messages_dropped")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"intruder")
        sock.connect(live.app.state.nodes_address)
        frames = [
            _deep_prefill_done(5000),
            _deep_prefill_done(100_000),
            b"\xc1\xff garbage",
            b"",
            msgspec.msgpack.encode({"type": "heartbeat", "node_id": 5}),
            P.encode(P.Abort(["x"])),
        ]
        for frame in frames:
            sock.send(frame)
        sock.send(b"\x00" * (P.MAX_MESSAGE_BYTES + 1))  # libzmq drops this peer (MAXMSGSIZE)
        wait_until(
            "the router to count the bad frames", lambda: metric(live, "ucm_node_messages_dropped") >= before + 4
        )
    finally:
        ctx.destroy(0)
    assert httpx.get(live.url + "/health").status_code == 200
    assert_served(live)


# ------------------------------------------------------------------ disconnects


def test_non_streaming_client_disconnect_aborts_on_the_node(live: Live) -> None:
    before_added, before_aborted = set(_added(live)), metric(live, "ucm_node_jobs_aborted_total", node=NODE)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 50, "cache_salt": HOLD}).encode()
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until("the request to reach the node", lambda: set(_added(live)) - before_added)
    (rid,) = set(_added(live)) - before_added
    wait_until("the node to abort the request", lambda: rid in _aborted(live))
    wait_until(
        "the heartbeat to count the abort",
        lambda: metric(live, "ucm_node_jobs_aborted_total", node=NODE) >= before_aborted + 1,
    )
    wait_until("the router to free the slot", lambda: metric(live, "ucm_running_sequences") == 0)


# ------------------------------------------------------------------ metric labels


def test_metric_labels_stay_bounded(live: Live) -> None:
    for i in range(50):
        assert httpx.get(f"{live.url}/v1/random-{uuid.uuid4().hex}-{i}").status_code == 404
    text = httpx.get(live.url + "/metrics").text
    endpoints = set(re.findall(r'ucm_requests_total\{endpoint="([^"]*)"', text))
    assert endpoints <= {"/v1/completions", "/v1/chat/completions", "/v1/models", "other"}, endpoints
    # A node that leaves takes its series with it.
    ghost = FakeNode(live.app.state.nodes_address, "ghost-1").start()
    wait_until("the ghost node's series", lambda: metric(live, "ucm_node_up", node="ghost-1") == 1)
    ghost.stop()
    live.run(_drop(live, "ghost-1"))
    wait_until(
        "the ghost's series to go",
        lambda: (
            'node="ghost-1"'
            not in re.sub(r"ucm_node_events_(total|created)\{[^}]*\} \S+", "", httpx.get(live.url + "/metrics").text)
        ),
    )
    # Node events keep at most MAX_EVENT_NODES departed node ids.
    from router.metrics import MAX_EVENT_NODES

    metrics = live.app.state.metrics
    for i in range(3 * MAX_EVENT_NODES):
        live.loop.call_soon_threadsafe(metrics.node_event, f"stranger-{i}", "refused")
    wait_until(
        "the events to be recorded",
        lambda: metric(live, "ucm_node_events_total", node=f"stranger-{3 * MAX_EVENT_NODES - 1}") == 1,
    )
    nodes = set(re.findall(r'ucm_node_events_total\{[^}]*node="([^"]*)"', httpx.get(live.url + "/metrics").text))
    assert len(nodes) <= MAX_EVENT_NODES and NODE in nodes, nodes


async def _drop(live: Live, node_id: str) -> None:
    live.app.state.registry.drop(node_id)


# ------------------------------------------------------------------ property-based: no 5xx from the schema


def test_schema_fuzzing_never_gets_a_5xx(live: Live) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    spec = json.loads(json.dumps(live.app.openapi()))
    for path in (C, CHAT):  # random model names would all stop at the 404: fuzz what lies behind it
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    schema = schemathesis.openapi.from_dict(spec)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    mode = schemathesis.GenerationMode
    for operation in (schema["/v1/completions"]["POST"], schema["/v1/chat/completions"]["POST"]):
        # Both valid requests (served by the fake node) and invalid ones (refused): neither may be a 5xx.
        cases = operation.as_strategy(mode.POSITIVE) | operation.as_strategy(mode.NEGATIVE)

        @settings(
            max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(case=cases)
        def fuzz(case: Any) -> None:
            r = case.call(base_url=live.url, timeout=60)  # schemathesis serializes what it generated (bytes too)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                failures.append(f"{r.status_code} {case.body!r:.300} -> {r.text[:300]}")

        fuzz()
    assert not failures, failures[:5]
    assert statuses.get(200, 0) >= 5 and sum(n for s, n in statuses.items() if 400 <= s < 500) >= 20, statuses
