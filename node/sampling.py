"""The one conversion from the wire's SamplingSpec to the engine's SamplingParams (both node roles use it).

A job's spec describes the whole request; a job is one part of it. A prefill job samples only the first token;
a decode job continues after `num_generated` tokens that end its prompt (the prefill's first token, plus what a
resumed job carries). So min_tokens is what is left of it, and those tokens count as earlier output
(`prior_output_tokens`) for the penalties and the grammar."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import messages as P

if TYPE_CHECKING:  # the node runtime stays importable without torch
    from engine.sampling_params import SamplingParams


def sampling_params(spec: P.SamplingSpec, max_tokens: int) -> SamplingParams:
    from engine.guided import GuidedDecoding
    from engine.sampling_params import SamplingParams

    guide = spec.guide
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        seed=spec.seed,
        repetition_penalty=spec.repetition_penalty,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        min_tokens=min(max(0, spec.min_tokens - spec.num_generated), max_tokens),
        stop_token_ids=tuple(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
        logprobs=spec.logprobs,
        logit_bias=dict(spec.logit_bias) or None,
        allowed_token_ids=tuple(spec.allowed_token_ids) or None,
        guided_decoding=None if guide is None else GuidedDecoding(guide.kind, guide.schema),
        prior_output_tokens=spec.num_generated,
        detokenize=False,  # the router detokenizes (and applies stop strings)
    )
