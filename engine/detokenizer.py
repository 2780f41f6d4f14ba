"""The engine's face of the one incremental detokenizer (`engine/incremental_decode.py`).

A thin adapter, not a second implementation: the engine core speaks vLLM's shapes (a request's SamplingParams
and prompt ids in, `(delta, hit a stop string)` out, `min_tokens` gating the stop check), the router speaks the
OpenAI body's fields. The engine primes the decoder with the prompt's last tokens, so the first generated
token's leading space renders as it does after the prompt (vLLM's output text); the engine never includes the
stop string in the text (SamplingParams has no include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.incremental_decode import IncrementalDecoder, TextDecoder
from engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextDecoder, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._decoder = IncrementalDecoder(
            tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens, context_ids=prompt_token_ids
        )

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, once `update` reported one."""
        return self._decoder.stop_string

    def update(self, new_token_ids: Sequence[int], finished: bool, check_stop: bool = True) -> tuple[str, bool]:
        """Feed new tokens; returns (delta text, hit a stop string). On a stop string the text is cut before
        it and the caller must finish the request."""
        delta = self._decoder.add(new_token_ids, final=finished, check_stop=check_stop)
        return delta.text, delta.stopped
