"""Incremental detokenization with the real tokenizer: never broken UTF-8, deltas add up to the full text."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.model_source import resolve_model_dir
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(resolve_model_dir("smollm2-135m"))


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! How are you today?",
        "日本語のテキストと絵文字 🤖🚀 mixed in",
        "  leading spaces\n\ttabs and ünïcödé",
    ],
)
def test_streamed_deltas_equal_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = [detok.update([t], finished=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_cut_and_held_back(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[" four"]))
    out, hit = "", False
    for t in ids:
        delta, hit = detok.update([t], finished=False)
        out += delta
        if hit:
            break
    assert hit and out == "one two three" and detok.stop_string == " four"
