"""Load and faults on real processes: a burst beyond the cluster's capacity on a slow (but alive) prefill node is
served in full with every prompt prefilled once; overload beyond the admission queue gets 429 + Retry-After and
the server goes on serving; a prefill node killed mid-request is replaced by the decode node, once.

One cluster for the module (order matters: the kill comes last). The router gives up on a node that holds its
requests and makes no step for STALL_S; prefill-0 sleeps STALL_S / 8 in every engine step (UCM_TEST_STEP_DELAY_S)
and prefills one prompt a step (max_num_seqs 1), so the burst keeps it busy for len(PROMPTS) steps, longer than
STALL_S by construction (the test checks that too): a router that timed requests, not steps, would retry them.
No step comes near the window: the 7 s left beside the sleep are the step's own compute (tens of milliseconds) and
a heartbeat, however loaded the box.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import signal
import time

import httpx
import pytest

from launch.cluster import Cluster, ClusterSpec
from tests.cluster_helpers import health_nodes
from tests.cluster_helpers import metric as cluster_metric
from tests.cluster_helpers import wait_until as cluster_wait_until

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
SEQS = 1  # max_num_seqs of each node: router slots = 1 (prefill) + 1 (decode); prefill-0 runs a prompt a step
QUEUED = 8  # --max-queued-requests: the whole burst is admitted (2 running + 8 queued)
STALL_S = 8.0  # the router's --stall-timeout
STEP_DELAY_S = STALL_S / 8  # prefill-0's sleep in every step: far inside the window, whatever the box's load
WORDS = ["river", "mountain", "library", "harbour", "orchard", "lighthouse", "market", "tower", "bridge", "garden"]
PROMPTS = [f"Note {i}: the {w} is" for i, w in enumerate(WORDS)]
assert len(PROMPTS) * STEP_DELAY_S > STALL_S, "the burst must keep prefill-0 busy past the stall window"
assert len(PROMPTS) <= 2 * SEQS + QUEUED, "the burst must be admitted whole (no 429)"


@pytest.fixture(scope="module")
def offline():
    from engine import LLM, SamplingParams

    llm = LLM(model=MODEL, dtype="float32", kv_cache_memory="128MiB")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def cluster(offline):  # offline first: its CPU time must not starve the nodes' steps while they are watched
    spec = ClusterSpec(
        prefill=1,
        decode=1,
        dtype="float32",
        kv_cache_memory="128MiB",
        max_num_seqs=SEQS,
        node_timeout_s=5.0,  # 25 heartbeats: a loaded box delays some, never that many
        heartbeat_interval_s=0.2,
        node_args=("--threads", "1"),
        node_env={"prefill-0": {"UCM_TEST_STEP_DELAY_S": str(STEP_DELAY_S)}},
        router_args=(
            *("--stall-timeout", str(STALL_S), "--max-queued-requests", str(QUEUED)),
            *("--max-queue-wait-s", "0.01"),
        ),
        supervise=False,  # the killed prefill node must stay dead: the decode node prefills instead, exactly once
    )
    with Cluster(spec, log=lambda s: None) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=300)


def metric(cluster: Cluster, metric_name: str, **labels: str) -> float:
    return cluster_metric(cluster.url, metric_name, **labels)


def jobs(cluster: Cluster, node: str, kind: str) -> float:
    return metric(cluster, f"ucm_node_jobs_{kind}_started_total", node=node)


def wait_until(what: str, condition, timeout: float = 60.0) -> None:
    cluster_wait_until(what, condition, timeout, poll_s=0.1)


def wait_idle(cluster: Cluster) -> None:
    def idle() -> bool:
        nodes = httpx.get(cluster.url + "/health").json()["nodes"]
        return (
            all(n["running"] == 0 and n["waiting"] == 0 for n in nodes.values())
            and metric(cluster, "ucm_running_sequences") == 0
        )

    wait_until("the cluster to be idle", idle)


def test_burst_on_a_slow_prefill_node_completes_and_prefills_each_prompt_once(cluster, client, offline) -> None:
    before = {
        k: jobs(cluster, n, k)
        for n, k in [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-0", "local_prefill")]
    }

    def ask(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:  # 5x what the nodes run at once
        got = list(pool.map(ask, PROMPTS))
    took = time.monotonic() - t0
    assert got == [offline[p] for p in PROMPTS]
    # One prefill after another on prefill-0, each at least STEP_DELAY_S: a lower bound no load can shorten.
    assert took > STALL_S, f"the burst took {took:.1f} s, inside the stall window: it tested nothing"
    # Heartbeats carry the nodes' job counters: wait for them to account for every request, then check none
    # was started twice (a retried prefill would be a second start on the decode node).
    wait_until(
        "the prefill counter to count the burst",
        lambda: jobs(cluster, "prefill-0", "prefill") >= before["prefill"] + len(PROMPTS),
    )
    wait_until(
        "the decode counter to count the burst",
        lambda: jobs(cluster, "decode-0", "decode") >= before["decode"] + len(PROMPTS),
    )
    wait_idle(cluster)
    assert jobs(cluster, "prefill-0", "prefill") == before["prefill"] + len(PROMPTS)
    assert jobs(cluster, "decode-0", "decode") == before["decode"] + len(PROMPTS)
    assert jobs(cluster, "decode-0", "local_prefill") == before["local_prefill"]
    assert metric(cluster, "ucm_prefill_retries_total") == 0 and metric(cluster, "ucm_local_prefills_total") == 0
    assert metric(cluster, "ucm_node_events_total", event="stalled") == 0
    assert metric(cluster, "ucm_node_events_total", event="dropped") == 0
    assert metric(cluster, "ucm_requests_rejected_total") == 0


def test_overload_beyond_the_queue_gets_429_then_the_server_serves(cluster, client, offline) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell a long story about a lighthouse keeper.",
        "max_tokens": 1000,  # the running two hold their slots for seconds of decode: the queue stays full meanwhile
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=cluster.url, timeout=120) as http, contextlib.ExitStack() as streams:
        # The response head is sent once admission decided: 1 + 1 run on the nodes, QUEUED wait in the router.
        for i in range(2 * SEQS + QUEUED):
            r = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert r.status_code == 200, (i, r.read())
        assert metric(cluster, "ucm_queue_depth_requests") == QUEUED
        r = http.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "rate_limit_exceeded"
        assert metric(cluster, "ucm_requests_rejected_total") == 1
    # Closing the streams aborted them (queued ones left the queue); the server serves the next request.
    wait_until("the queue to drain", lambda: metric(cluster, "ucm_queue_depth_requests") == 0)
    wait_idle(cluster)
    prompt = PROMPTS[0]
    assert (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
        == offline[prompt]
    )


def test_killed_prefill_node_is_replaced_by_the_decode_node_once(cluster, client, offline) -> None:
    wait_idle(cluster)
    prompt = PROMPTS[2]
    local = jobs(cluster, "decode-0", "local_prefill")
    # Frozen first, so the kill certainly lands while prefill-0 holds the request: killed during its step's sleep
    # instead, the kill could come after the prefill on a loaded box and the failover would not be tested.
    victim = cluster.children["prefill-0"]
    victim.proc.send_signal(signal.SIGSTOP)
    with cf.ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
        )
        wait_until(
            "the router to send prefill-0 the job",
            lambda: health_nodes(cluster.url).get("prefill-0", {}).get("load", 0) > 0,
        )
        victim.kill()  # SIGKILL (a stopped process dies too) with the job in flight
        assert future.result(timeout=120) == offline[prompt]
    assert metric(cluster, "ucm_local_prefills_total") == 1 and metric(cluster, "ucm_prefill_retries_total") == 0
    wait_until(
        "the decode node to report the local prefill", lambda: jobs(cluster, "decode-0", "local_prefill") >= local + 1
    )
    assert jobs(cluster, "decode-0", "local_prefill") == local + 1, "the prompt was prefilled twice on decode-0"
