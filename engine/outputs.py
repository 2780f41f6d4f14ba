"""What the engine hands back: vLLM-shaped `RequestOutput` / `CompletionOutput`.

From `EngineCore.step()` they are deltas (new token ids, new text, new logprobs); `LLM.generate` accumulates
them into complete outputs. `finish_reason` is a plain string at this surface ("stop" / "length" / "abort")
like vLLM; inside the engine it is the `FinishReason` enum."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
