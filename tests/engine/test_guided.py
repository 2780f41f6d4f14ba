"""Guided decoding (engine/guided, xgrammar) on the embedded SmolLM2, greedy fp32: the output parses and follows
its schema / regular expression, sampled samples too, a decode node's continuation equals one run, and a schema
xgrammar cannot compile is refused when the request is added."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import SamplingParams
from engine.guided import GuidedDecoding, GuidedKind
from tests.engine_helpers import make_llm, single_thread

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def llm(smollm2_fp32):
    with single_thread():
        yield make_llm(smollm2_fp32)


def _ask(llm, guide: GuidedDecoding, **params):
    ids = llm.get_tokenizer().apply_chat_template(ASK)
    sp = SamplingParams(guided_decoding=guide, **{"temperature": 0.0, "max_tokens": 80, **params})
    return llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0], ids


def test_json_schema_output_validates(llm) -> None:
    out, _ = _ask(llm, GuidedDecoding.json_schema(SCHEMA))
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.token_ids[-1] in llm.engine.eos_token_ids
    jsonschema.validate(json.loads(comp.text), SCHEMA)


def test_unguided_output_is_not_that_json(llm) -> None:
    """The oracle for the test above: without the grammar the model does not write this JSON by itself."""
    ids = llm.get_tokenizer().apply_chat_template(ASK)
    text = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=80, temperature=0), use_tqdm=False)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text[0].outputs[0].text), SCHEMA)


def test_json_object_and_regex(llm) -> None:
    out, _ = _ask(llm, GuidedDecoding(GuidedKind.JSON_OBJECT))
    assert isinstance(json.loads(out.outputs[0].text), dict)
    pattern = r"(yes|no), [0-9]{3}"
    out, _ = _ask(llm, GuidedDecoding(GuidedKind.REGEX, pattern))
    assert re.fullmatch(pattern, out.outputs[0].text)


def test_sampled_samples_each_follow_the_schema(llm) -> None:
    out, _ = _ask(llm, GuidedDecoding.json_schema(SCHEMA), temperature=1.0, seed=5, n=3, max_tokens=120)
    texts = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert texts, [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_continuing_after_the_first_token_equals_one_run(llm) -> None:
    guide = GuidedDecoding.json_schema(SCHEMA)
    whole, ids = _ask(llm, guide)
    tokens = whole.outputs[0].token_ids
    sp = SamplingParams(temperature=0, max_tokens=79, guided_decoding=guide, prior_output_tokens=1)
    rest = llm.generate({"prompt_token_ids": ids + tokens[:1]}, sp, use_tqdm=False)[0].outputs[0]
    assert rest.token_ids == tokens[1:]


def test_bad_guides_are_refused() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        GuidedDecoding(GuidedKind.JSON_SCHEMA, "{nope")
    with pytest.raises(ValueError, match="takes no schema"):
        GuidedDecoding(GuidedKind.JSON_OBJECT, "{}")


def test_uncompilable_schema_is_refused_at_add_request(llm) -> None:
    guide = GuidedDecoding(GuidedKind.REGEX, "(unclosed")
    with pytest.raises(ValueError, match="cannot compile"):
        llm.engine.add_request("bad-guide", [1, 2, 3], SamplingParams(guided_decoding=guide))
    assert not llm.engine.has_unfinished_requests()
