"""The periodic stats line, like vLLM's `Avg prompt throughput: …` line: every `interval_s` while there was
activity (tokens served, or requests running or waiting), on the `router.stats` logger:

    Avg prompt throughput: 61.2 tokens/s, Avg generation throughput: 12.4 tokens/s, Running: 2 reqs, Waiting: 0
    reqs, KV cache usage: 3.1%, Prefix cache hit rate: 48.0%, Store hit rate: dram 30.0%, disk 5.0%, Store
    evictions: dram 120, disk 0

Running is the sequences admitted to the nodes, Waiting those queued in the router plus those the nodes hold back;
KV cache usage is the mean over nodes; the hit rates are over the interval (prefix: prompt tokens not computed;
store tiers: the share of the prefilled prompt tokens loaded from each tier, the numbers behind
`ucm_prompt_tokens_by_tier_total` and `vllm:prefix_cache_queries_total`); store evictions: blocks each tier
evicted to make room in the interval, from the store's own counters the nodes report (`ucm_store_tier`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from router.admission import AdmissionQueue
from router.metrics import RouterMetrics
from router.registry import Registry
from router.vllm_metrics import ROUTER_ENGINE, StoreTier

log = logging.getLogger("router.stats")

_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:prefix_cache_queries_total",
)


@dataclass(frozen=True)
class Snapshot:
    at: float
    counters: tuple[float, ...]  # _COUNTERS, in order
    tiers: dict[StoreTier, float]  # tier -> prompt tokens loaded from it
    evictions: dict[StoreTier, float]  # tier -> blocks the store evicted from it so far


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _since(before: float, now: float) -> float:
    """A counter's growth; one that went down belongs to a restarted store, which counted from zero."""
    return now - before if now >= before else now


class StatsLogger:
    def __init__(self, metrics: RouterMetrics, registry: Registry, admission: AdmissionQueue, interval_s: float):
        assert interval_s > 0, "the stats interval must be positive"
        self._metrics = metrics
        self._nodes = registry
        self._admission = admission
        self.interval_s = interval_s
        self._labels = {"model_name": registry.model_name, "engine": ROUTER_ENGINE}

    def snapshot(self) -> Snapshot:
        r = self._metrics.registry
        counters = tuple(r.get_sample_value(name, self._labels) or 0.0 for name in _COUNTERS)
        tiers = {
            t: r.get_sample_value("ucm_prompt_tokens_by_tier_total", {**self._labels, "tier": t.value}) or 0.0
            for t in StoreTier
        }
        evictions = {
            t: r.get_sample_value("ucm_store_tier", {"tier": t.value, "name": "evictions"}) or 0.0 for t in StoreTier
        }
        return Snapshot(time.monotonic(), counters, tiers, evictions)

    def line(self, before: Snapshot, now: Snapshot) -> str | None:
        """The line for the interval between two snapshots; None when nothing happened."""
        prompt, generated, cached, queried = (b - a for a, b in zip(before.counters, now.counters, strict=True))
        nodes = list(self._nodes.nodes.values())
        running = self._admission.running
        waiting = self._admission.depth + sum(n.waiting for n in nodes)
        if not (prompt or generated or running or waiting):
            return None
        seconds = max(now.at - before.at, 1e-9)
        usage = [1.0 - n.free_blocks / n.info.num_blocks for n in nodes if n.info.num_blocks > 0]
        tiers = [f"{t.value} {_percent(now.tiers[t] - before.tiers[t], queried)}" for t in StoreTier]
        evicted = [f"{t.value} {_since(before.evictions[t], now.evictions[t]):.0f}" for t in StoreTier]
        return (
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {_percent(sum(usage), len(usage))}, "
            f"Prefix cache hit rate: {_percent(cached, prompt)}, "
            f"Store hit rate: {', '.join(tiers)}, "
            f"Store evictions: {', '.join(evicted)}"
        )

    async def run(self) -> None:
        """Log every interval until cancelled."""
        before = self.snapshot()
        while True:
            await asyncio.sleep(self.interval_s)
            now = self.snapshot()
            text = self.line(before, now)
            if text is not None:
                log.info("%s", text)
            before = now
