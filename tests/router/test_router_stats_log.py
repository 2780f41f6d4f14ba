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
    metrics.vllm.record_prompt(P.CacheInfo(prompt_tokens=100, cached_tokens=64, store_hit_tokens=16))
    later = dataclasses.replace(stats.snapshot(), at=first.at + 10.0)
    line = stats.line(first, later)
    assert line is not None
    assert line.startswith("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 2.0 tokens/s, ")
    assert "Running: 0 reqs, Waiting: 0 reqs" in line and "Prefix cache hit rate: 64.0%" in line
    assert line.endswith("Store hit rate: dram -, disk -"), line
