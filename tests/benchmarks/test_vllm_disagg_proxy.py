"""benchmarks/vllm_disagg_proxy.py, vLLM's toy P/D proxy as our baseline: what it sends each side."""

from __future__ import annotations

import pytest

from benchmarks.vllm_disagg_proxy import PREFILL_KV_PARAMS, build_app, decode_body, prefill_body


def test_prefill_is_one_token_not_streamed_and_asks_for_a_remote_decode() -> None:
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 8,
        "temperature": 0,
    }
    sent = prefill_body(body)
    assert sent == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": PREFILL_KV_PARAMS,
    }
    assert body["max_tokens"] == 64 and body["stream"] is True  # the client's request is left as it was


def test_decode_gets_the_client_request_with_the_prefill_reply_transfer_params() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True}
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1, 2]], "remote_port": 5}
    assert decode_body(body, {"choices": [], "kv_transfer_params": params}) == {**body, "kv_transfer_params": params}
    assert decode_body(body, {"choices": []}) == body  # a connector that returns none (ExampleConnector)


def test_needs_both_sides() -> None:
    with pytest.raises(ValueError):
        build_app([], ["http://127.0.0.1:1"])
