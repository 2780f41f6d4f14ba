"""Incremental detokenization with the real tokenizer: never broken UTF-8, deltas add up to the full text."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.incremental_decode import IncrementalDecoder
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


def test_stop_strings_before_min_tokens_do_not_count(tokenizer):
    """check_stop=False (before min_tokens): a stop string ending in that text is passed over, a later one cuts."""
    ids = tokenizer.encode("one two one two three", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[" two"]))
    out, hit = "", False
    for i, t in enumerate(ids):
        delta, hit = detok.update([t], finished=False, check_stop=i >= 2)  # " two" ends at token 2
        out += delta
        if hit:
            break
    assert hit and out == "one two one" and detok.stop_string == " two"


@pytest.mark.parametrize("step", [1, 3, 100])
def test_first_stop_string_to_end_wins_however_tokens_are_batched(tokenizer, step):
    """ "two three four" starts first but " three" ends first: generation would have stopped at " three"."""
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    detok = IncrementalDecoder(tokenizer, ["two three four", " three"])
    out: list[str] = []
    for i in range(0, len(ids), step):
        delta = detok.add(ids[i : i + step], final=i + step >= len(ids))
        out.append(delta.text)
        if delta.stopped:
            break
    assert delta.stopped and "".join(out) == "one two" and detok.stop_string == " three"


def test_include_stop_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDecoder(tokenizer, ["beta"], include_stop=True)
    delta = detok.add(ids, final=True)
    assert delta.stopped and delta.text == detok.text == "alpha beta"


def test_prompt_context_ending_mid_character_is_dropped(tokenizer):
    """A prompt cut inside a character: its bytes are not subtracted, and the output decodes on its own."""
    emoji = tokenizer.encode("🤖", add_special_tokens=False)
    assert len(emoji) > 1  # byte tokens: the prompt below ends inside the character
    ids = tokenizer.encode(" done", add_special_tokens=False)
    detok = IncrementalDecoder(tokenizer, context_ids=emoji[:-1])
    assert detok.add(emoji[-1:] + ids, final=True).text == tokenizer.decode(emoji[-1:] + ids)
