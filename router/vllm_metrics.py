"""vLLM's metric names (v0.32, vllm/v1/metrics/loggers.py), beside the router's `ucm_*` ones, so a vLLM Grafana
dashboard works unchanged: same names, types, label names (`model_name`, `engine`) and histogram buckets
(vllm/v1/metrics/buckets.py).

The router measures requests, so its series carry `engine="router"`; the per-node scheduler gauges
(router/node_metrics.py) carry each node's id. A sequence's prompt is counted where it was prefilled (the prefill
node's cache report, or the decode node's when it prefilled locally): vLLM's `local_cache_hit` is our device
prefix cache and `external_kv_transfer` the KV store. The store's own tiers are split out in a separate family,
`ucm_prompt_tokens_by_tier_total{tier="dram"|"disk"}`, not as extra `source` values: vLLM documents its three
sources as adding up to the prompt tokens, and a panel summing every source would count store hits twice.
"""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Histogram

from protocol import messages as P

ROUTER_ENGINE = "router"  # the `engine` label of the series the router measures itself

# vLLM's defaults (vllm/v1/metrics/buckets.py), copied: the dashboards' quantiles assume them.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip


class PromptSource(enum.StrEnum):
    """vLLM's PromptTokenStats.ALL_SOURCES."""

    LOCAL_COMPUTE = "local_compute"
    LOCAL_CACHE_HIT = "local_cache_hit"  # our device prefix cache
    EXTERNAL_KV_TRANSFER = "external_kv_transfer"  # our KV store (any tier)


class StoreTier(enum.StrEnum):
    """The `tier` label of ucm_prompt_tokens_by_tier: ucm.api.Tier's values (the router does not import ucm)."""

    DRAM = "dram"
    DISK = "disk"


class FinishedReason(enum.StrEnum):
    """vLLM's FinishReason as its `finished_reason` label spells it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class VllmMetrics:
    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "engine"]
        values = (model_name, ROUTER_ENGINE)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*values)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(
            *values
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(*values)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*values)
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.",
        ).labels(*values)
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.",
        ).labels(*values)
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(*values)
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*labels, "source"], registry=r
        )
        self.by_source = {s: by_source.labels(*values, s.value) for s in PromptSource}
        by_tier = Counter(
            "ucm_prompt_tokens_by_tier",
            "Prompt tokens loaded from the KV store, by the store tier they were read from (sums to "
            'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} when the nodes report tiers).',
            [*labels, "tier"],
            registry=r,
        )
        self.by_tier = {t: by_tier.labels(*values, t.value) for t in StoreTier}
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.success = {f: success.labels(*values, f.value) for f in FinishedReason}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        ).labels(*values)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        ).labels(*values)
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        ).labels(*values)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)

    def record_prompt(self, cache: P.CacheInfo) -> None:
        """One sequence's prompt, as the node that prefilled it reported it."""
        cached = min(cache.cached_tokens, cache.prompt_tokens)
        store = min(cache.store_hit_tokens or 0, cached)
        device = cached - store
        self.prefix_cache_queries.inc(cache.prompt_tokens)
        self.prefix_cache_hits.inc(device)
        self.external_queries.inc(cache.prompt_tokens - device)
        self.external_hits.inc(store)
        self.prompt_tokens_cached.inc(cached)
        self.by_source[PromptSource.LOCAL_COMPUTE].inc(cache.prompt_tokens - cached)
        self.by_source[PromptSource.LOCAL_CACHE_HIT].inc(device)
        self.by_source[PromptSource.EXTERNAL_KV_TRANSFER].inc(store)
        # Node-reported and so clamped: the tiers never add up to more than the store hits.
        dram = min(max(cache.store_dram_tokens, 0), store)
        disk = min(max(cache.store_disk_tokens, 0), store - dram)
        self.by_tier[StoreTier.DRAM].inc(dram)
        self.by_tier[StoreTier.DISK].inc(disk)

    def record_finish(self, reason: str | None) -> None:
        """A choice's end: OpenAI's finish_reason (None: it failed or was aborted)."""
        if reason is None:
            self.success[FinishedReason.ABORT].inc()
        elif reason == "length":
            self.success[FinishedReason.LENGTH].inc()
        else:
            self.success[FinishedReason.STOP].inc()
