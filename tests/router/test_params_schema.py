"""The router's request models and guides without processes: what is refused (and named), what a request's
choices ask the nodes for, how forced tool calls are parsed, and best_of's pick. The served behaviour of each
parameter is in test_params_cluster.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from protocol import messages as P
from router.errors import validate
from router.guides import ToolCallFormat, request_guide
from router.openai_schema import UNSUPPORTED, ApiError, ChatCompletionRequest, CompletionRequest
from router.sampling import keep_best, sampling_spec

BASE_C = {"model": "m", "prompt": "hi"}
BASE_CH = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_unsupported_parameter_is_refused_by_name_unless_its_no_op_value(name: str) -> None:
    with pytest.raises(ApiError) as e:
        CompletionRequest.model_validate({**BASE_C, name: "something"})
    assert e.value.status == 400 and e.value.param == name and e.value.code == "unsupported_parameter"
    CompletionRequest.model_validate({**BASE_C, name: UNSUPPORTED[name]})  # what a default-filling client sends


def test_unknown_parameter_is_refused_by_name() -> None:
    with pytest.raises(ApiError) as e:
        ChatCompletionRequest.model_validate({**BASE_CH, "temprature": 0.5})
    assert e.value.param == "temprature" and e.value.code == "unknown_parameter"


def test_spec_carries_every_sampling_parameter() -> None:
    body = CompletionRequest.model_validate(
        {
            **BASE_C,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "min_tokens": 3,
            "logit_bias": {"17": -100},
            "top_k": -1,
            "seed": 4,
            "response_format": {"type": "json_object"},
        }
    )
    guide, tools = request_guide(body)
    spec = sampling_spec(body, 8, 1, None, guide)
    assert (spec.min_p, spec.repetition_penalty, spec.presence_penalty, spec.frequency_penalty) == (0.1, 1.2, 0.5, -0.5)
    assert spec.min_tokens == 3 and spec.logit_bias == {17: -100.0} and spec.top_k == 0 and spec.seed == 5
    assert spec.guide == P.GuideSpec(P.GuideKind.JSON_OBJECT) and tools is None
    assert P.decode(P.encode(P.PrefillJob("r", [1], spec))).params == spec  # it crosses the wire intact


def test_best_of_asks_for_logprobs_and_keeps_the_best() -> None:
    body = CompletionRequest.model_validate({**BASE_C, "n": 1, "best_of": 3})
    assert body.num_samples == 3 and sampling_spec(body, 4, 0, None, None).logprobs == 0

    @dataclass
    class C:
        index: int
        cumulative_logprob: float

    picked = keep_best([C(0, -3.0), C(1, -1.0), C(2, -2.0), C(3, -9.0), C(4, -0.5), C(5, -1.0)], 3, 2)
    assert [(c.index, c.cumulative_logprob) for c in picked] == [(0, -1.0), (1, -2.0), (2, -0.5), (3, -1.0)]


def test_json_schema_guide_and_refused_schemas() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    guide, _ = request_guide(ChatCompletionRequest.model_validate({**BASE_CH, "response_format": fmt}))
    assert guide is not None and guide.kind is P.GuideKind.JSON_SCHEMA and json.loads(guide.schema or "") == schema
    for bad, why in [
        ({"type": "foo"}, "unknown type"),
        ({"$ref": "#/x"}, "points nowhere"),
        ({"pattern": "("}, "pattern"),
    ]:
        body = ChatCompletionRequest.model_validate(
            {**BASE_CH, "response_format": {"type": "json_schema", "json_schema": {"schema": bad}}}
        )
        with pytest.raises(ApiError, match=why) as e:
            request_guide(body)
        assert e.value.param == "response_format"


def test_structured_outputs_guides() -> None:
    def guide(so: object) -> P.GuideSpec | None:
        return request_guide(CompletionRequest.model_validate({**BASE_C, "structured_outputs": so}))[0]

    assert guide({"choice": ["a.b", "c d"]}) == P.GuideSpec(P.GuideKind.REGEX, "(a\\.b|c d)")
    assert guide({"regex": "[0-9]+"}) == P.GuideSpec(P.GuideKind.REGEX, "[0-9]+")
    assert guide({"json_object": True}) == P.GuideSpec(P.GuideKind.JSON_OBJECT)
    spec = guide({"json": '{"type": "integer"}'})
    assert spec is not None and json.loads(spec.schema or "") == {"type": "integer"}
    for bad in [{"regex": "("}, {"json": "{nope"}, {"json_object": False}]:
        with pytest.raises(ApiError) as e:
            guide(bad)
        assert e.value.param == "structured_outputs"
    for bad in [{"regex": "a", "choice": ["b"]}, {"grammar": "root ::= x"}, {}]:
        with pytest.raises(ApiError) as e:  # as the router parses a body: a 400 naming the parameter
            validate(json.dumps({**BASE_C, "structured_outputs": bad}).encode(), CompletionRequest)
        assert e.value.param == "structured_outputs"


def test_tool_guides() -> None:
    named = {"type": "function", "function": {"name": "f"}}
    body = ChatCompletionRequest.model_validate({**BASE_CH, "tools": [TOOL], "tool_choice": named})
    guide, tools = request_guide(body)
    assert guide is not None and json.loads(guide.schema or "") == {"type": "object"} and tools == ToolCallFormat("f")
    body = ChatCompletionRequest.model_validate(
        {**BASE_CH, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    )
    guide, tools = request_guide(body)
    array = json.loads(guide.schema or "") if guide else {}
    assert array["type"] == "array" and array["minItems"] == array["maxItems"] == 1 and tools == ToolCallFormat(None)
    none = ChatCompletionRequest.model_validate({**BASE_CH, "tools": [TOOL], "tool_choice": "none"})
    assert request_guide(none) == (None, None)


def test_tool_call_parsing() -> None:
    calls = ToolCallFormat(None).parse('[{"name": "f", "parameters": {"x": 1}}]')
    assert calls is not None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    named = ToolCallFormat("g").parse('{"y": "z"}')
    assert named is not None and named[0]["function"] == {"name": "g", "arguments": '{"y": "z"}'}
    assert ToolCallFormat("g").parse('{"y": ') is None  # cut by max_tokens: no call


def test_truncate_and_echo_text() -> None:
    from router.sampling import echo_text, truncate

    body = CompletionRequest.model_validate({**BASE_C, "truncate_prompt_tokens": 2})
    assert truncate([1, 2, 3], body) == [2, 3] and truncate([1], body) == [1]
    right = CompletionRequest.model_validate({**BASE_C, "truncate_prompt_tokens": 2, "truncation_side": "right"})
    assert truncate([1, 2, 3], right) == [1, 2]

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(f"<{i}>" for i in ids)

    echo = CompletionRequest.model_validate({**BASE_C, "echo": True})
    assert echo_text(Tok(), echo, 0, [5]) == "hi"
    ids_prompt = CompletionRequest.model_validate({**BASE_C, "echo": True, "prompt": [7, 8]})
    assert echo_text(Tok(), ids_prompt, 0, [7, 8]) == "<7><8>"
    convo = [*BASE_CH["messages"], {"role": "assistant", "content": "Hello"}]
    chat = ChatCompletionRequest.model_validate({**BASE_CH, "messages": convo, "echo": True})
    assert echo_text(Tok(), chat, 0, [1]) == "Hello"
    assert echo_text(Tok(), ChatCompletionRequest.model_validate({**BASE_CH, "echo": True}), 0, [1]) == ""
