"""Issue 11, "every fault survived, nothing lost", on real processes: under concurrent streaming greedy load,
kill -9 a decode node (resumed on the other), every decode node (held until they are back, then resumed), the
prefill node and the store daemon; every admitted request completes with the fault-free text and usage, never
a 200 with an in-band error. A dead store costs one timeout per node, then the circuit breaker skips it; the
store restarted on the same LMDB serves its blocks again; bytes flipped on disk are detected, never served.

One cluster for the module, supervised (`Cluster` restarts dead children on the same address); order matters.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not an installed package

from benchmarks.lmdb_flip import flip_blocks
from benchmarks.prom_text import metric, node_stats
from benchmarks.sse_client import StreamThread
from launch.child import Child
from launch.cluster import Cluster, ClusterSpec
from tests.cluster_helpers import wait_until as cluster_wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TOKENS = 40
BLOCK = 16
WORDS = [
    "river",
    "mountain",
    "library",
    "harbour",
    "orchard",
    "lighthouse",
    "market",
    "observatory",
    "bridge",
    "garden",
]
# Two blocks and a bit each, so the store sees lookups, saves and loads for every one of them.
PROMPTS = [
    f"Note {i}: a short guide to the {w}. It explains where the {w} is, who built it, how old it is, "
    f"and why visitors like it. The guide begins:"
    for i, w in enumerate(WORDS)
]
LONG = (
    "You are a meticulous assistant for a library. The catalogue lists books by author, title, year and shelf. "
    "Patrons ask about opening hours, late fees, interlibrary loans and the reading room rules. "
) * 3
LONG_FLIPPED = (
    "A ship's log, kept by the navigator: wind from the north-west, seas moderate, two sails reefed, "
    "the coast in sight by noon, soundings of twelve fathoms near the headland. "
) * 3
ALL = [*PROMPTS, LONG, LONG_FLIPPED]


@pytest.fixture(scope="module")
def offline():
    from engine import LLM, SamplingParams

    llm = LLM(model=MODEL, dtype="float32", kv_cache_memory="128MiB")
    outs = llm.generate(ALL, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(ALL, outs, strict=True)}


@pytest.fixture(scope="module")
def token_blocks():
    """Full blocks of token ids of a prompt, as the nodes key them."""
    from engine.model_source import resolve_model_dir
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_dir(MODEL))

    def blocks(prompt: str) -> list[list[int]]:
        ids = tok.encode(prompt)
        return [ids[i * BLOCK : (i + 1) * BLOCK] for i in range(len(ids) // BLOCK)]

    return blocks


@pytest.fixture(scope="module")
def cluster(offline, tmp_path_factory):  # offline first: its CPU time must not starve the nodes' heartbeats
    spec = ClusterSpec(
        prefill=1,
        decode=2,
        dtype="float32",
        kv_cache_memory="128MiB",
        max_num_seqs=16,
        node_timeout_s=2.0,
        heartbeat_interval_s=0.2,
        node_args=("--threads", "1"),
        disk_path=str(tmp_path_factory.mktemp("store")),
        router_args=("--decode-wait", "180"),
        # Decode steps a little slower than this box makes them, so a kill lands mid-stream.
        node_env={f"decode-{i}": {"UCM_TEST_STEP_DELAY_S": "0.03"} for i in range(2)},
    )
    with Cluster(spec, log=lambda s: None) as c:
        yield c


def body(prompt: str) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def wait_until(what: str, condition, timeout: float = 120.0) -> None:
    cluster_wait_until(what, condition, timeout, poll_s=0.1)


def health(cluster: Cluster) -> dict:
    return httpx.get(cluster.url + "/health", timeout=10).json()


def registrations(cluster: Cluster, node: str) -> float:
    return metric(cluster.url, "ucm_node_events_total", node=node, event="registered")


def start(cluster: Cluster, prompts: list[str]) -> list[StreamThread]:
    streams = [StreamThread(cluster.url, body(p)) for p in prompts]
    for s in streams:
        s.start()
    return streams


def check(streams: list[StreamThread], offline: dict[str, str]) -> None:
    """Every request admitted completed, as the fault-free run, with its usage; none failed in-band."""
    for s in streams:
        s.join(600)
        r = s.result
        assert r.ok, (s.body["prompt"][:40], r.status, r.errors, r.exception)
        assert r.text == offline[s.body["prompt"]], s.body["prompt"][:40]
        assert r.usage is not None and r.usage["completion_tokens"] == TOKENS, r.usage


def kill(cluster: Cluster, name: str) -> None:
    """kill -9; the supervisor restarts it on the same address."""
    cluster.children[name].kill()


def detach(cluster: Cluster, name: str) -> Child:
    """Take a child away from the supervisor (it stays dead until started by hand)."""
    with getattr(cluster, "_lock", contextlib.nullcontext()):
        return cluster.children.pop(name)


def resumes(cluster: Cluster) -> float:
    return metric(cluster.url, "ucm_decode_resumes_total")


def test_prompts_reach_the_store(cluster, offline, token_blocks) -> None:
    streams = start(cluster, [LONG, LONG_FLIPPED])
    check(streams, offline)
    blocks = len(token_blocks(LONG)) + len(token_blocks(LONG_FLIPPED))
    wait_until(
        "the saved blocks to reach the disk tier",
        lambda: metric(cluster.url, "ucm_store_tier", tier="disk", name="blocks") >= blocks,
    )


def test_decode_node_killed_mid_stream_resumes_on_the_other(cluster, offline) -> None:
    resumed = resumes(cluster)
    before = registrations(cluster, "decode-0")
    streams = start(cluster, PROMPTS)
    wait_until(
        "decode-0 to stream",
        lambda: (
            health(cluster)["nodes"].get("decode-0", {}).get("running", 0) > 0
            and sum(s.result.chunks > 1 for s in streams) >= 3
        ),
    )
    kill(cluster, "decode-0")
    check(streams, offline)
    wait_until("the router to count a resumed request", lambda: resumes(cluster) > resumed, 10)
    wait_until("decode-0 to be restarted", lambda: registrations(cluster, "decode-0") > before)


def test_every_decode_node_killed_requests_wait_for_the_restart(cluster, offline) -> None:
    resumed = resumes(cluster)
    before = {n: registrations(cluster, n) for n in ("decode-0", "decode-1")}
    streams = start(cluster, PROMPTS[:4])
    wait_until("every request to stream", lambda: all(s.result.chunks > 1 for s in streams))
    kill(cluster, "decode-0")
    kill(cluster, "decode-1")
    check(streams, offline)
    wait_until("the router to count a resumed request", lambda: resumes(cluster) > resumed, 10)
    wait_until("both decode nodes to be back", lambda: all(registrations(cluster, n) > v for n, v in before.items()))


def test_prefill_node_killed_under_load(cluster, offline) -> None:
    before = registrations(cluster, "prefill-0")
    first = start(cluster, PROMPTS[:5])
    wait_until("the first wave to stream", lambda: all(s.result.chunks > 0 for s in first))
    kill(cluster, "prefill-0")
    second = start(cluster, PROMPTS[5:])  # sent to the dead node until the router notices
    check(first + second, offline)
    wait_until("prefill-0 to be restarted", lambda: registrations(cluster, "prefill-0") > before)


def test_store_killed_under_load_costs_one_timeout_then_is_skipped(cluster, offline) -> None:
    store = detach(cluster, "store")  # stays dead: the breaker must carry the load
    before = node_stats(cluster.url, "connector_store_timeouts")  # a slow answer on this busy box may count too
    streams = start(cluster, PROMPTS)
    wait_until("the requests to stream", lambda: sum(s.result.chunks > 0 for s in streams) >= 3)
    store.kill()
    check(streams, offline)
    wait_until("every node to find the store unreachable", lambda: health(cluster)["store"]["state"] == "unreachable")
    timeouts = node_stats(cluster.url, "connector_store_timeouts")
    skipped = node_stats(cluster.url, "connector_store_skipped_calls")
    paid = {node: t - before.get(node, 0.0) for node, t in timeouts.items()}
    # One call per node waited out its timeout, give or take the few already in flight on other threads.
    assert set(paid) == {"prefill-0", "decode-0", "decode-1"} and all(1 <= t <= 4 for t in paid.values()), paid
    check(start(cluster, PROMPTS[:6]), offline)
    wait_until(
        "the nodes to report the calls skipped since",
        lambda: all(v > skipped[n] for n, v in node_stats(cluster.url, "connector_store_skipped_calls").items()),
    )
    assert node_stats(cluster.url, "connector_store_timeouts") == timeouts, "a request paid a store timeout again"


def test_store_restarted_on_the_same_disk_serves_its_blocks_again(cluster, offline) -> None:
    cluster.start_store()  # same address, same LMDB folder
    wait_until("the breakers to close on a probe", lambda: health(cluster)["store"]["state"] == "reachable", 60)
    store_hits = metric(cluster.url, "ucm_prefix_cache_hit_tokens_total", role="prefill", source="store")
    # prefill-0 was restarted after LONG was saved: its device cache is empty, the store is the only source.
    check(start(cluster, [LONG]), offline)
    gained = metric(cluster.url, "ucm_prefix_cache_hit_tokens_total", role="prefill", source="store") - store_hits
    assert gained >= 4 * BLOCK, gained


def test_flipped_bytes_on_disk_are_detected_never_served(cluster, offline, token_blocks) -> None:
    store = detach(cluster, "store")
    store.stop()  # SIGTERM: the write-behind queue is flushed, LMDB closed
    blocks = [tuple(b) for b in token_blocks(LONG_FLIPPED)]
    # The prompt repeats a sentence: take blocks whose token ids occur once, so each names one stored record.
    chosen = [b for b in (blocks[1], blocks[3], blocks[2], blocks[4]) if blocks.count(b) == 1][:2]
    flipped = flip_blocks(cluster.spec.disk_path, chosen)
    assert len(chosen) == len(flipped) == 2
    load_failed = sum(node_stats(cluster.url, "connector_blocks_load_failed").values())
    cluster.start_store()
    wait_until("the breakers to close", lambda: health(cluster)["store"]["state"] == "reachable", 60)
    check(start(cluster, [LONG_FLIPPED]), offline)
    # The restarted daemon counts from 0: at least the two flipped blocks (two layers of one block may both
    # catch it before it is dropped), reported by the nodes' store pollers.
    wait_until(
        "the store to count both flipped blocks as corrupt",
        lambda: max(node_stats(cluster.url, "store_corrupt_dropped").values(), default=0.0) >= 2,
    )
    assert sum(node_stats(cluster.url, "connector_blocks_load_failed").values()) > load_failed
    assert cluster.children["store"].alive
    check(start(cluster, [LONG_FLIPPED, PROMPTS[0]]), offline)  # the daemon keeps serving
