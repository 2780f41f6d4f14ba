"""benchmarks/cluster_sim.py on a slice of the public trace: the router's pairing over simulated nodes' block pools,
the store's policy and the KV index, prefill and decode nodes; what it reports holds together, and routing by cost
finds the KV."""

from __future__ import annotations

import pytest

from benchmarks import cluster_sim
from benchmarks.traces import default_trace_path
from router.pairing_policy import PairingPolicy

MODEL = cluster_sim.StepModel(token_s=0.002, step_s=0.1, block_load_s=0.005, block_net_s=0.006)


@pytest.fixture(scope="module")
def rows():
    if not default_trace_path().is_file():
        pytest.skip("the public trace is not beside the checkout")
    return cluster_sim.load_trace(default_trace_path(), sample=1, max_requests=1500)


def _run(rows, policy: PairingPolicy, nodes: int = 16) -> cluster_sim.Result:
    return cluster_sim.simulate(rows, policy, nodes, MODEL, load=1.0, nodes_per_host=4, device_blocks=512,
                                store_blocks=2048, decode_per_host=1)  # fmt: skip


def test_cost_routing_finds_what_the_cluster_holds(rows) -> None:
    ours = _run(rows, PairingPolicy.COST)
    blind = _run(rows, PairingPolicy.ROUND_ROBIN)
    for r in (ours, blind):
        assert r.requests == len(rows)
        assert 0 < r.hit_ratio <= 1 and r.device_hit_ratio <= r.hit_ratio
        assert r.ttft_p50 <= r.ttft_p90 <= r.ttft_p99
        assert r.max_mean_load >= 1.0 and r.decode_max_mean_load >= 1.0
        assert r.wait_p90 >= 0 and r.tpot_p90 >= MODEL.step_s  # a decode step each token, at least
    # Decode by cost: the conversation's earlier prompt on device counts (more found there than round-robin finds),
    # but a batch's extra sequence costs more than bringing the KV from the store, so the load stays even.
    assert ours.decode_device_ratio > blind.decode_device_ratio and ours.decode_max_mean_load < 1.1
    # Four hosts' stores and sixteen device caches: blind routing misses most of what is held elsewhere.
    assert ours.hit_vs_oracle > 0.8 and blind.hit_vs_oracle < 0.5
    assert ours.ttft_p90 < blind.ttft_p90


def test_every_policy_runs_and_the_verdict_names_the_targets(rows) -> None:
    results = [_run(rows, p, nodes=8) for p in cluster_sim.POLICIES]
    assert [r.policy for r in results] == [cluster_sim.LABELS[p] for p in cluster_sim.POLICIES]
    (line,) = cluster_sim.verdict(results)
    assert line.startswith("8 nodes: hit/oracle") and ("met" in line)
