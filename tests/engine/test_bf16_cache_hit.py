"""The cache-hit oracle in bf16 (the serving dtype `auto` picks on CPUs with native bf16): a prompt continued after
a prefix-cache hit gives the cold run's greedy tokens. Only the last few prompt tokens are computed after the hit,
so the attention kernels must give a row the same bits in a short chunk as inside a whole prompt, and the matmuls
must give a row the same bits whatever else its step holds (engine/generated_rows.py)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.final_states import FinalStates
from ucm_kernels.cpu.amx_gemm import engine_bf16_rows_invariant


@pytest.mark.xfail(
    not engine_bf16_rows_invariant(),
    reason="this CPU's bf16 matmul (oneDNN on AMX) gives a row other bits in calls of other sizes, and the native "
    "library here has no AMX kernel to stand in (ucm_kernels/cpu/amx_gemm.py)",
    strict=True,
)
@pytest.mark.parametrize(
    ("length", "warm", "cached"),
    [(500, 496, 496), (512, 512, 511)],  # 31 blocks hit, 4 tokens computed; every block hit, the last token computed
)
def test_a_prefix_hit_continues_like_the_cold_run_in_bf16(length: int, warm: int, cached: int) -> None:
    rng = random.Random(length)
    prompts = [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cold_llm = LLM(model="smollm2-135m", dtype="bfloat16", enable_prefix_caching=False)
    cold = [o.outputs[0].token_ids for o in cold_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    cold_llm.close()
    warm_llm = LLM(model="smollm2-135m", dtype="bfloat16")
    warm_llm.generate([{"prompt_token_ids": p[:warm]} for p in prompts], SamplingParams(max_tokens=1))
    warm_llm.engine.runner.final_states = FinalStates()  # a whole hit recomputes its last token (what this tests)
    before = warm_llm.engine.stats().computed_tokens
    outs = warm_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    computed = warm_llm.engine.stats().computed_tokens - before  # prompt tokens
    warm_llm.close()
    assert all(o.num_cached_tokens == cached for o in outs), [o.num_cached_tokens for o in outs]
    assert computed == len(prompts) * (length - cached), computed
    assert [o.outputs[0].token_ids for o in outs] == cold


@pytest.mark.xfail(
    not engine_bf16_rows_invariant(),
    reason="this CPU's bf16 matmul (oneDNN on AMX) gives a row other bits in calls of other sizes, and the native "
    "library here has no AMX kernel to stand in (ucm_kernels/cpu/amx_gemm.py)",
    strict=True,
)
def test_decodes_sharing_prefix_blocks_give_the_tokens_each_gets_alone_in_bf16() -> None:
    """Requests behind one prompt prefix decode over the same cache blocks, so the attention kernel runs them as one
    item (ucm_kernels/cpu/paged_attention_shared.h); each must still continue as it does with blocks of its own."""
    rng = random.Random(5)
    prefix = [rng.randrange(1000, 40000) for _ in range(320)]  # 20 blocks: 5 whole 64-key chunks
    prompts = [prefix + [rng.randrange(1000, 40000) for _ in range(20)] for _ in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    own_llm = LLM(model="smollm2-135m", dtype="bfloat16", enable_prefix_caching=False)
    own = [o.outputs[0].token_ids for o in own_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    own_llm.close()
    shared_llm = LLM(model="smollm2-135m", dtype="bfloat16")
    outs = shared_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    shared_llm.close()
    assert sorted(o.num_cached_tokens for o in outs)[1:] == [320] * 5, "the others reuse the first one's blocks"
    assert [o.outputs[0].token_ids for o in outs] == own
