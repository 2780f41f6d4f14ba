"""Structured output (guided decoding) with xgrammar, the library vLLM uses: a grammar compiled from the
tokenizer's vocabulary once per schema, a matcher per sequence, its token bitmask applied to the logits before
sampling. `GuidedDecoding` is the request's spec (what `SamplingParams.guided_decoding` holds);
`GuidedBackend` is the engine's compiler + matcher cache (built lazily: xgrammar is imported on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.guided.spec import GuidedDecoding, GuidedKind

if TYPE_CHECKING:
    from engine.guided.backend import GuidedBackend

__all__ = ["GuidedBackend", "GuidedDecoding", "GuidedKind"]


def __getattr__(name: str) -> Any:
    # The backend imports torch; the spec is torch-free and `engine.sampling_params` (imported by torch-free code)
    # needs only the spec.
    if name == "GuidedBackend":
        from engine.guided.backend import GuidedBackend

        return GuidedBackend
    raise AttributeError(f"module 'engine.guided' has no attribute {name!r}")
