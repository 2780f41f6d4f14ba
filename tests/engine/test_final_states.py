"""engine/final_states.py: a block-aligned prompt found whole in the prefix cache samples its first token from the
final state its first computation kept, without a forward, and gets exactly the tokens and logprobs it got cold and
gets when its last token is recomputed."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.final_states import FinalStates
from tests.engine_helpers import fp32_logprob_tol, make_llm

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _count_forwards(model) -> list[int]:
    """Rows per call of model.forward, recorded as the model runs."""
    calls: list[int] = []
    forward = model.forward

    def spy(input_ids, *args, **kwargs):
        calls.append(len(input_ids))
        return forward(input_ids, *args, **kwargs)

    model.forward = spy
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_whole_hit_samples_from_the_kept_state_with_no_forward(dtype, smollm2_fp32) -> None:
    prompt = _prompt(1, 64)  # 4 full blocks of 16
    llm = LLM(model="smollm2-135m", dtype=dtype, kv_cache_memory="64MiB") if dtype == "bfloat16" else None
    llm = llm or make_llm(smollm2_fp32)
    runner = llm.engine.runner
    calls = _count_forwards(runner.model)
    try:
        cold = _run(llm, [prompt])
        assert len(runner.final_states) == 1, "the prompt's last state was kept"
        forwards = len(calls)
        hit = _run(llm, [prompt])
        assert runner.final_states.hits == 1
        assert len(calls) - forwards == PARAMS.max_tokens - 1, (
            "the first token came without a forward, the rest decoded"
        )
        runner.final_states = FinalStates()  # forgotten: the whole hit recomputes its last token, one row
        forwards = len(calls)
        recomputed = _run(llm, [prompt])
        assert calls[forwards] == 1, "a whole hit without a kept state computes its last token"
    finally:
        llm.close()
    assert hit == cold, "the kept state is the cold run's own: tokens and logprobs bit for bit"
    assert [t for t, _ in recomputed] == [t for t, _ in cold]
    if dtype == "bfloat16":  # its rows are split-invariant (the cache-hit oracle); fp32 prompt rows here are not
        assert recomputed == cold


def test_only_whole_block_aligned_hits_alone_in_a_step_skip_the_forward(smollm2_fp32) -> None:
    # The ragged prompt longer, so the scheduler (fewest tokens first) puts the aligned one's row first in the step.
    aligned, ragged, other = _prompt(2, 48), _prompt(3, 56), _prompt(4, 48)
    llm = make_llm(smollm2_fp32)
    runner = llm.engine.runner
    calls = _count_forwards(runner.model)
    try:
        cold = _run(llm, [aligned, ragged])
        assert calls[0] == 104, "both prompts in one step"
        assert len(runner.final_states) == 1, "a prompt that ends inside a block has no state to keep"
        again = _run(llm, [ragged])
        assert runner.final_states.hits == 0, "its last block is not cached: it computes its tail"
        mixed = _run(llm, [aligned, other])  # the hit shares its step with a prompt that needs the forward
        assert runner.final_states.hits == 0
        alone = _run(llm, [aligned])
        assert runner.final_states.hits == 1
    finally:
        llm.close()
    # fp32 rows are not batch-invariant on every host (a prompt's recomputed tail, a decode row in a step of 1 or 2
    # rows, where oneDNN takes some row counts): those keep the tokens. The first token's logprobs come from the state.
    assert [t for t, _ in again] == [cold[1][0]] and mixed[0][0] == cold[0][0]
    assert alone[0][0] == cold[0][0]
    # The first token's logprobs come from the first run's state, not the mixed step's recomputation: the same state,
    # but cold took its logits in a step of 2 sampled rows and the hit in a step of 1, and fp32 matmuls are not
    # row-count invariant on every host (bit for bit on the Zen 5; 2e-6 apart on a Xeon with AMX, where oneDNN and
    # MKL pick other kernels for one row, as a new user's CI found). Bits are promised where rows are row-count
    # invariant (bf16: test_a_whole_hit_samples_from_the_kept_state_with_no_forward); fp32 within the lm_head's
    # rounding bound (engine_helpers.fp32_logprob_tol). That the state was used, not recomputed: final_states.hits.
    (first_alone,), (first_cold,) = alone[0][1][:1], cold[0][1][:1]
    assert first_alone.keys() == first_cold.keys()
    tol = fp32_logprob_tol(smollm2_fp32)
    for token, logprob in first_alone.items():
        assert logprob.logprob == pytest.approx(first_cold[token].logprob, abs=tol)


def test_states_are_kept_least_recently_used_first_out() -> None:
    states = FinalStates(capacity=2)
    a, b, c = (torch.full((4,), float(i)) for i in range(3))
    states.put(b"a", a)
    states.put(b"b", b)
    assert states.get(b"a") is not None  # a is now the most recent
    states.put(b"c", c)
    assert states.get(b"b") is None and len(states) == 2
    states.put(b"c", a)
    assert torch.equal(states.get(b"c"), c), "the first state put for a key stays"
    kept = states.get(b"a")
    a.fill_(9.0)  # the caller's tensor changing later does not change what was kept
    assert kept is not None and torch.equal(kept, torch.zeros(4))
