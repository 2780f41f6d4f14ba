"""Router-side incremental detokenization: deltas add up to decoding all ids at once; stop strings cut exactly."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from router.cli import tokenizer_dir
from router.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(tokenizer_dir("smollm2-135m"))


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
