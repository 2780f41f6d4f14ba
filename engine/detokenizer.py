"""Incremental detokenization (vLLM-style prefix/read offsets) plus stop-string handling.

Decoding a growing id list one token at a time breaks multi-byte characters and word-boundary spacing; so
each step decodes a small window `ids[prefix_offset:]`, subtracts the text of `ids[prefix_offset:read_offset]`,
and holds the new text back while it ends in U+FFFD (an incomplete UTF-8 sequence). With stop strings, the last
`max_stop_len - 1` characters are also held back until they cannot be the start of a stop string."""

from __future__ import annotations

from engine.sampling_params import SamplingParams

# Start the window a few tokens before the first generated token, so its leading space decodes correctly.
_INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids: list[int] = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self.read_offset = len(self.ids)
        self.prefix_offset = 0
        self.output_text = ""
        self._emitted = 0  # characters of output_text already returned as deltas
        self.stop_string: str | None = None

    def update(self, new_token_ids: list[int], finished: bool, check_stop: bool = True) -> tuple[str, bool]:
        """Feed new tokens; returns (delta text, hit a stop string). On a stop string the text is cut before
        it and the caller must finish the request."""
        skip = self.params.skip_special_tokens
        for tok in new_token_ids:
            self.ids.append(tok)
            prefix_text = self.tokenizer.decode(
                self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
            )
            text = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
            if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
                self.output_text += text[len(prefix_text) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
            if self.params.stop and check_stop and self._check_stop(len(text) - len(prefix_text)):
                return self._take_delta(final=True), True
            # Keep the window small: older tokens never change the decoded text of new ones.
            if self.prefix_offset > 64:
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
        return self._take_delta(final=finished), False

    def _check_stop(self, new_chars: int) -> bool:
        # Only a stop string that overlaps the newest characters can be new.
        tail_from = max(0, len(self.output_text) - max(new_chars, 1) - self.params.max_stop_len)
        for stop in self.params.stop:
            pos = self.output_text.find(stop, tail_from)
            if pos != -1:
                self.output_text = self.output_text[:pos]
                self.stop_string = stop
                return True
        return False

    def _take_delta(self, final: bool) -> str:
        end = len(self.output_text)
        if not final and self.params.stop:
            end = max(self._emitted, end - (self.params.max_stop_len - 1))
        delta = self.output_text[self._emitted : end]
        self._emitted = end
        return delta
