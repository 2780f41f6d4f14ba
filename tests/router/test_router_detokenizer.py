"""Router-side incremental detokenization: deltas add up to decoding all ids at once; stop strings cut exactly."""

from __future__ import annotations

import random

import pytest

from engine.model_source import resolve_model_dir
from engine.tokenizer import Tokenizer
from router.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model_dir("smollm2-135m"))


TEXT = "Héllo wörld — naïve café 🚀 test: the stop word appears here, then more text."


def test_deltas_concatenate_to_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([t], final=i == len(ids) - 1).text for i, t in enumerate(ids)]
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in d for d in deltas), "a partial UTF-8 character leaked into a delta"


@pytest.mark.parametrize("stop", ["stop word", "appears", "🚀", "never-present"])
def test_stop_strings(tok: Tokenizer, stop: str) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, ["zzz-unused", stop])
    out, stopped = [], False
    for i, t in enumerate(ids):
        delta = detok.add([t], final=i == len(ids) - 1)
        out.append(delta.text)
        if delta.stopped:
            stopped = True
            break
    full = tok.decode(ids)
    if stop in full:
        assert stopped and "".join(out) == full[: full.index(stop)]
    else:
        assert not stopped and "".join(out) == full


class _CountingDecoder:
    """The tokenizer with its whole-sequence decodes counted (the quadratic path this must not take)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.hf = tok.hf
        self._tok = tok
        self.decoded_ids = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("source", ["text", "random ids"])
def test_long_output_equals_full_decode_in_linear_work(tok: Tokenizer, source: str) -> None:
    rng = random.Random(0)
    if source == "text":
        ids = tok.encode(TEXT * 200, add_special_tokens=False)[:2000]
    else:  # byte tokens that split UTF-8 characters, special tokens (skipped), any order
        ids = [rng.randrange(tok.vocab_size) for _ in range(2000)]
    assert len(ids) == 2000
    counting = _CountingDecoder(tok)
    detok = IncrementalDetokenizer(counting, [])
    deltas, i = [], 0
    while i < len(ids):
        step = rng.choice([1, 1, 1, 2, 5])  # nodes send batches of tokens too
        deltas.append(detok.add(ids[i : i + step], final=i + step >= len(ids)).text)
        i += step
    full = tok.decode(ids)
    assert "".join(deltas) == full == detok.text
    if "\ufffd" not in full:  # random bytes may be invalid UTF-8 for good; real text never is
        assert all("\ufffd" not in d for d in deltas), "a partial UTF-8 character leaked into a delta"
    # one whole decode (the last delta's reconciliation), not one per delta
    assert counting.decoded_ids == len(ids)


def test_stop_string_in_a_long_output(tok: Tokenizer) -> None:
    ids = tok.encode("lorem ipsum dolor " * 300 + "THE END and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, ["THE END"])
    out = []
    for t in ids:
        delta = detok.add([t])
        out.append(delta.text)
        if delta.stopped:
            break
    assert delta.stopped and "".join(out) == detok.text == "lorem ipsum dolor " * 300
