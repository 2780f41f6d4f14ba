"""`up`'s one colocated node saves to the store only what its device cache evicts (KVSavePolicy.REUSED), on a real
cluster (store daemon, router, the node; HTTP): a prompt it still caches costs the store nothing; once other
prompts evict it, the store holds it and the prompt comes back from the store with the same completion."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.prom_text import node_stats
from launch.cluster import Cluster, ClusterSpec
from tests.cluster_helpers import metric, wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
BLOCK = 16
NODE = "colocated-0"


def prompt(topic: str) -> str:
    return (
        f"A keeper's almanac of {topic}: prune in late winter, graft in spring, thin in June, pick the early ones "
        "in August and store the late ones in a cool dry cellar until the new year. "
    ) * 3


@pytest.fixture(scope="module")
def cluster():
    # fp32 SmolLM2 takes ~46 KB a token: 12 MiB is 17 blocks, so each new ~130-token prompt evicts older ones.
    spec = ClusterSpec(prefill=0, decode=0, colocated=1, dtype="float32", kv_cache_memory="12MiB")
    lines: list[str] = []
    with Cluster(spec, log=lines.append) as c:
        c.log_lines = lines  # type: ignore[attr-defined]
        yield c


def complete(cluster: Cluster, text: str) -> dict:
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def stat(cluster: Cluster, name: str) -> float:
    """The node's connector counter as of its last heartbeat."""
    return node_stats(cluster.url, f"connector_{name}").get(NODE, -1.0)


def test_only_evicted_blocks_reach_the_store_and_come_back(cluster) -> None:
    # `reused` by default: within its warm-up it saves every evicted block, as `evicted` does
    assert any("--kv-save-policy reused" in line for line in cluster.log_lines)
    first = complete(cluster, prompt("apples"))
    assert first["usage"]["prompt_tokens"] > 6 * BLOCK
    # A heartbeat after the request: its lookup in the store is counted, and no save.
    wait_until("the node to report the first request's lookup", lambda: stat(cluster, "lookups") >= 1)
    assert stat(cluster, "blocks_saved") == 0, "a block the device cache still holds was saved"
    for topic in ("pears", "plums", "quinces"):
        complete(cluster, prompt(topic))
    wait_until("the evicted blocks to reach the store", lambda: stat(cluster, "blocks_saved") >= 6)
    loaded = metric(cluster.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    again = complete(cluster, prompt("apples"))
    from_store = metric(cluster.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - loaded
    assert from_store >= 6 * BLOCK, f"the evicted prompt was recomputed ({from_store} tokens from the store)"
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
