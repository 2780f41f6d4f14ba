"""Engine behaviour on the real embedded model (fp32): prefix caching counters, preemption, seeded sampling,
stop strings, n > 1 with copy-on-write, logprobs, abort, validation."""

from __future__ import annotations

import pytest
import torch

from engine import EngineCore, SamplingParams
from engine.final_states import FinalStates
from tests.engine_helpers import PROMPTS, make_llm, single_thread

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG_PREFIX = (
    "You are a helpful assistant. Answer every question in one short sentence, politely and precisely, "
    "and never make things up. If you do not know, say so. Here is some background about the solar system: "
    "the Sun is a star, and eight planets orbit it, from Mercury to Neptune. "
)


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def llm(smollm2_fp32):
    return make_llm(smollm2_fp32)


@pytest.fixture(autouse=True)
def _integrity(llm):
    yield
    llm.engine.check_integrity()


def test_shared_prefix_computes_only_new_tokens(llm, smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    first = tok.encode(LONG_PREFIX + "Which planet is closest to the Sun?")
    second = tok.encode(LONG_PREFIX + "How many planets are there?")
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert common > 48
    llm.generate(first, GREEDY, use_tqdm=False)
    before = llm.engine.stats()
    (out,) = llm.generate(second, GREEDY, use_tqdm=False)
    after = llm.engine.stats()
    expected_hit = (common // 16) * 16
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == expected_hit
    assert after.computed_tokens - before.computed_tokens == len(second) - expected_hit
    assert out.num_cached_tokens == expected_hit
    cold = make_llm(smollm2_fp32, enable_prefix_caching=False)
    (ref,) = cold.generate(second, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert cold.engine.stats().prefix_cache_hit_tokens == 0
    cold.engine.check_integrity()


def test_block_aligned_repeat_computes_only_its_last_token_into_a_copy(llm, smollm2_fp32):
    """Every block of a block-aligned prompt hits: only its last token is computed, written into a copy of the
    last block, so the cached block keeps its bytes and the output is the uncached one."""
    ids = smollm2_fp32.tokenizer.encode(LONG_PREFIX + "Name the largest planet.")
    ids = ids[: len(ids) // 16 * 16]
    assert len(ids) >= 48
    (first,) = llm.generate([ids], GREEDY, use_tqdm=False)
    kv = llm.engine.kv_manager
    (last,) = [b for b in kv.pool._cached.values() if b.token_ids == tuple(ids[-16:])]
    k_cache = llm.engine.kv_caches[0][0]
    before_bytes = k_cache[last.block_id].clone()
    llm.engine.runner.final_states = (
        FinalStates()
    )  # so the last token is recomputed (tests/engine/test_final_states.py)
    before = llm.engine.stats()
    (again,) = llm.generate([ids], GREEDY, use_tqdm=False)
    after = llm.engine.stats()
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == len(ids) - 1
    assert after.computed_tokens - before.computed_tokens == 1
    assert again.num_cached_tokens == len(ids) - 1
    assert torch.equal(k_cache[last.block_id], before_bytes), "the cached block was written"
    assert kv.pool._cached[last.key] is last, "the copy replaced the cached block"
    cold = make_llm(smollm2_fp32, enable_prefix_caching=False)
    (ref,) = cold.generate([ids], GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == ref.outputs[0].token_ids


def test_tiny_kv_budget_preempts_and_outputs_stay_identical(llm, smollm2_fp32):
    prompts = PROMPTS[:6]
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)] * 3
    ref = llm.generate(prompts, params, use_tqdm=False)
    # 720 KiB per fp32 block: 10 blocks = 160 tokens for six sequences of ~10-25 + 16 tokens.
    tiny = make_llm(smollm2_fp32, kv_cache_memory=10 * 737280, max_num_batched_tokens=64)
    outs = tiny.generate(prompts, params, use_tqdm=False)
    assert tiny.engine.stats().preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == tiny.engine.stats().preemptions  # each counted once
    for a, b in zip(outs, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    tiny.engine.check_integrity()
    assert tiny.engine.kv_manager.pool.num_free_blocks == tiny.engine.kv_manager.num_blocks


def test_seeded_sampling_reproducible_alone_and_batched(llm):
    p = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.02, seed=1234, max_tokens=16, ignore_eos=True)
    (a,) = llm.generate(PROMPTS[2], p, use_tqdm=False)
    (b,) = llm.generate(PROMPTS[2], p, use_tqdm=False)
    batch = llm.generate(PROMPTS[:4], [GREEDY, SamplingParams(temperature=1.0, seed=5), p, GREEDY], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == batch[2].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.02, seed=99, max_tokens=16, ignore_eos=True)
    (c,) = llm.generate(PROMPTS[2], other, use_tqdm=False)
    assert c.outputs[0].token_ids != a.outputs[0].token_ids


def test_stop_string_excluded_and_finishes(llm):
    (full,) = llm.generate(PROMPTS[4], GREEDY, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    (out,) = llm.generate(PROMPTS[4], p, use_tqdm=False)
    assert out.outputs[0].text == text[: text.find(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.outputs[0].token_ids) < 16


def test_stop_token_ids(llm):
    (full,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    ids = full.outputs[0].token_ids
    p = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ids[3]])
    (out,) = llm.generate(PROMPTS[0], p, use_tqdm=False)
    first = ids.index(ids[3])
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ids[3]


def test_n_samples_share_prompt_blocks(smollm2_fp32):
    core = EngineCore(make_llm(smollm2_fp32).config, loaded_model=smollm2_fp32)
    prompt = smollm2_fp32.tokenizer.encode(PROMPTS[2])
    assert len(prompt) % 16
    core.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))
    done: dict[int, list[int]] = {}

    def collect(outs):
        for out in outs:
            for c in out.outputs:
                done.setdefault(c.index, []).extend(c.token_ids)

    collect(core.step())  # prefill + fork
    tables = [core.kv_manager.block_ids(rid) for rid in ("r", "r#1", "r#2")]
    assert tables[0] == tables[1] == tables[2]
    collect(core.step())  # first write into the shared partial block: copy-on-write
    tables = [core.kv_manager.block_ids(rid) for rid in ("r", "r#1", "r#2")]
    full = len(prompt) // 16
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert len({t[full] for t in tables}) == 3
    while core.has_unfinished_requests():
        collect(core.step())
    assert sorted(done) == [0, 1, 2] and all(len(v) == 6 for v in done.values())
    assert len({tuple(v) for v in done.values()}) > 1
    core.check_integrity()


def test_n_via_llm(llm):
    (out,) = llm.generate(PROMPTS[3], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)


def test_request_metrics_follow_each_request(smollm2_fp32):
    """RequestOutput.metrics (vLLM's RequestStateStats): one running sequence at a time, so the second request is
    scheduled only after the first has made its last token; token counts cover every sample."""
    one = make_llm(smollm2_fp32, max_num_seqs=1)
    first, second = one.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    (pair,) = one.generate(PROMPTS[2], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=5), use_tqdm=False)
    for out in (first, second, pair):
        m = out.metrics
        assert m is not None and m.num_preemptions == 0
        assert m.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs) > 0
        assert m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
        assert m.first_token_latency > 0
    assert second.metrics.scheduled_ts >= first.metrics.last_token_ts
    assert second.metrics.first_token_latency > first.metrics.first_token_latency  # it waited its turn
    assert first.metrics.arrival_time <= second.metrics.arrival_time


