"""What a vLLM user's tools read, on a real cluster (store daemon, one prefill and one decode node, the router):
vLLM's endpoints (/tokenize, /detokenize, /version, /v1/models/{id}, `root` and `max_model_len`),
`usage.prompt_tokens_details.cached_tokens` equal to the cache counters, vLLM's metric names, types and
labels as vLLM 0.32 declares them (vllm/v1/metrics/loggers.py) with values consistent with the requests sent,
and the operator's log lines (one access line per request, the periodic stats line)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.cluster import Cluster, ClusterSpec

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
LONG = (
    "You are a meticulous assistant for a library. The catalogue lists books by author, title, year and shelf. "
    "Patrons ask about opening hours, late fees, interlibrary loans and the reading room rules. "
) * 3

# Read from vLLM 0.32's vllm/v1/metrics/loggers.py (PrometheusStatLogger): name -> (type, label names).
# Counter names are declared without `_total`; prometheus_client's parser reports the family the same way.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "vllm:external_prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:external_prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "vllm:prompt_tokens": ("counter", {"model_name", "engine"}),
    "vllm:prompt_tokens_cached": ("counter", {"model_name", "engine"}),
    "vllm:prompt_tokens_by_source": ("counter", {"model_name", "engine", "source"}),
    "vllm:generation_tokens": ("counter", {"model_name", "engine"}),
    "vllm:request_success": ("counter", {"model_name", "engine", "finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:request_time_per_output_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name", "engine"}),
}
# vllm/v1/metrics/buckets.py
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
TTFT_BUCKETS += [40.0, 80.0, 160.0, 640.0, 2560.0]
# vLLM's PromptTokenStats.ALL_SOURCES
SOURCES = {"local_compute", "local_cache_hit", "external_kv_transfer"}


@dataclass
class Sent:
    """The usage the router reported for every generation request of this module (the metrics must add up)."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    choices: int = 0
    ids: list[str] = field(default_factory=list)

    def add(self, usage: object, choices: int, rid: str) -> None:
        self.prompt += usage.prompt_tokens
        self.completion += usage.completion_tokens
        self.cached += usage.prompt_tokens_details.cached_tokens
        self.choices += choices
        self.ids.append(rid)


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(
        kv_cache_memory="64MiB",
        dtype="float32",
        node_args=("--threads", "1"),
        router_args=("--stats-interval", "0.5"),
    )
    with Cluster(spec, log=lambda s: None) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def sent() -> Sent:
    return Sent()


def families(cluster: Cluster) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(cluster.url + "/metrics").text)}


