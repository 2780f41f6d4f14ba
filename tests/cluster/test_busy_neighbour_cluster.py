"""The first wave of a real client's requests beside a busy process (issues 48 and 54), on real processes: store,
one colocated node with both cores (what `up` starts on a small host), router. guidellm's first wave stalled for
its full length while its own worker processes prepared data, and a wave beside one busy loop took 35-43x its idle
time: the node's OpenMP regions each waited for its thread on the shared core. Here the wave is guidellm's recorded
request (tests/router/client_fixtures/) sent 4 at once while a busy loop spins, on a node that just registered: every
request completes with its usage, the greedy text equals the idle run's, and the node's thread governor reacted
(its `threads` gauge and `thread_changes` counter on /metrics). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from launch.cluster import Cluster, ClusterSpec
from tests.cluster_helpers import metric

pytestmark = pytest.mark.slow

FIXTURE = (
    Path(__file__).resolve().parents[1] / "router" / "client_fixtures" / "guidellm-v1-chat-completions-stream.json"
)


def _wave(url: str, body: dict, n: int = 4) -> list[dict]:
    """n concurrent streams of `body`, each read to its end: (text, last usage) per stream."""
    results: list[dict] = [{} for _ in range(n)]

    def one(i: int) -> None:
        text, usage = "", None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: ") :])
                    assert "error" not in event, event
                    usage = event.get("usage") or usage
                    for choice in event["choices"]:
                        text += choice["delta"].get("content") or ""
        results[i] = {"text": text, "usage": usage}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_a_first_wave_beside_a_busy_process_completes_unchanged() -> None:
    body = {**json.loads(FIXTURE.read_text())["body"], "max_completion_tokens": 24, "temperature": 0}
    spec = ClusterSpec(prefill=0, decode=0, colocated=1, kv_cache_memory="128MiB", dtype="float32")
    with Cluster(spec, log=lambda s: None) as cluster:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            first = _wave(cluster.url, body)
            deadline = time.monotonic() + 300
            beside = first
            while metric(cluster.url, "ucm_node_thread_changes_total") < 1:  # the governor decides between steps
                assert time.monotonic() < deadline, "the node's governor never saw the busy process"
                beside = _wave(cluster.url, body)
            assert metric(cluster.url, "ucm_node_threads") == 1
        finally:
            busy.kill()
            busy.wait()
        idle = _wave(cluster.url, body)
    for wave in (first, beside, idle):
        assert all(r["usage"] and r["usage"]["completion_tokens"] == 24 for r in wave), wave
    assert {r["text"] for r in first + beside + idle} == {idle[0]["text"]}, "greedy text independent of the neighbour"
