"""Token ids → text deltas for one choice, with stop strings (which the router, not the nodes, applies).

`tokenizers.DecodeStream` turns each new token into its new text in constant time (it keeps a small window and
buffers an incomplete UTF-8 character until it completes), so a choice costs time linear in its length; the
old way, decoding the whole output on every delta, was quadratic (seconds of router CPU for a 4,096-token
answer). The last delta decodes all ids once to pick up what the stream still buffers (a trailing incomplete
character, which a whole decode renders as U+FFFD): the text is exactly the whole decode's.

While stop strings are set, the last `max_stop_len - 1` characters are held back (they might be the start of a
stop string). A stop string that starts in emitted text would have ended within the held characters and been
found then, so only the held text is searched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream


class TextDecoder(Protocol):
    """engine.tokenizer.Tokenizer's face as the detokenizer needs it: `hf` is a fast (Rust-backed) tokenizer."""

    hf: Any

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class Delta:
    text: str
    stopped: bool  # a stop string matched: the text is final and the request must be aborted


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: TextDecoder, stop: list[str], skip_special_tokens: bool = True, include_stop: bool = False
    ) -> None:
        self._tok = tokenizer
        self._backend = tokenizer.hf.backend_tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop  # include_stop_str_in_output: the matched stop string ends the text
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self._decoded = 0  # characters the stream produced so far (emitted + held)
        self._held = ""  # decoded, not yet emitted
        self._parts: list[str] = []  # emitted, joined on demand

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_ids: list[int], final: bool = False) -> Delta:
        self.token_ids.extend(token_ids)
        if token_ids:
            chunk = self._stream.step(self._backend, list(token_ids))
            if chunk:
                self._held += chunk
                self._decoded += len(chunk)
        if final:
            full = self._tok.decode(self.token_ids, skip_special_tokens=self._skip)
            self._held += full[self._decoded :]
            self._decoded = len(full)
        if self._stop:
            hits = [(i, len(s)) for i, s in ((self._held.find(s), s) for s in self._stop) if i >= 0]
            if hits:
                at, length = min(hits)
                return Delta(self._emit(at + length if self._include_stop else at), stopped=True)
        return Delta(self._emit(len(self._held) if final else max(0, len(self._held) - self._hold)), stopped=False)

    def _emit(self, n: int) -> str:
        delta, self._held = self._held[:n], self._held[n:]
        if delta:
            self._parts.append(delta)
        return delta
