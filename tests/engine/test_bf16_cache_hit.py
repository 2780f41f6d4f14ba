"""The cache-hit oracle in bf16 (the serving dtype `auto` picks on CPUs with native bf16): a prompt continued after
a prefix-cache hit gives the cold run's greedy tokens. Only the last few prompt tokens are computed after the hit,
so the attention kernels must give a row the same bits in a short chunk as inside a whole prompt, and the matmuls
must give a row the same bits whatever else its step holds (engine/generated_rows.py)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from kernels.cpu.amx_gemm import engine_bf16_rows_invariant


@pytest.mark.xfail(
    not engine_bf16_rows_invariant(),
    reason="this CPU's bf16 matmul (oneDNN on AMX) gives a row other bits in calls of other sizes, and the native "
    "library here has no AMX kernel to stand in (kernels/cpu/amx_gemm.py)",
    strict=True,
)
def test_a_prefix_hit_continues_like_the_cold_run_in_bf16() -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 40000) for _ in range(500)] for _ in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cold_llm = LLM(model="smollm2-135m", dtype="bfloat16", enable_prefix_caching=False)
    cold = [o.outputs[0].token_ids for o in cold_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    cold_llm.close()
    warm_llm = LLM(model="smollm2-135m", dtype="bfloat16")
    warm_llm.generate([{"prompt_token_ids": p[:496]} for p in prompts], SamplingParams(max_tokens=1))  # 31 blocks
    outs = warm_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    warm_llm.close()
    assert all(o.num_cached_tokens == 496 for o in outs), [o.num_cached_tokens for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == cold


@pytest.mark.xfail(
    not engine_bf16_rows_invariant(),
    reason="this CPU's bf16 matmul (oneDNN on AMX) gives a row other bits in calls of other sizes, and the native "
    "library here has no AMX kernel to stand in (kernels/cpu/amx_gemm.py)",
    strict=True,
)
def test_a_whole_block_aligned_hit_computes_one_row_like_the_cold_run_in_bf16() -> None:
    """Every block of the prompt hits: only its last token goes through the model, alone in its step."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(4)]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cold_llm = LLM(model="smollm2-135m", dtype="bfloat16", enable_prefix_caching=False)
    cold = [o.outputs[0].token_ids for o in cold_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    cold_llm.close()
    warm_llm = LLM(model="smollm2-135m", dtype="bfloat16")
    warm_llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1))
    before = warm_llm.engine.stats().computed_tokens
    outs = [warm_llm.generate([{"prompt_token_ids": p}], greedy)[0] for p in prompts]
    computed = warm_llm.engine.stats().computed_tokens - before
    warm_llm.close()
    assert all(o.num_cached_tokens == 511 for o in outs), [o.num_cached_tokens for o in outs]
    assert computed == len(prompts), computed  # prompt tokens computed: one each
    assert [o.outputs[0].token_ids for o in outs] == cold
