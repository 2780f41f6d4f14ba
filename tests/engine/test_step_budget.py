"""The step token budget an engine picks for its host when none is given (engine/step_budget.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine import SamplingParams, step_budget
from engine.step_budget import (
    FAST_BUDGET,
    SLOW_BUDGET,
    LiveBudget,
    StepBudget,
    choose,
    layer_step,
    linear_flops_per_token,
)
from tests.engine_helpers import make_llm


def test_linear_flops_are_two_per_weight_of_the_real_models_decoder_linears(smollm2_fp32):
    from safetensors import safe_open

    with safe_open(str(smollm2_fp32.path / "model.safetensors"), framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118 (not iterable)
    weights = sum(math.prod(shape) for name, shape in shapes.items() if ".layers." in name and len(shape) == 2)
    assert weights > 0, "the model's decoder layers hold 2-D linear weights (the norms' are 1-D)"
    assert linear_flops_per_token(smollm2_fp32.config) == 2 * weights


def test_fast_hosts_get_vllms_default_and_slow_ones_the_smaller_budget(smollm2_fp32):
    mc = smollm2_fp32.config
    at_limit = linear_flops_per_token(mc) * FAST_BUDGET / step_budget.FAST_STEP_S / 1e9  # GFLOP/s: exactly FAST_STEP_S
    assert choose(mc, at_limit * 1.01).tokens == FAST_BUDGET
    assert choose(mc, at_limit * 0.99).tokens == SLOW_BUDGET
    assert choose(mc, None).tokens == FAST_BUDGET, "a GPU"
    with pytest.raises(ValueError, match="positive"):
        choose(mc, 0.0)


def test_the_rate_is_timed_on_the_served_models_layer_at_a_full_step(smollm2_fp32):
    """What the budget's rate is measured on: every matmul of one of this model's layers (its FLOPs are a layer's
    share of linear_flops_per_token) at FAST_BUDGET rows, through the engine's own path."""
    mc = smollm2_fp32.config
    run, flops = layer_step(mc, torch.float32, FAST_BUDGET)
    assert flops == linear_flops_per_token(mc) // mc.num_layers * FAST_BUDGET
    outs = run()
    assert isinstance(outs, list) and [o.shape for o in outs] == [
        (FAST_BUDGET, mc.q_size + 2 * mc.kv_size),
        (FAST_BUDGET, mc.hidden_size),
        (FAST_BUDGET, mc.intermediate_size),  # the gate_up call gives silu(gate) * up
        (FAST_BUDGET, mc.hidden_size),
    ]


def forced_rate(monkeypatch, gflops: float) -> None:
    """The step calibration as if this host ran the model's matmuls at `gflops`."""
    monkeypatch.setattr(step_budget, "step_matmul_gflops", lambda mc, dtype, root=None: gflops)


@pytest.mark.parametrize("gflops,want", [(5000.0, FAST_BUDGET), (50.0, SLOW_BUDGET)])
def test_an_engine_without_a_budget_schedules_with_the_hosts(monkeypatch, smollm2_fp32, gflops, want):
    forced_rate(monkeypatch, gflops)
    llm = make_llm(smollm2_fp32, max_num_batched_tokens=None)
    try:
        assert llm.engine.step_budget.tokens == want, llm.engine.step_budget.why
        assert llm.engine.scheduler.max_num_batched_tokens == want
    finally:
        llm.close()


def test_a_given_budget_is_kept(monkeypatch, smollm2_fp32):
    forced_rate(monkeypatch, 5000.0)
    llm = make_llm(smollm2_fp32, max_num_batched_tokens=96)
    try:
        assert llm.engine.scheduler.max_num_batched_tokens == 96
    finally:
        llm.close()


