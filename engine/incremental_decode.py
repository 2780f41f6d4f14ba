"""Token ids → text deltas for one sequence, with stop strings: the one incremental detokenizer.

The engine (offline `LLM.generate`, through `engine/detokenizer.py`) and the router (OpenAI streaming, through
`router/detokenizer.py`) both use this class. Torch-free: the router imports it.

`tokenizers.DecodeStream` turns each new token into its new text in constant time (it keeps a small window and
buffers an incomplete UTF-8 character until it completes), so a sequence costs time linear in its length;
decoding the whole output on every delta would be quadratic (seconds of CPU for a 4,096-token answer). The last
delta decodes all ids once to pick up what the stream still buffers (a trailing incomplete character, which a
whole decode renders as U+FFFD): the text is exactly the whole decode's.

`context_ids` (the prompt's last few tokens) prime the stream, so the first token's leading space decodes as it
does after the prompt (SentencePiece-style decoders drop a leading space at the very start of a sequence).

While stop strings are set, the last `max(len(stop)) - 1` characters are held back (they might be the start of
a stop string). A stop string that starts in emitted text would have ended within the held characters and been
found then, so only the held text is searched. When several match, the one that ends first wins (where
generation would have stopped had the tokens come one at a time), so batching tokens does not change the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

# Prompt tokens that prime the stream: enough for any word-boundary rule, few enough to decode for free.
CONTEXT_TOKENS = 5


class TextDecoder(Protocol):
    """engine.tokenizer.Tokenizer's face as the detokenizer needs it: `hf` is a fast (Rust-backed) tokenizer."""

    hf: Any

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Delta:
    text: str
    stopped: bool  # a stop string matched: the text is final and the request must be finished


class IncrementalDecoder:
    def __init__(
        self,
        tokenizer: TextDecoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._backend = tokenizer.hf.backend_tokenizer
        self._skip = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop  # include_stop_str_in_output: the matched stop string ends the text
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._context = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self._context_text = tokenizer.decode(self._context, skip_special_tokens=self._skip) if self._context else ""
        if self._context_text.endswith("\ufffd"):
            # The prompt ends inside a character the output completes: the stream could not subtract the
            # context's text from what follows, so decode the output on its own.
            self._context, self._context_text = [], ""
        self._stream = DecodeStream(ids=self._context or None, skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.stop_string: str | None = None  # the stop string that matched, once one has
        self._decoded = 0  # characters the stream produced so far (emitted + held)
        self._held = ""  # decoded, not yet emitted
        self._unchecked = 0  # leading characters of _held decoded with check_stop=False: no match may end there
        self._parts: list[str] = []  # emitted, joined on demand

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_ids: Sequence[int], final: bool = False, check_stop: bool = True) -> Delta:
        """Feed new tokens. `final`: no more will come (emit everything). `check_stop=False` (before the
        engine's min_tokens): stop strings ending in this text do not count. On `stopped` the text ends before
        the stop string (or with it, `include_stop`) and the caller must finish the request."""
        self.token_ids.extend(token_ids)
        if token_ids:
            chunk = self._stream.step(self._backend, list(token_ids))
            if chunk:
                self._held += chunk
                self._decoded += len(chunk)
        if final:
            rest = self._whole_text()[self._decoded :]
            self._held += rest
            self._decoded += len(rest)
        if not check_stop:
            self._unchecked = len(self._held)
        elif self._stop:
            at = self._find_stop()
            if at is not None:
                return Delta(self._emit(at), stopped=True)
        return Delta(self._emit(len(self._held) if final else max(0, len(self._held) - self._hold)), stopped=False)

    def _whole_text(self) -> str:
        # One decode of everything (context included, so word boundaries match the stream's), minus the context.
        full = self._tok.decode(self._context + self.token_ids, skip_special_tokens=self._skip)
        if full.startswith(self._context_text):
            return full[len(self._context_text) :]
        return self._tok.decode(self.token_ids, skip_special_tokens=self._skip)

    def _find_stop(self) -> int | None:
        """Where the emitted text ends if a stop string matched in the held text (recorded in stop_string)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop): the first to end, then the longest
        for s in self._stop:
            start = self._held.find(s, max(0, self._unchecked - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, self.stop_string = best
        return end if self._include_stop else start

    def _emit(self, n: int) -> str:
        delta, self._held = self._held[:n], self._held[n:]
        self._unchecked = max(0, self._unchecked - n)
        if delta:
            self._parts.append(delta)
        return delta
