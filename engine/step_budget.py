"""The step token budget when none is given (`--max-num-batched-tokens` unset): chosen per host from a measurement.

Every prompt that finishes its prefill in a step gets its first token at the step's end, so the budget trades first
tokens sooner (small steps) against fewer, fuller matmuls and fewer chunk boundaries (large ones), and where it
lands depends on how fast the host computes a step:
- on the 2-core AVX2 EPYC (Zen 3, fp32), where 2048 tokens of the embedded model take ~4.5 s, 1024 against 2048
  gave prefix_repetition (4 x 1024 + 128, 32 at once) a 15-20% lower mean TTFT in process, and 32 x 512/64 at
  once a ~7% shorter wall time;
- on a 2-core Intel Xeon with AMX (bf16), where they take ~0.6 s, `ucm-serve up` with 2048 against 1024 served a
  cold 2048-token prompt in 0.62 s against 0.86-0.90, prefix_repetition in 2.59 s against 2.79-3.02 mean TTFT and
  random 512/64 at 139 against 132-134 tok/s (docs/history/benchmarks.json: the AMX host's "First runs").
So: vLLM's own CPU default (`FAST_BUDGET`, 2048) where a step of that many tokens is predicted to take at most
`FAST_STEP_S`, else `SLOW_BUDGET`. The prediction is the model's linear layers (2 flops per weight and token) at the
rate of the dtype calibration's matmul (ucm_kernels/cpu/calibration.py, measured once per CPU and cached), which is
what dominates a long step; attention adds a share that grows with the context. CUDA takes `FAST_BUDGET`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig

FAST_BUDGET = 2048  # vLLM's CPU default for its OpenAI server
SLOW_BUDGET = 1024
FAST_STEP_S = 1.0  # ... where a FAST_BUDGET step's matmuls take at most this long


@dataclass(frozen=True)
class StepBudget:
    tokens: int
    why: str


def linear_flops_per_token(mc: ModelConfig) -> int:
    """2 flops per weight of the decoder layers' linear layers (q, k, v, o, gate, up, down); the lm_head runs on
    the generated rows only."""
    attn = (
        mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
        + mc.num_heads * mc.head_dim * mc.hidden_size
    )
    mlp = 3 * mc.hidden_size * mc.intermediate_size
    return 2 * mc.num_layers * (attn + mlp)


def choose(mc: ModelConfig, matmul_gflops: float | None) -> StepBudget:
    """The budget for a host whose matmuls run at `matmul_gflops` in the engine's dtype (None: a GPU)."""
    if matmul_gflops is None:
        return StepBudget(FAST_BUDGET, "a GPU: vLLM's CPU default")
    if matmul_gflops <= 0:
        raise ValueError(f"matmul_gflops must be positive, got {matmul_gflops}")
    step_s = linear_flops_per_token(mc) * FAST_BUDGET / (matmul_gflops * 1e9)
    tokens = FAST_BUDGET if step_s <= FAST_STEP_S else SLOW_BUDGET
    return StepBudget(
        tokens,
        f"a {FAST_BUDGET}-token step's matmuls predicted at {step_s:.2f} s ({matmul_gflops:.0f} GFLOP/s measured), "
        f"{'within' if tokens == FAST_BUDGET else 'over'} {FAST_STEP_S:.1f} s",
    )


def auto_budget(mc: ModelConfig, dtype_name: str, device: str) -> StepBudget:
    """`choose` on this host: the CPU's rate from the dtype calibration's cached matmul timing."""
    if device != "cpu":
        return choose(mc, None)
    from ucm_kernels.cpu.calibration import MATMUL_SHAPE, matmul_times

    t, k, n = MATMUL_SHAPE
    ms = matmul_times()["bfloat16" if dtype_name == "bfloat16" else "float32"]
    return choose(mc, 2 * t * k * n / (ms * 1e-3) / 1e9)
