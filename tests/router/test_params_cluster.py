"""Honour or refuse, never ignore (issue 15), on real processes: store, 1 prefill node, 1 decode node, router.

Each supported parameter changes the output the way it should, and, where it crosses the wire, exactly as the
offline engine applies it (greedy: the prefill node samples the first token, the decode node the rest, so a
parameter that counts output tokens, like min_tokens or presence_penalty, must count the first one on both).
Each unsupported or unknown parameter is a 400 naming it. One cluster for the module."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from launch.cluster import Cluster, ClusterSpec

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
REPEAT = "I like cats. I like cats. I like"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(
        prefill=1, decode=1, kv_cache_memory="64MiB", dtype="float32", max_num_seqs=8, node_args=("--threads", "1")
    )
    with Cluster(spec, log=lambda s: None) as c:
        yield c


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    with LLM(model=MODEL, dtype="float32", kv_cache_memory="64MiB") as offline:
        yield offline


def complete(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http: httpx.Client, messages=HI, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def offline(llm, prompt=PROMPT, **params) -> str:
    from engine import SamplingParams

    params = {"max_tokens": 8, "temperature": 0.0, **params}
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


# (parameter values, prompt): served greedy output equals the offline engine's with the same parameters, and
# differs from the output without them (the parameter did something).
CARRIED = [
    ({"presence_penalty": 2.0}, REPEAT),
    ({"frequency_penalty": 2.0}, REPEAT),
    ({"repetition_penalty": 1.8}, REPEAT),
    ({"logit_bias": {"28": 100.0}}, PROMPT),
    ({"logit_bias": {"7042": -100.0}}, PROMPT),  # bans " Paris"
]


@pytest.mark.parametrize("params,prompt", CARRIED, ids=[next(iter(p)) + str(i) for i, (p, _) in enumerate(CARRIED)])
def test_carried_parameter_equals_offline_and_changes_output(http, llm, params, prompt) -> None:
    served = complete(http, prompt=prompt, max_tokens=12, **params)["choices"][0]["text"]
    engine_params = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in params.items()}
    assert served == offline(llm, prompt, max_tokens=12, **engine_params)
    assert served != offline(llm, prompt, max_tokens=12)


def test_min_tokens_delays_eos_across_prefill_and_decode(http) -> None:
    free = chat(http, max_tokens=64)
    n = free["usage"]["completion_tokens"]
    assert free["choices"][0]["finish_reason"] == "stop" and n < 60
    held = chat(http, max_tokens=64, min_tokens=n + 4)
    assert held["usage"]["completion_tokens"] >= n + 4
    one = chat(http, max_tokens=64, min_tokens=1)  # the prefill node's token alone satisfies it
    assert one["choices"][0]["message"]["content"] == free["choices"][0]["message"]["content"]


def test_allowed_token_ids_restrict_the_output(http) -> None:
    out = complete(http, allowed_token_ids=[28, 7042], logprobs=0, max_tokens=6)["choices"][0]
    assert out["logprobs"]["tokens"] and set(out["logprobs"]["tokens"]) <= {",", " Paris"}
    assert set(complete(http, max_tokens=6, logprobs=0)["choices"][0]["logprobs"]["tokens"]) - {",", " Paris"}


def test_min_p_one_keeps_only_the_top_token(http) -> None:
    greedy = complete(http)["choices"][0]["text"]
    assert complete(http, temperature=1.0, min_p=1.0, seed=3)["choices"][0]["text"] == greedy


def test_echo_prepends_the_prompt(http) -> None:
    plain = complete(http)["choices"][0]["text"]
    assert complete(http, echo=True)["choices"][0]["text"] == PROMPT + plain
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "stream": True},
    )
    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events).startswith(PROMPT)


def test_truncate_prompt_tokens_and_chat_echo(http, llm) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    out = complete(http, truncate_prompt_tokens=3)
    assert out["usage"]["prompt_tokens"] == 3
    assert out["choices"][0]["text"] == offline(llm, {"prompt_token_ids": ids[-3:]})
    convo = [*HI, {"role": "assistant", "content": "Hello! How"}]
    body = {"max_tokens": 4, "add_generation_prompt": False, "continue_final_message": True}
    plain = chat(http, messages=convo, **body)["choices"][0]["message"]["content"]
    echoed = chat(http, messages=convo, echo=True, **body)["choices"][0]["message"]["content"]
    assert echoed == "Hello! How" + plain


def test_best_of_returns_the_highest_cumulative_logprob(http) -> None:
    body = {"temperature": 1.0, "seed": 11, "max_tokens": 6}
    all3 = complete(http, n=3, logprobs=0, **body)["choices"]
    scores = {c["index"]: sum(c["logprobs"]["token_logprobs"]) for c in all3}
    best = max(scores, key=scores.__getitem__)
    picked = complete(http, n=1, best_of=3, **body)["choices"]
    assert len(picked) == 1 and picked[0]["index"] == 0 and picked[0]["logprobs"] is None
    assert picked[0]["text"] == all3[best]["text"]


def test_special_tokens_and_stop_string_options(http) -> None:
    forced = {"logit_bias": {"1": 100.0}, "max_tokens": 3}  # 1 is <|im_start|>, a special token
    assert complete(http, **forced)["choices"][0]["text"] == ""
    assert complete(http, skip_special_tokens=False, **forced)["choices"][0]["text"] == "<|im_start|>" * 3
    text = complete(http, max_tokens=8)["choices"][0]["text"]
    stop = text.strip().split()[0]
    cut = complete(http, stop=[stop])["choices"][0]["text"]
    kept = complete(http, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == cut + stop and not cut.endswith(stop)


def test_chat_template_options(http, llm) -> None:
    tok = llm.get_tokenizer()
    base = chat(http, max_tokens=4)["usage"]["prompt_tokens"]
    assert base == len(tok.apply_chat_template(HI))
    no_gen = chat(http, max_tokens=4, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert no_gen == len(tok.apply_chat_template(HI, add_generation_prompt=False)) < base
    template = "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:"
    custom = chat(http, max_tokens=6, chat_template=template)
    assert custom["usage"]["prompt_tokens"] == len(tok.encode("Q: Say hi.\nA:", add_special_tokens=False))
    assert custom["choices"][0]["message"]["content"] == offline(llm, "Q: Say hi.\nA:", max_tokens=6)
    cont = [*HI, {"role": "assistant", "content": "Hello! How"}]
    out = chat(http, messages=cont, max_tokens=6, add_generation_prompt=False, continue_final_message=True)
    rendered = tok.render_chat(cont, False, continue_final_message=True)
    assert rendered.endswith("Hello! How")
    assert out["choices"][0]["message"]["content"] == offline(llm, rendered, max_tokens=6)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a city and its population as JSON."}]


def test_response_format_json_schema_and_json_object(http) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    out = chat(http, messages=ASK, max_tokens=60, response_format=fmt)["choices"][0]
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["message"]["content"]), SCHEMA)
    out = chat(http, messages=ASK, max_tokens=60, response_format={"type": "json_object"})["choices"][0]
    assert isinstance(json.loads(out["message"]["content"]), dict)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]


def test_structured_outputs_choice(http) -> None:
    so = {"choice": ["Paris", "London", "Berlin"]}
    text = complete(http, max_tokens=8, structured_outputs=so)["choices"][0]["text"]
    assert text in so["choice"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls(http, tool_choice) -> None:
    # One call: this small model repeats a call until max_tokens when the grammar allows more (parallel calls).
    body = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    out = chat(http, messages=ASK, max_tokens=80, **body)["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    calls = out["message"]["tool_calls"]
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for call in calls:
        assert call["function"]["name"] in {"get_weather", "noop"}
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            jsonschema.validate(args, SCHEMA)
    if isinstance(tool_choice, dict):
        assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_streamed_tool_call_with_the_openai_sdk(cluster) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, temperature=0, tools=TOOLS, tool_choice=named, stream=True
    )
    chunks = list(stream)
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA)
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(http, path) -> None:
    # guidellm sends it on every request; vLLM honours it only with include_usage, as here
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body.update({"prompt": PROMPT} if path == C else {"messages": HI})
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(http, path, {**body, "stream_options": options})
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert chunks and all("usage" in c for c in chunks)
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 6, completion
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["usage"]["prompt_tokens"]}
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks
    )
    plain = _events(http, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in c for c in plain), "without include_usage there is no usage at all (vLLM's rule)"


def _error(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


C, CH = "/v1/completions", "/v1/chat/completions"
REFUSED = [
    (C, {"suffix": "x"}, "suffix"),
    (C, {"use_beam_search": True}, "use_beam_search"),
    (C, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (C, {"allowed_token_ids": []}, "allowed_token_ids"),
    (C, {"allowed_token_ids": [49152]}, "allowed_token_ids"),  # beyond the vocabulary
    (C, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (C, {"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
    (C, {"frobnicate": 1}, "frobnicate"),
    (C, {"echo": True, "logprobs": 1}, "echo"),
    (C, {"n": 3, "best_of": 2}, "best_of"),
    (C, {"n": 1, "best_of": 2, "stream": True}, "best_of"),
    (C, {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    (C, {"logit_bias": {"x": 1.0}}, "logit_bias"),
    (C, {"logit_bias": {"3": 101.0}}, "logit_bias"),
    (C, {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    (C, {"truncation_side": "middle"}, "truncation_side"),
    (CH, {"tools": TOOLS}, "tool_choice"),  # OpenAI's default with tools is "auto"
    (CH, {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    (CH, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (CH, {"tool_choice": "required"}, "tool_choice"),
    (CH, {"response_format": {"type": "json_schema"}}, "response_format"),
    (CH, {"response_format": {"type": "yaml"}}, "response_format"),
    (CH, {"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    (CH, {"chat_template": "{% for %}"}, "chat_template"),
    (CH, {"chat_template_kwargs": {"tokenize": True}}, "messages"),
    (CH, {"functions": [{"name": "f"}]}, "functions"),
    (CH, {"reasoning_effort": "high"}, "reasoning_effort"),
]


@pytest.mark.parametrize(
    "path,extra,param", REFUSED, ids=[f"{'chat' if p == CH else 'completions'}-{x}" for p, _, x in REFUSED]
)
def test_unsupported_or_invalid_is_a_400_naming_the_parameter(http, path, extra, param) -> None:
    base = {"model": MODEL, "max_tokens": 8}
    base.update({"prompt": PROMPT} if path == C else {"messages": HI})
    err = _error(http, path, {**base, **extra})
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_no_op_values_of_unsupported_parameters_are_accepted(http) -> None:
    # Clients that send every default (vLLM's own benchmark, SDK wrappers) must not be refused for it.
    out = complete(http, use_beam_search=False, length_penalty=1.0, include_reasoning=True, priority=0, suffix=None)
    assert out["choices"][0]["finish_reason"] in {"stop", "length"}


def test_openai_sdk_extra_body_is_honoured(cluster) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    biased = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"logit_bias": {"28": 100}}
    )
    assert biased.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="top_a"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"top_a": 0.1})


# Valid to the router (a Python regex) but not to xgrammar on the node: a back-reference. The request's own
# fault, so a 400 from the first node's answer, with no retry elsewhere.
ENGINE_REFUSED = [{"regex": r"(a)\1"}, {"regex": r"(?=a)a"}]


@pytest.mark.parametrize("so", ENGINE_REFUSED, ids=["backreference", "lookahead"])
def test_a_guide_only_the_engine_refuses_is_a_400(http, so) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "structured_outputs": so}
    err = _error(http, C, body)
    assert err["type"] == "invalid_request_error" and "cannot compile" in err["message"], err
    assert complete(http)["choices"][0]["finish_reason"] in {"stop", "length"}, "the cluster must keep serving"


# What widely used clients send by default, recorded once against a capturing proxy (benchmarks/capture_clients.py):
# the OpenAI SDK, `vllm bench serve` (openai and openai-chat), AIPerf, guidellm, litellm, LangChain. Each request is
# replayed as it was sent, headers included, and must be answered 200 with a well-formed body or stream.
CLIENT_FIXTURES = sorted((Path(__file__).parent / "client_fixtures").glob("*.json"))


def test_every_client_fixture_was_recorded() -> None:
    clients = {json.loads(f.read_text())["client"] for f in CLIENT_FIXTURES}
    assert clients >= {"openai-sdk", "vllm-bench", "aiperf", "guidellm", "litellm", "langchain"}, clients


@pytest.mark.parametrize("fixture", CLIENT_FIXTURES, ids=[f.stem for f in CLIENT_FIXTURES])
def test_what_a_client_sends_by_default_is_answered(http, fixture) -> None:
    sent = json.loads(fixture.read_text())
    r = http.request(sent["method"], sent["path"], headers=sent["headers"], json=sent["body"])
    assert r.status_code == 200, r.text
    if sent["path"] == "/v1/models":
        assert MODEL in {m["id"] for m in r.json()["data"]}
        return
    if isinstance(sent["body"], dict) and sent["body"].get("stream"):
        events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and not any("error" in c for c in chunks), r.text[-1000:]
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), "no finish_reason"
    else:
        out = r.json()
        assert out["choices"] and out["choices"][0]["finish_reason"] in {"stop", "length"}, out
        assert out["usage"]["completion_tokens"] >= 1
