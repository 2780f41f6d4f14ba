"""The shared job bounds (protocol/job_limits.py), the hostile-JSON parser (router/json_body.py) and the wire's
job-header fallback, in process: the edges of every bound, on both sides of it."""

from __future__ import annotations

import msgspec
import pytest

from protocol import job_limits as L
from protocol import messages as P
from router.json_body import MAX_DEPTH, HugeInt, parse_json_object
from router.openai_schema import ApiError, CompletionRequest

OK = P.SamplingSpec(max_tokens=8)

EDGES = [  # (field, largest or smallest accepted value, first refused value)
    ("max_tokens", L.MAX_TOKENS, L.MAX_TOKENS + 1),
    ("max_tokens", 1, 0),
    ("temperature", L.MAX_TEMPERATURE, L.MAX_TEMPERATURE + 1e-9),
    ("temperature", 0.0, -1e-9),
    ("top_p", 1.0, 1.0 + 1e-9),
    ("top_p", 1e-9, 0.0),
    ("top_k", L.MAX_TOP_K, L.MAX_TOP_K + 1),
    ("top_k", -1, -2),
    ("seed", L.INT64_MAX, L.INT64_MAX + 1),
    ("seed", L.INT64_MIN, L.INT64_MIN - 1),
    ("logprobs", L.MAX_LOGPROBS, L.MAX_LOGPROBS + 1),
    ("logprobs", 0, -1),
    ("stop_token_ids", [L.MAX_TOKEN_ID], [L.MAX_TOKEN_ID + 1]),
    ("stop_token_ids", [0] * L.MAX_STOP_TOKEN_IDS, [0] * (L.MAX_STOP_TOKEN_IDS + 1)),
]


@pytest.mark.parametrize("field,accepted,refused", EDGES, ids=[f"{e[0]}={e[2]!r:.20}" for e in EDGES])
def test_spec_bounds_edges(field: str, accepted: object, refused: object) -> None:
    L.check_spec(msgspec.structs.replace(OK, **{field: accepted}))
    with pytest.raises(L.OutOfBounds) as e:
        L.check_spec(msgspec.structs.replace(OK, **{field: refused}))
    assert e.value.param == field


@pytest.mark.parametrize("value", [float("nan"), float("inf"), True, "1"])
def test_spec_refuses_non_finite_and_wrong_types(value: object) -> None:
    with pytest.raises(L.OutOfBounds):
        L.check_spec(msgspec.structs.replace(OK, temperature=value))


def test_schema_bounds_are_the_wire_bounds() -> None:
    """The largest values the HTTP schema accepts are ones the nodes accept (one source for both)."""
    body = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": [L.MAX_TOKEN_ID],
            "max_tokens": L.MAX_TOKENS,
            "temperature": L.MAX_TEMPERATURE,
            "top_k": L.MAX_TOP_K,
            "seed": L.INT64_MAX,
            "stop_token_ids": [L.MAX_TOKEN_ID] * L.MAX_STOP_TOKEN_IDS,
            "logprobs": L.MAX_LOGPROBS,
            "n": L.MAX_N,
            "cache_salt": "s" * L.MAX_CACHE_SALT_CHARS,
        }
    )
    spec = P.SamplingSpec(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        seed=body.seed,
        stop_token_ids=body.stop_token_ids,
        logprobs=body.logprobs,
    )
    L.check_job(P.DecodeJob("r", body.prompts[0], spec, cache_salt=body.cache_salt))  # type: ignore[arg-type]


def test_job_checks_token_ids_against_the_vocabulary() -> None:
    L.check_job(P.PrefillJob("r", [0, 99], OK), vocab_size=100)
    for job in (
        P.PrefillJob("r", [100], OK),
        P.PrefillJob("r", [], OK),
        P.PrefillJob("", [1], OK),
        P.DecodeJob("r", [1], OK, first_token_id=100),
        P.PrefillJob("r", [1], msgspec.structs.replace(OK, stop_token_ids=[100])),
    ):
        with pytest.raises(L.OutOfBounds):
            L.check_job(job, vocab_size=100)


def test_json_body_refusals() -> None:
    assert parse_json_object(b'{"a": [1, "x", {"b": null}]}') == {"a": [1, "x", {"b": None}]}
    assert isinstance(parse_json_object(b'{"a": ' + b"9" * 21 + b"}")["a"], HugeInt)
    assert parse_json_object(b'{"a": ' + b"9" * 20 + b"}")["a"] == int("9" * 20)
    cases = {
        b'{"a": NaN}': None,
        b"[1]": None,
        b"\xff": None,
        b'{"a": "\\ud800"}': "a",
        b'{"\\udc00": 1}': None,
        b'{"a": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}": "a",
        b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}": None,
    }
    for raw, param in cases.items():
        with pytest.raises(ApiError) as e:
            parse_json_object(raw)
        assert e.value.status == 400 and e.value.param == param, raw[:40]


def test_job_request_id_of_an_undecodable_job() -> None:
    bad = msgspec.msgpack.encode({"type": "decode_job", "request_id": "r1", "prompt_token_ids": "x", "params": 5})
    with pytest.raises(ValueError):
        P.decode(bad)
    assert P.job_request_id(bad) == "r1"
    assert P.job_request_id(msgspec.msgpack.encode({"type": "abort", "request_id": "r1"})) is None
    assert P.job_request_id(b"\x91" * 100_000 + b"\xc0") is None
    assert P.job_request_id(b"\xc1") is None
