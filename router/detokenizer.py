"""Token ids → text deltas for one choice, with stop strings (which the router, not the nodes, applies).

Decodes the whole output each time and emits what is new: simple and exactly equal to decoding the final
ids at once. Holds back a trailing incomplete UTF-8 character and, while stop strings are set, the last
`max_stop_len - 1` characters (they might be the start of a stop string).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class TextDecoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class Delta:
    text: str
    stopped: bool  # a stop string matched: the text is final and the request must be aborted


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextDecoder, stop: list[str]) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self._emitted = 0
        self.text = ""

    def add(self, token_ids: list[int], final: bool = False) -> Delta:
        self.token_ids.extend(token_ids)
        full = self._tok.decode(self.token_ids, skip_special_tokens=True)
        if self._stop:
            start = max(0, self._emitted - self._hold)
            hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = full[self._emitted : cut] if cut > self._emitted else ""
                self.text = full[:cut]
                self._emitted = len(self.text)
                return Delta(delta, stopped=True)
        end = len(full)
        if not final:
            while end > self._emitted and full[end - 1] == "\ufffd":
                end -= 1
            end = max(self._emitted, end - self._hold)
        delta = full[self._emitted : end]
        self._emitted = end
        self.text = full[:end]
        return Delta(delta, stopped=False)