def value(fams: dict, name: str, suffix: str = "", **labels: str) -> float:
    return sum(
        s.value
        for s in fams[name].samples
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_endpoints(cluster) -> None:
    c = httpx.Client(base_url=cluster.url, timeout=60)
    assert c.get("/version").json()["version"]
    card = c.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] > 0
    assert (Path(card["root"]) / "tokenizer.json").is_file()
    assert c.get(f"/v1/models/{MODEL}").json() == card
    missing = c.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    from engine.tokenizer import Tokenizer

    tok = Tokenizer(card["root"])
    r = c.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "add_special_tokens": False}).json()
    assert r == {
        "count": len(r["tokens"]),
        "max_model_len": card["max_model_len"],
        "tokens": tok.encode("Hello world", False),
    }
    messages = [{"role": "user", "content": "Hi there"}]
    r = c.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert r["tokens"] == tok.apply_chat_template(messages) and r["count"] == len(r["tokens"])
    r = c.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True}).json()
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert c.post("/detokenize", json={"model": MODEL, "tokens": tok.encode("Hello world", False)}).json() == {
        "prompt": "Hello world"
    }
    bad = c.post("/detokenize", json={"tokens": [tok.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert c.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert c.post("/tokenize", json={"prompt": 3}).status_code == 400


def test_cached_tokens_equal_the_hit_counters(cluster, client, sent) -> None:
    def hits() -> float:
        fams = families(cluster)
        return value(fams, "ucm_prefix_cache_hit_tokens", "_total", role="prefill")

    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, temperature=0)
    sent.add(r.usage, 1, r.id)
    before = hits()
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, temperature=0)
    sent.add(r.usage, 1, r.id)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r.usage.prompt_tokens, "the repeated prompt must hit the prefill node's cache"
    assert hits() - before == cached
    # streaming, chat: the final usage chunk carries it too
    before = hits()
    messages = [{"role": "user", "content": LONG}]
    streamed = []
    for _ in range(2):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        sent.add(usage, 1, chunks[0].id)
        streamed.append(usage.prompt_tokens_details.cached_tokens)
    assert streamed[1] > 0
    assert hits() - before == sum(streamed)


def test_vllm_metric_names_types_and_values(cluster, client, sent) -> None:
    r = client.completions.create(model=MODEL, prompt=["One two", "Three four five"], max_tokens=5, temperature=0, n=2)
    sent.add(r.usage, 4, r.id)
    fams = families(cluster)
    for name, (kind, labels) in VLLM_METRICS.items():
        assert name in fams, f"{name} is missing"
        assert fams[name].type == kind, f"{name} is a {fams[name].type}, vLLM's is a {kind}"
        for s in fams[name].samples:
            assert set(s.labels) - {"le"} == labels, f"{name} has labels {set(s.labels)}, vLLM's {labels}"
            assert s.labels["model_name"] == MODEL
    running = [s.labels["engine"] for s in fams["vllm:num_requests_running"].samples]
    assert sorted(running) == ["decode-0", "prefill-0"]
    assert all(0 <= s.value <= 1 for s in fams["vllm:kv_cache_usage_perc"].samples)
    ttft_le = [float(s.labels["le"]) for s in fams["vllm:time_to_first_token_seconds"].samples if "le" in s.labels]
    assert ttft_le[:-1] == TTFT_BUCKETS

    assert value(fams, "vllm:prompt_tokens", "_total") == sent.prompt
    assert value(fams, "vllm:generation_tokens", "_total") == sent.completion
    by_source = {s.labels["source"]: s.value for s in fams["vllm:prompt_tokens_by_source"].samples}
    assert set(by_source) == SOURCES and sum(by_source.values()) == sent.prompt
    cached = value(fams, "vllm:prompt_tokens_cached", "_total")
    assert cached == sent.cached == by_source["local_cache_hit"] + by_source["external_kv_transfer"]
    assert value(fams, "vllm:prefix_cache_hits", "_total") == by_source["local_cache_hit"]
    assert value(fams, "vllm:prefix_cache_queries", "_total") == sent.prompt
    assert value(fams, "vllm:time_to_first_token_seconds", "_count") == sent.choices
    assert value(fams, "vllm:e2e_request_latency_seconds", "_count") == sent.choices
    assert value(fams, "vllm:request_success", "_total") == sent.choices
    assert 0 < value(fams, "vllm:inter_token_latency_seconds", "_count") <= sent.completion - sent.choices

    # node heartbeat stats: named counters, levels as gauges
    assert fams["ucm_node_num_requests"].type == "counter"
    assert value(fams, "ucm_node_num_requests", "_total", node="prefill-0") >= 1
    assert fams["ucm_node_connector_store_reachable"].type == "gauge"


def test_access_log_and_stats_line(cluster, client, sent) -> None:
    router = cluster.children["router"]
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=3, temperature=0)
    sent.add(r.usage, 1, r.id)
    u = r.usage
    line = router.wait_for(re.escape(r.id) + r" POST /v1/completions 200 .*", 60).group(0)
    assert (
        f"prompt={u.prompt_tokens} cached={u.prompt_tokens_details.cached_tokens} output={u.completion_tokens}" in line
    )
    assert re.search(r"ttft=\d+\.\d+s e2e=\d+\.\d+s$", line), line
    # refused: logged with its status
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    router.wait_for(r"- POST /v1/completions 404 prompt=0 cached=0 output=0 ttft=- e2e=\S+ error=", 60)
    # a stream its client leaves: the line still comes, as 499
    with httpx.stream(
        "POST",
        cluster.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Count: one two", "max_tokens": 200, "stream": True, "ignore_eos": True},
        timeout=120,
    ) as resp:
        first = next(line for line in resp.iter_lines() if line.startswith("data: "))
    rid = json.loads(first[len("data: ") :])["id"]
    router.wait_for(re.escape(rid) + r" POST /v1/completions 499 .*error='client disconnected'", 60)
    # the periodic line, vLLM's wording, with the interval's throughput
    router.wait_for(
        r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [1-9][\d.]* tokens/s, "
        r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \S+, Prefix cache hit rate: \S+, "
        r"Store hit rate: dram \S+, disk \S+, Store evictions: dram \d+, disk \d+",
        60,
    )
