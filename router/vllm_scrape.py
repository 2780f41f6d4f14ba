"""`VllmLoad`: what one `vllm serve` instance's Prometheus `/metrics` says about its load and its speed (v0.32's
names, vllm/v1/metrics/loggers.py), read on the router's probe loop (router/vllm_pool.py).

    vllm:num_requests_running, vllm:num_requests_waiting    its scheduler's queue (what it runs, what waits)
    vllm:kv_cache_usage_perc                                 the fraction of its KV blocks in use
    vllm:cache_config_info{block_size, num_gpu_blocks}       its KV cache's size (an info gauge: labels, value 1)
    vllm:iteration_tokens_total (histogram)                  _count: engine steps; _sum: tokens they computed
                                                             (prompt tokens not cached + generated tokens)
    vllm:request_prefill_kv_computed_tokens (histogram)      prompt tokens each request computed: the mean
                                                             prices the requests queued there that the router
                                                             did not send (another client's)

The last two counters are what router/step_cost.py fits a node's step costs from (`steps`, `computed_tokens`), so
a vLLM instance's seconds per prompt token and per step are measured the way our nodes' are. vLLM exports no busy
time: an interval in which its step counter moved counts as busy whole (StepCost's rule for such a node). Series of
several engines (data parallel) are summed (the KV usage averaged).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
PREFILL_COMPUTED = "vllm:request_prefill_kv_computed_tokens"
_SUMMED = (
    RUNNING,
    WAITING,
    KV_USAGE,
    f"{ITERATION_TOKENS}_count",
    f"{ITERATION_TOKENS}_sum",
    f"{PREFILL_COMPUTED}_count",
    f"{PREFILL_COMPUTED}_sum",
)


class BadMetrics(ValueError):
    pass


@dataclass(frozen=True)
class VllmLoad:
    running: int
    waiting: int
    kv_usage: float  # 0..1
    block_size: int | None  # None: not announced (cache_config_info missing)
    num_blocks: int | None
    steps: float
    computed_tokens: float
    prefills: float = 0.0  # requests whose prefill finished
    prefill_tokens: float = 0.0  # the prompt tokens they computed (not cached, not loaded)

    @property
    def tokens_per_prefill(self) -> float:
        """Mean prompt tokens a request computed there (0: none finished yet)."""
        return self.prefill_tokens / self.prefills if self.prefills > 0 else 0.0

    def step_stats(self) -> dict[str, float]:
        """The counters router/step_cost.py's `StepCost.observe` reads."""
        return {"steps": self.steps, "computed_tokens": self.computed_tokens}


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        value = int(labels[name])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


def parse_vllm_metrics(text: str) -> VllmLoad:
    """A vLLM `/metrics` body -> VllmLoad; BadMetrics if it is not Prometheus text or lacks vLLM's queue gauges."""
    sums: dict[str, float] = {}
    engines = 0  # kv_cache_usage_perc series: a fraction per engine, averaged rather than summed
    block_size = num_blocks = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == CACHE_INFO:
                    block_size = _int_label(sample.labels, "block_size") or block_size
                    num_blocks = _int_label(sample.labels, "num_gpu_blocks") or num_blocks
                elif sample.name in _SUMMED:
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                    engines += sample.name == KV_USAGE
    except ValueError as e:
        raise BadMetrics(f"not Prometheus text: {e}") from None
    if RUNNING not in sums or WAITING not in sums:
        raise BadMetrics(f"no {RUNNING} / {WAITING}: not a vLLM /metrics")
    return VllmLoad(
        running=int(sums[RUNNING]),
        waiting=int(sums[WAITING]),
        kv_usage=min(1.0, max(0.0, sums.get(KV_USAGE, 0.0) / max(1, engines))),
        block_size=block_size,
        num_blocks=num_blocks,
        steps=sums.get(f"{ITERATION_TOKENS}_count", 0.0),
        computed_tokens=sums.get(f"{ITERATION_TOKENS}_sum", 0.0),
        prefills=sums.get(f"{PREFILL_COMPUTED}_count", 0.0),
        prefill_tokens=sums.get(f"{PREFILL_COMPUTED}_sum", 0.0),
    )
