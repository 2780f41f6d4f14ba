"""Structured output (guided decoding) with xgrammar, the library vLLM uses: a grammar compiled from the
tokenizer's vocabulary once per schema, a matcher per sequence, its token bitmask applied to the logits before
sampling. `GuidedDecoding` is the request's spec (what `SamplingParams.guided_decoding` holds);
`GuidedBackend` is the engine's compiler + matcher cache (built lazily: xgrammar is imported on first use)."""

from engine.guided.backend import GuidedBackend
from engine.guided.spec import GuidedDecoding, GuidedKind

__all__ = ["GuidedBackend", "GuidedDecoding", "GuidedKind"]
