"""The step token budget an engine picks for its host when none is given (engine/step_budget.py)."""

from __future__ import annotations

import pytest
import torch

from engine import step_budget
from engine.step_budget import FAST_BUDGET, SLOW_BUDGET, choose, layer_step, linear_flops_per_token
from tests.engine_helpers import make_llm


def test_linear_flops_are_two_per_weight_of_the_real_models_decoder_linears(smollm2_fp32):
    weights = sum(
        w.numel() for name, w in smollm2_fp32.model.named_parameters() if name.startswith("layers.") and w.dim() == 2
    )
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