def test_the_live_budget_follows_the_median_of_the_last_long_steps():
    start = StepBudget(SLOW_BUDGET, "measured slow")
    live = LiveBudget(start)
    fast_s = step_budget.FAST_STEP_S / step_budget.HYSTERESIS / FAST_BUDGET * 0.9  # a token's seconds, clearly fast
    slow_s = step_budget.FAST_STEP_S * step_budget.HYSTERESIS / FAST_BUDGET * 1.1
    assert live.observe(step_budget.LONG_STEP_TOKENS - 1, 1e-6) is None, "a short step (decodes) is not counted"
    for _ in range(step_budget.LIVE_STEPS - 1):
        assert live.observe(1024, 1024 * fast_s) is None, "no decision before LIVE_STEPS long steps"
    assert live.observe(1024, 1024 * fast_s) == live.budget and live.budget.tokens == FAST_BUDGET
    assert "predicts a 2048-token step" in live.budget.why
    assert live.observe(1024, 1024 * slow_s) is None, "one slow step of three: the median is still fast"
    assert live.observe(2048, 2048 * slow_s).tokens == SLOW_BUDGET, "two of three slow"
    fresh = LiveBudget(StepBudget(FAST_BUDGET, "measured fast"))
    assert fresh.observe(512, 512 * slow_s * 10) is None, "one slow first step alone decides nothing"
    assert fresh.observe(512, 512 * fast_s) is None and fresh.observe(512, 512 * fast_s) is None
    assert fresh.budget.tokens == FAST_BUDGET, "the median of the three is fast"
    inside = step_budget.FAST_STEP_S / FAST_BUDGET  # exactly FAST_STEP_S: within the hysteresis either way
    live = LiveBudget(start)
    for _ in range(5):
        assert live.observe(1024, 1024 * inside) is None
    with pytest.raises(AssertionError, match="not an auto budget"):
        LiveBudget(StepBudget(96, "given"))


class StepClock:
    """The live budget's clock: each step (two reads) lasts `step_s`."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.reads = step_s, 0

    def __call__(self) -> float:
        self.reads += 1
        return (self.reads // 2) * self.step_s


# Enough prompt tokens for LIVE_STEPS steps of the larger budget and a full step of the other after them.
LONG_PROMPTS = [[random.Random(i).randrange(100, 40000) for _ in range(1500)] for i in range(6)]
GREEDY4 = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fixed_budget_tokens(smollm2_fp32) -> list[list[int]]:
    """LONG_PROMPTS' greedy tokens in steps of a fixed budget."""
    fixed = make_llm(smollm2_fp32, max_num_batched_tokens=SLOW_BUDGET, kv_cache_memory="256MiB")
    try:
        outs = fixed.generate([{"prompt_token_ids": p} for p in LONG_PROMPTS], GREEDY4, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        fixed.close()


@pytest.mark.parametrize(
    "gflops,step_s,first,then",
    [(50.0, 0.05, SLOW_BUDGET, FAST_BUDGET), (5000.0, 60.0, FAST_BUDGET, SLOW_BUDGET)],
    ids=["calibrated-slow-runs-fast", "calibrated-fast-runs-slow"],
)
def test_an_engine_changes_its_auto_budget_by_its_steps_and_keeps_its_outputs(
    monkeypatch, smollm2_fp32, fixed_budget_tokens, gflops, step_s, first, then
):
    forced_rate(monkeypatch, gflops)
    llm = make_llm(smollm2_fp32, max_num_batched_tokens=None, kv_cache_memory="256MiB")
    try:
        engine = llm.engine
        assert engine.live_budget is not None and engine.step_budget.tokens == first
        engine.live_budget.clock = StepClock(step_s)
        for i, p in enumerate(LONG_PROMPTS):
            engine.add_request(f"r{i}", p, GREEDY4)
        scheduled = []
        real_execute = engine.runner.execute
        monkeypatch.setattr(engine.runner, "execute", lambda s: scheduled.append(s.total_num_scheduled_tokens) or
                            real_execute(s))  # fmt: skip
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        assert engine.step_budget.tokens == then and engine.scheduler.max_num_batched_tokens == then
        assert "predicts a 2048-token step" in engine.step_budget.why
        live = step_budget.LIVE_STEPS
        assert scheduled[0] == min(first, 1500) and max(scheduled[:live]) <= first, (
            f"no change before {live} steps: {scheduled}"
        )
        assert max(scheduled[live:]) <= then, scheduled
        at_fast = scheduled[:live] if first == FAST_BUDGET else scheduled[live:]
        assert max(at_fast) > SLOW_BUDGET, f"steps only the larger budget allows: {scheduled}"
        assert [got[f"r{i}"] for i in range(len(LONG_PROMPTS))] == fixed_budget_tokens, (
            "the steps' sizes changed, the greedy tokens did not"
        )
    finally:
        llm.close()


def test_no_live_budget_where_the_budget_is_given_or_a_prompt_must_fit_one_step(monkeypatch, smollm2_fp32):
    forced_rate(monkeypatch, 5000.0)
    for kw in ({"max_num_batched_tokens": 96}, {"max_num_batched_tokens": None, "enable_chunked_prefill": False}):
        llm = make_llm(smollm2_fp32, **kw)
        try:
            assert llm.engine.live_budget is None, kw
        finally:
            llm.close()
