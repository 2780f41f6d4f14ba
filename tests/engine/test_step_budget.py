"""The step token budget an engine picks for its host when none is given (engine/step_budget.py)."""

from __future__ import annotations

import pytest

from engine import step_budget
from engine.step_budget import FAST_BUDGET, SLOW_BUDGET, choose, linear_flops_per_token
from tests.engine_helpers import make_llm
from ucm_kernels.cpu import calibration
from ucm_kernels.cpu.calibration import MATMUL_SHAPE


def test_linear_flops_are_two_per_weight_of_the_real_models_decoder_linears(smollm2_fp32):
    weights = sum(
        w.numel() for name, w in smollm2_fp32.model.named_parameters() if name.startswith("layers.") and w.dim() == 2
    )
    assert weights > 0, "the model's decoder layers hold 2-D linear weights (the norms' are 1-D)"
    assert linear_flops_per_token(smollm2_fp32.config) == 2 * weights


def test_fast_hosts_get_vllms_default_and_slow_ones_the_smaller_budget(smollm2_fp32):
    mc = smollm2_fp32.config
    at_limit = linear_flops_per_token(mc) * FAST_BUDGET / step_budget.FAST_STEP_S / 1e9  # GFLOP/s for exactly 1 s
    assert choose(mc, at_limit * 1.01).tokens == FAST_BUDGET
    assert choose(mc, at_limit * 0.99).tokens == SLOW_BUDGET
    assert choose(mc, None).tokens == FAST_BUDGET, "a GPU"
    with pytest.raises(ValueError, match="positive"):
        choose(mc, 0.0)


def forced_rate(monkeypatch, gflops: float) -> None:
    """The dtype calibration's matmul as if this host ran it at `gflops` in both dtypes."""
    t, k, n = MATMUL_SHAPE
    ms = 2 * t * k * n / (gflops * 1e9) * 1e3
    monkeypatch.setattr(calibration, "matmul_times", lambda root=None: {"bfloat16": ms, "float32": ms})


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
