"""What the engine hands back: vLLM-shaped `RequestOutput` / `CompletionOutput`.

From `EngineCore.step()` they are deltas (new token ids, new text, new logprobs); `LLM.generate` accumulates
them into complete outputs. `finish_reason` is a plain string at this surface ("stop" / "length" / "abort")
like vLLM (the values of the one `FinishReason` enum, protocol/messages.py, that the engine uses inside).

`EngineLoad` is the engine's state at one moment, for whoever hosts it (a node's heartbeats and metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request_stats import RequestStateStats
from engine.stats import EngineStats
from protocol.messages import KVTransferParams

if TYPE_CHECKING:
    from connector.metadata import ConnectorStats


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One generated position: token id → Logprob, the sampled token first, then the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from a cache (device prefix cache + connector)
    num_external_tokens: int = 0  # of those, loaded by the KV connector
    external_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of those, by store tier (Tier.value)
    kv_transfer_params: KVTransferParams | None = None  # the connector's, for the next hop (final output only)
    metrics: RequestStateStats | None = None  # the request's timeline (vLLM's RequestOutput.metrics)


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot from `EngineCore.load()`: what a host may know about the engine without reaching into it."""

    running: int  # sequences in the running batch
    waiting: int  # sequences queued (new, or preempted)
    num_blocks: int  # paged KV cache size, in blocks
    free_blocks: int  # blocks not held by any sequence (cached-but-unused blocks count as free)
    stats: EngineStats  # a copy of the counters (prefix-cache and connector hit tokens, steps, ...)
    connector: ConnectorStats | None = None  # a copy of the KV connector's counters; None without one

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served by the device prefix cache, of all admitted prompt tokens."""
        s = self.stats
        return s.prefix_cache_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
