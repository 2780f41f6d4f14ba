"""The periodic stats line: nothing while idle, vLLM's wording with the interval's numbers after activity."""

from __future__ import annotations

import dataclasses

from protocol import messages as P
from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.registry import Registry
from router.stats_log import StatsLogger


def test_silent_when_idle_then_reports_the_interval() -> None:
    registry = Registry("m")
    admission = AdmissionQueue(registry.capacity, 4, 60.0)
    metrics = RouterMetrics(registry, admission)
    stats = StatsLogger(metrics, registry, admission, RouterConfig.stats_interval_s)
    first = stats.snapshot()
    assert stats.line(first, stats.snapshot()) is None, "an idle interval must not log"

    metrics.prompt_tokens.inc(100)
    metrics.generation_tokens.inc(20)
    metrics.vllm.record_prompt(
        P.CacheInfo(prompt_tokens=100, cached_tokens=64, store_hit_tokens=16, store_dram_tokens=12, store_disk_tokens=4)
    )
    metrics.store_tier.labels("dram", "evictions").set(120)  # what the nodes' heartbeats report of the store
    later = dataclasses.replace(stats.snapshot(), at=first.at + 10.0)
    line = stats.line(first, later)
    assert line is not None
    assert line.startswith("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 2.0 tokens/s, ")
    assert "Running: 0 reqs, Waiting: 0 reqs" in line and "Prefix cache hit rate: 64.0%" in line
    assert line.endswith("Store hit rate: dram 12.0%, disk 4.0%, Store evictions: dram 120, disk 0"), line
    metrics.prompt_tokens.inc(1)
    metrics.store_tier.labels("dram", "evictions").set(7)  # the store restarted and has evicted 7 since
    again = stats.line(later, dataclasses.replace(stats.snapshot(), at=later.at + 10.0))
    assert again is not None and again.endswith("Store evictions: dram 7, disk 0"), again


def test_store_tiers_are_split_out_and_clamped_to_the_store_hits() -> None:
    registry = Registry("m")
    metrics = RouterMetrics(registry, AdmissionQueue(registry.capacity, 4, 60.0))
    v = metrics.vllm
    v.record_prompt(P.CacheInfo(100, 80, 48, store_dram_tokens=32, store_disk_tokens=16))
    v.record_prompt(P.CacheInfo(10, 10, 4, store_dram_tokens=9, store_disk_tokens=9))  # a node over-reporting
    v.record_prompt(P.CacheInfo(10, 0, 0))
    by_tier = {t.value: c._value.get() for t, c in v.by_tier.items()}
    by_source = {s.value: c._value.get() for s, c in v.by_source.items()}
    assert by_tier == {"dram": 36, "disk": 16}
    assert by_source == {"local_compute": 30, "local_cache_hit": 38, "external_kv_transfer": 52}
    assert sum(by_tier.values()) == by_source["external_kv_transfer"]
    text = metrics.render().decode()
    assert 'ucm_prompt_tokens_by_tier_total{engine="router",model_name="m",tier="disk"} 16.0' in text
    assert "ucm_node_stat" not in text
