"""Issue 15, prompt tokens by store tier, on a real cluster (store daemon with a disk tier, one prefill and one
decode node, the router): a long prompt repeated on a prefill node whose device cache lost it is loaded from
the store's DRAM tier; after the daemon restarts on the same LMDB (its blocks only on disk) it is loaded off
disk. `ucm_prompt_tokens_by_tier_total{tier}` says which, sums to vLLM's `external_kv_transfer` source, and
vLLM's three sources sum to the prompt tokens."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from launch.cluster import Cluster, ClusterSpec
from tests.cluster_helpers import metric, wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
BLOCK = 16
LONG = (
    "An orchard keeper's almanac: prune the apple trees in late winter, graft in spring, thin the fruit in June, "
    "pick the early varieties in August and store the late ones in a cool dry cellar until the new year. "
) * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(
        prefill=1,
        decode=1,
        dtype="float32",
        kv_cache_memory="64MiB",
        node_args=("--threads", "1"),
        disk_path=str(tmp_path_factory.mktemp("store")),
    )
    with Cluster(spec, log=lambda s: None) as c:
        yield c


def tier(cluster: Cluster, name: str) -> float:
    return metric(cluster.url, "ucm_prompt_tokens_by_tier_total", tier=name)


def source(cluster: Cluster, name: str) -> float:
    return metric(cluster.url, "vllm:prompt_tokens_by_source_total", source=name)


def complete(cluster: Cluster) -> int:
    """One request for LONG; its prompt tokens."""
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": MODEL, "prompt": LONG, "max_tokens": 2, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def registrations(cluster: Cluster) -> float:
    return metric(cluster.url, "ucm_node_events_total", node="prefill-0", event="registered")


def restart_prefill(cluster: Cluster) -> None:
    """kill -9 the prefill node (the supervisor restarts it): its device prefix cache is empty again."""
    before = registrations(cluster)
    cluster.children["prefill-0"].kill()
    wait_until("prefill-0 to register again", lambda: registrations(cluster) > before, 300)
    wait_until("prefill-0 to be up", lambda: metric(cluster.url, "ucm_node_up", node="prefill-0") == 1, 60)


def restart_store(cluster: Cluster) -> None:
    """Stop the daemon (SIGTERM: the write-behind queue reaches LMDB) and start it on the same folder: its blocks
    are then only on disk."""
    with getattr(cluster, "_lock", contextlib.nullcontext()):
        store = cluster.children.pop("store")  # not restarted by the supervisor meanwhile
    store.stop()
    cluster.start_store()


def loaded_by_tier(cluster: Cluster) -> dict[str, float]:
    """Prompt tokens each tier served for one request for LONG."""
    before = {t: tier(cluster, t) for t in ("dram", "disk")}
    complete(cluster)
    return {t: tier(cluster, t) - v for t, v in before.items()}


def test_store_hits_by_tier_dram_then_disk(cluster) -> None:
    prompt = complete(cluster)  # computed, saved to the store
    assert prompt > 5 * BLOCK
    wait_until(
        "the saved blocks to reach the disk tier",
        lambda: metric(cluster.url, "ucm_store_tier", tier="disk", name="blocks") >= prompt // BLOCK,
    )
    restart_prefill(cluster)
    from_dram = loaded_by_tier(cluster)  # the daemon still holds the blocks in DRAM
    assert from_dram["dram"] >= 4 * BLOCK and from_dram["disk"] == 0, from_dram

    restart_store(cluster)
    restart_prefill(cluster)  # its device cache holds the prompt again since the request above
    from_disk = loaded_by_tier(cluster)
    assert from_disk["disk"] >= 4 * BLOCK and from_disk["dram"] == 0, from_disk

    # Every prompt counted once by source; the store's share split by tier, nothing more, nothing less.
    total = sum(source(cluster, s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))
    assert total == metric(cluster.url, "vllm:prompt_tokens_total") == 3 * prompt
    stored = from_dram["dram"] + from_disk["disk"]
    assert tier(cluster, "dram") + tier(cluster, "disk") == source(cluster, "external_kv_transfer") == stored
