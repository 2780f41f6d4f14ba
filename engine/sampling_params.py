"""Per-request sampling parameters, validated on construction (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.guided.spec import GuidedDecoding

# Above this a temperature is treated as sampling; at or below it, greedy (avoids dividing by ~0).
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Not frozen so callers can pass lists like in vLLM; normalised to tuples here, then treated as read-only."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always added)
    skip_special_tokens: bool = True
    detokenize: bool = True
    # token id → added to its logit before sampling (OpenAI's logit_bias; -100 bans, +100 forces in practice)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (vLLM's); None: any
    guided_decoding: GuidedDecoding | None = None
    # The last k prompt tokens are this request's earlier output (a decode node continuing after a prefill
    # node's first token): presence/frequency penalties and guided decoding count them as output.
    # max_tokens and min_tokens count only what this engine generates.
    prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept lists / a single string like vLLM, stored as tuples so the dataclass stays hashable.
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif not isinstance(self.stop, tuple):
            self.stop = tuple(self.stop or ())
        if not isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = tuple(self.stop_token_ids or ())
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = tuple(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {
                int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in self.logit_bias.items()
            }
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0 or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                    raise ValueError(
                        f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {tok!r}: {bias!r}"
                    )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecoding):
            raise ValueError(f"guided_decoding must be a GuidedDecoding, got {type(self.guided_decoding).__name__}")
        if not isinstance(self.prior_output_tokens, int) or self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be an int >= 0, got {self.prior_output_tokens!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