def test_logprobs_match_log_softmax(llm, smollm2_fp32, hf_smollm2_fp32):
    p = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    (out,) = llm.generate(PROMPTS[0], p, use_tqdm=False)
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        logits = hf_smollm2_fp32(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    assert len(comp.logprobs) == 4
    for t, (tok, pos) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[len(out.prompt_token_ids) - 1 + t]
        assert next(iter(pos)) == tok and pos[tok].rank == 1
        top = sorted(pos.items(), key=lambda kv: kv[1].rank)
        assert [lp.rank for _, lp in top] == [1, 2, 3, 4, 5]
        vals = [lp.logprob for _, lp in top]
        assert vals == sorted(vals, reverse=True)
        assert [tid for tid, _ in top] == row.topk(5).indices.tolist()
        for tid, lp in pos.items():
            assert abs(lp.logprob - float(row[tid])) < 2e-3


def test_abort_frees_blocks(smollm2_fp32):
    core = EngineCore(make_llm(smollm2_fp32).config, loaded_model=smollm2_fp32)
    tok = smollm2_fp32.tokenizer
    core.add_request("a", tok.encode(PROMPTS[2]), SamplingParams(max_tokens=50, ignore_eos=True))
    core.add_request("b", tok.encode(PROMPTS[3]), SamplingParams(max_tokens=3, ignore_eos=True))
    core.step()
    core.step()
    assert core.kv_manager.block_ids("a")
    core.abort_request(["a"])
    assert not core.kv_manager.block_ids("a")
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert [o for o in outs if o.request_id == "b"][-1].finished
    pool = core.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    core.check_integrity()


def test_validation_errors(llm, smollm2_fp32):
    short = make_llm(smollm2_fp32, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        short.generate(list(range(100, 140)), GREEDY, use_tqdm=False)
    assert not short.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="KV cache"):
        tiny = make_llm(smollm2_fp32, kv_cache_memory=2 * 737280, max_model_len=64)
        tiny.engine.scheduler.max_model_len = 64  # bypass the clamp to reach the KV-size check
        tiny.generate(list(range(100, 140)), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([llm.engine.model_config.vocab_size + 5], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="memory size"):
        make_llm(smollm2_fp32, kv_cache_memory="lots")


def test_chat(llm):
    (out,) = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=8))
    assert out.outputs[0].token_ids and isinstance(out.outputs[0].text, str)
