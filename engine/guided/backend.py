"""Compiled grammars (cached per spec) and per-sequence matchers that catch up with a sequence's tokens.

A matcher is keyed by the sequence's output-token list (the very list object, held so its id stays unique)
and sample index; before each sampling it accepts the tokens it has not seen yet. So the sampler needs no
callback after sampling, a recomputed (preempted) sequence keeps its matcher, and an evicted matcher is
rebuilt by replaying the tokens: a cache, never the truth."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch

from engine.guided.spec import GuidedDecoding, GuidedKind

_MAX_GRAMMARS = 64
_MAX_MATCHERS = 4096


@dataclass
class _Matcher:
    tokens: list[int]  # the sequence's own output list (kept alive: its id is part of the key)
    matcher: Any
    accepted: int = 0  # how many guided tokens the matcher has seen


def _bit(b: int) -> int:
    """Bit b of an int32 bitmask word as a signed int32 value (bit 31 is the sign bit)."""
    v = 1 << b
    return v - (1 << 32) if v >= 1 << 31 else v


class GuidedBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._compiler: Any = None
        self._grammars: collections.OrderedDict[GuidedDecoding, Any] = collections.OrderedDict()
        self._matchers: collections.OrderedDict[tuple[int, int], _Matcher] = collections.OrderedDict()

    def _compile(self, spec: GuidedDecoding) -> Any:
        grammar = self._grammars.get(spec)
        if grammar is not None:
            self._grammars.move_to_end(spec)
            return grammar
        import xgrammar as xgr

        if self._compiler is None:
            hf = getattr(self._tokenizer, "hf", self._tokenizer)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self._eos)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        # No free whitespace between JSON tokens: a small model otherwise can loop on newlines forever.
        if spec.kind is GuidedKind.JSON_OBJECT:
            grammar = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif spec.kind is GuidedKind.JSON_SCHEMA:
            grammar = self._compiler.compile_json_schema(spec.schema, any_whitespace=False)
        else:
            grammar = self._compiler.compile_regex(spec.schema)
        self._grammars[spec] = grammar
        if len(self._grammars) > _MAX_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def check(self, spec: GuidedDecoding) -> None:
        """Compile now, so a schema xgrammar cannot handle is refused when the request is added (ValueError)."""
        try:
            self._compile(spec)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"cannot compile the {spec.kind.value} guide: {e}") from None

    def _matcher(self, spec: GuidedDecoding, output: list[int], sample_index: int, tokens: list[int]) -> _Matcher:
        key = (id(output), sample_index)
        state = self._matchers.get(key)
        if state is None or state.tokens is not output or state.accepted > len(tokens):
            import xgrammar as xgr

            state = _Matcher(output, xgr.GrammarMatcher(self._compile(spec)))
            self._matchers[key] = state
            if len(self._matchers) > _MAX_MATCHERS:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(key)
        for tok in tokens[state.accepted :]:
            if state.matcher.is_terminated():
                break
            assert state.matcher.accept_token(tok), f"token {tok} breaks the grammar it was sampled under"
            state.accepted += 1
        state.accepted = len(tokens)
        return state

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, GuidedDecoding, list[int], int, list[int]]]) -> None:
        """Mask, in place, every token the grammar forbids next. `rows`: (logits row, spec, the sequence's
        output list, sample index, the guided tokens so far: earlier output in the prompt + that list)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, (_, spec, output, sample_index, tokens) in enumerate(rows):
            state = self._matcher(spec, output, sample_index, tokens)
            if state.matcher.is_terminated():
                bitmask[j].zero_()  # done: only an end of sequence may follow
                for t in self._eos:
                    bitmask[j, t // 32] |= _bit(t % 32)
            else:
                state.matcher.fill_next_token_bitmask(bitmask, j)
        idx = [r[0] for r in rows]
        sub = logits[idx]
        xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=self.vocab_size)
        logits[idx] = sub
