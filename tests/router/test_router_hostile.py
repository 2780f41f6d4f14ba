"""Issue 11, "one bad request must not kill the cluster", at the router: the real app over real HTTP (uvicorn on a
thread) in front of a real node runtime (NodeServer, JobRunner, heartbeats over ZeroMQ) whose engine is a fake
(tests/node_helpers.py), so every case runs in milliseconds.

- every parameter's bounds and types, huge integers, NaN, deep nesting, lone surrogates, huge bodies, long
  prompts and fan-out: a 4xx with the OpenAI error shape, never a 5xx; afterwards a normal request is served
- /health answers while a 10 MB body is being refused (413)
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from protocol import job_limits as L
from tests.node_helpers import VOCAB
from tests.router.hostile_live import CHAT, MODEL, NODE, C, Live, assert_served, metric

# ------------------------------------------------------------------ the bad-input table


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


MSG = [{"role": "user", "content": "hi"}]
BIG = "9" * 5000  # a 5000-digit integer literal (Python itself refuses to print one)

# (name, path, JSON body as a dict or raw text, status, param)
BAD: list[tuple[str, str, dict[str, Any] | str, int, str | None]] = [
    ("max_tokens type", C, {"max_tokens": "five"}, 400, "max_tokens"),
    ("max_tokens zero", C, {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", C, {"max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens 2^31", C, {"max_tokens": 2**31}, 400, "max_tokens"),
    ("max_tokens 2^64", C, {"max_tokens": 2**64}, 400, "max_tokens"),
    ("max_tokens 30 digits", C, {"max_tokens": 10**30}, 400, "max_tokens"),
    (
        "max_tokens 5000 digits",
        C,
        '{"model": "smollm2-135m", "prompt": "hi", "max_tokens": ' + BIG + "}",
        400,
        "max_tokens",
    ),
    ("seed 5000 digits", C, '{"model": "smollm2-135m", "prompt": "hi", "seed": -' + BIG + "}", 400, "seed"),
    ("max_tokens float", C, {"max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens beyond context", C, {"max_tokens": 4000}, 400, "max_tokens"),
    ("temperature negative", C, {"temperature": -0.1}, 400, "temperature"),
    ("temperature above 2", C, {"temperature": 2.5}, 400, "temperature"),
    ("temperature string", C, {"temperature": "hot"}, 400, "temperature"),
    ("temperature 1e400", C, '{"model": "smollm2-135m", "prompt": "hi", "temperature": 1e400}', 400, "temperature"),
    ("temperature NaN", C, '{"model": "smollm2-135m", "prompt": "hi", "temperature": NaN}', 400, None),
    ("temperature Infinity", C, '{"model": "smollm2-135m", "prompt": "hi", "temperature": -Infinity}', 400, None),
    ("top_p zero", C, {"top_p": 0}, 400, "top_p"),
    ("top_p above 1", C, {"top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", C, {"top_k": -2}, 400, "top_k"),
    ("top_k 2^63 (killed both nodes)", C, {"top_k": 2**63, "temperature": 1}, 400, "top_k"),
    ("top_k 2^64", C, {"top_k": 2**64}, 400, "top_k"),
    ("top_k above bound", C, {"top_k": L.MAX_TOP_K + 1}, 400, "top_k"),
    ("top_k float", C, {"top_k": 1.5}, 400, "top_k"),
    ("n zero", C, {"n": 0}, 400, "n"),
    ("n above bound", C, {"n": L.MAX_N + 1}, 400, "n"),
    ("n 2^64", C, {"n": 2**64}, 400, "n"),
    ("seed 2^63", C, {"seed": 2**63}, 400, "seed"),
    ("seed below int64", C, {"seed": -(2**63) - 1}, 400, "seed"),
    ("seed 2^64", C, {"seed": 2**64}, 400, "seed"),
    ("seed string", C, {"seed": "7"}, 400, "seed"),
    ("stop_token_ids negative", C, {"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("stop_token_ids 2^64", C, {"stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ("stop_token_ids 2^31", C, {"stop_token_ids": [2**31]}, 400, "stop_token_ids"),
    ("stop_token_ids beyond vocab", C, {"stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ("stop_token_ids too many", C, {"stop_token_ids": [1] * (L.MAX_STOP_TOKEN_IDS + 1)}, 400, "stop_token_ids"),
    ("stop_token_ids not a list", C, {"stop_token_ids": 5}, 400, "stop_token_ids"),
    ("stop empty", C, {"stop": [""]}, 400, "stop"),
    ("stop too many", C, {"stop": ["a"] * (L.MAX_STOP_STRINGS + 1)}, 400, "stop"),
    ("stop number", C, {"stop": 5}, 400, "stop"),
    ("logprobs above 20", C, {"logprobs": 21}, 400, "logprobs"),
    ("logprobs negative", C, {"logprobs": -1}, 400, "logprobs"),
    ("best_of below n", C, {"best_of": 1, "n": 2}, 400, "best_of"),
    ("best_of zero", C, {"best_of": 0}, 400, "best_of"),
    ("echo with logprobs", C, {"echo": True, "logprobs": 1}, 400, "echo"),
    ("unknown parameter", C, {"frobnicate": 1}, 400, "frobnicate"),
    ("ignore_eos string", C, {"ignore_eos": "yes"}, 400, "ignore_eos"),
    ("stream string", C, {"stream": "yes"}, 400, "stream"),
    ("stream_options type", C, {"stream_options": {"include_usage": 1}}, 400, "stream_options"),
    ("cache_salt empty", C, {"cache_salt": ""}, 400, "cache_salt"),
    ("cache_salt too long", C, {"cache_salt": "s" * (L.MAX_CACHE_SALT_CHARS + 1)}, 400, "cache_salt"),
    ("prompt empty", C, {"prompt": ""}, 400, "prompt"),
    ("prompt empty list", C, {"prompt": []}, 400, "prompt"),
    ("prompt id 2^64", C, {"prompt": [2**64]}, 400, "prompt"),
    ("prompt id negative", C, {"prompt": [-1]}, 400, "prompt"),
    ("prompt id beyond vocab", C, {"prompt": [VOCAB]}, 400, "prompt"),
    ("prompt mixed list", C, {"prompt": [1, "a"]}, 400, "prompt"),
    ("prompt object", C, {"prompt": {"a": 1}}, 400, "prompt"),
    ("prompt too many", C, {"prompt": ["a"] * 65}, 400, "prompt"),
    ("prompt over max_model_len", C, {"prompt": "hello " * 3000}, 400, "prompt"),
    ("prompt over max chars", C, {"prompt": "a" * ((1 << 20) + 1)}, 400, "prompt"),
    ("prompt lone surrogate", C, '{"model": "smollm2-135m", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("fan-out prompts x n", C, {"prompt": ["a"] * 64, "n": 16}, 400, "n"),
    ("model number", C, {"model": 5}, 400, "model"),
    ("model lone surrogate", C, '{"model": "\\udfff", "prompt": "hi"}', 400, "model"),
    ("unknown model", C, {"model": "gpt-17"}, 404, "model"),
    ("deep nesting", C, '{"model": "smollm2-135m", "prompt": "hi", "x": ' + _nested(40) + "}", 400, "x"),
    ("nesting 100k deep", C, '{"model": "smollm2-135m", "prompt": "hi", "x": ' + _nested(100_000) + "}", 400, None),
    ("prompt nested", C, '{"model": "smollm2-135m", "prompt": ' + _nested(2000) + "}", 400, None),
    ("invalid json", C, "{not json", 400, None),
    ("body a list", C, "[1, 2]", 400, None),
    ("body invalid utf-8", C, '{"model": "\xff"}', 400, None),
    ("chat no messages", CHAT, {"messages": []}, 400, "messages"),
    ("chat bad role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("chat content number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (
        "chat content surrogate",
        CHAT,
        '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "messages",
    ),
    ("chat max_completion_tokens 0", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat top_logprobs above 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat n x 1 above cap", CHAT, {"messages": MSG, "n": 17}, 400, "n"),
    ("chat over max chars", CHAT, {"messages": [{"role": "user", "content": "a" * ((1 << 20) + 1)}]}, 400, "messages"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_naming_the_parameter(
    live: Live, name: str, path: str, body: dict[str, Any] | str, status: int, param: str | None
) -> None:
    if isinstance(body, dict):
        defaults = {"model": MODEL, "prompt": "hi"} if path == C else {"model": MODEL, "messages": MSG}
        content = json.dumps({**defaults, **body}).encode()
    else:
        content = body.encode("latin-1") if name == "body invalid utf-8" else body.encode()
    r = httpx.post(live.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == ("invalid_request_error" if status == 400 else err["type"])
    assert err["param"] == param, err


def test_bad_inputs_then_a_normal_request_is_served(live: Live) -> None:
    assert metric(live, "ucm_requests_total", status="500") == 0
    assert_served(live)


# ------------------------------------------------------------------ bodies


def test_oversized_bodies_get_413_and_health_answers_meanwhile(live: Live) -> None:
    # Content-Length says 10 MB: refused before a byte is parsed.
    r = httpx.post(live.url + C, content=b"x" * (10 << 20), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # Chunked (no Content-Length): the cap is hit while reading. The upload pauses past the cap until /health
    # has answered, so /health is served while a 10 MB body is being refused.
    past_cap, resume = threading.Event(), threading.Event()

    def body() -> Iterator[bytes]:
        chunk = b" " * (1 << 20)
        for i in range(10):
            if i == 6:
                past_cap.set()
                assert resume.wait(30), "the test never resumed the upload"
            yield chunk

    result: dict[str, Any] = {}
    upload = threading.Thread(
        target=lambda: result.setdefault(
            "r", httpx.post(live.url + C, content=body(), headers={"content-type": "application/json"}, timeout=60)
        )
    )
    upload.start()
    try:
        assert past_cap.wait(30)
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
        assert metric(live, "ucm_node_up", node=NODE) == 1
    finally:
        resume.set()
        upload.join(60)
    assert result["r"].status_code == 413, result["r"].text[:300]
    assert_served(live)
