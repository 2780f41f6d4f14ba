"""Issue 51 on real processes: three prefill nodes and a decode node publishing KV events, the router pairing by
cost on its index of them. A shared-prefix follow-up goes to the node holding the prefix; after `POST
/reset_prefix_cache` on the holder (AllBlocksCleared) the index forgets its blocks and no prefill is routed on them;
once that node is killed and dropped, the next follow-up goes to a live node (the index forgot the dead one at once),
and is served. The store daemon `Cluster` starts publishes its tiers' events too, and the router indexes them
(`ucm_kv_index_blocks`)."""

from __future__ import annotations

import httpx
import pytest

from common.kv_events.config import KVEventsConfig
from launch.cluster import Cluster, ClusterSpec
from tests.cluster_helpers import health_nodes, metric, wait_until

pytestmark = pytest.mark.slow

PREFILL = ("prefill-0", "prefill-1", "prefill-2")
PREFIX = [1000 + i for i in range(160)]  # 10 full blocks of 16


def _started(cluster: Cluster) -> dict[str, float]:
    return {n: metric(cluster.url, "ucm_node_jobs_prefill_started_total", node=n) for n in PREFILL}


def _ask(cluster: Cluster, prompt: list[int], live: tuple[str, ...] = PREFILL) -> str:
    """Complete `prompt`; the prefill node that took it (its heartbeat's job counter moved)."""
    before = _started(cluster)
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": cluster.spec.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    moved: list[str] = []

    def one_moved() -> bool:
        now = _started(cluster)
        moved[:] = [n for n in live if now[n] > before[n]]
        return bool(moved)

    wait_until("the prefill node's counter", one_moved, 60)
    assert len(moved) == 1, f"one prompt, prefilled on {moved}"
    return moved[0]


def test_follow_ups_go_where_the_kv_is_and_never_to_a_dropped_holder(tmp_path) -> None:
    spec = ClusterSpec(
        prefill=3,
        decode=1,
        dtype="float32",
        kv_cache_memory="64MiB",
        node_args=("--threads", "1"),
        heartbeat_interval_s=0.2,
        supervise=False,  # the killed holder stays dead
        router_args=("--pairing", "cost"),
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/replay"
        ),
    )
    cluster = Cluster(spec, log=lambda s: None)
    try:
        cluster.start(timeout=900)  # four engines warming up on a shared 2-core host
        holder = _ask(cluster, PREFIX)
        assert cluster.store_events_addr is not None, "the store publishes when the nodes do"
        # The prefill node saved the prompt's 10 full blocks; the store's DRAM tier (medium CPU) announced them.
        stored = lambda: metric(cluster.url, "ucm_kv_index_blocks", source="<store>", medium="CPU")  # noqa: E731
        wait_until("the store's DRAM blocks in the router's index", lambda: stored() >= len(PREFIX) // 16, 60)
        for turn in range(2):  # each follow-up shares the prefix: the holder computes only its new blocks
            assert _ask(cluster, PREFIX + [2000 + 16 * turn + i for i in range(16)]) == holder
        # AllBlocksCleared: the holder drops its device prefix cache (vLLM's route), publishes it, the index forgets
        # its blocks; the next follow-up goes wherever loading from the store is cheapest, and no prefill is sent
        # anywhere for device blocks the node no longer holds (the router checks each against the node's report).
        device = lambda: metric(cluster.url, "ucm_kv_index_blocks", source=holder, medium="GPU")  # noqa: E731
        assert device() >= len(PREFIX) // 16
        r = httpx.post(cluster.url + "/reset_prefix_cache", params={"node": holder}, timeout=30)
        assert r.status_code == 200 and r.json() == {"nodes": [holder]}, r.text
        wait_until(f"{holder}'s AllBlocksCleared indexed", lambda: device() == 0, 60)
        _ask(cluster, PREFIX + [2500 + i for i in range(16)])
        assert metric(cluster.url, "ucm_prefill_stale_routes_total") == 0
        assert httpx.post(cluster.url + "/reset_prefix_cache", params={"node": "nope"}).status_code == 404
        cluster.children[holder].kill()
        wait_until(f"{holder} dropped", lambda: holder not in health_nodes(cluster.url), 60)
        others = tuple(n for n in PREFILL if n != holder)
        assert _ask(cluster, PREFIX + [3000 + i for i in range(16)], live=others) in others
    finally:
        cluster.stop()
