"""The step token budget when none is given (`--max-num-batched-tokens` unset): chosen per host from a measurement.

Every prompt that finishes its prefill in a step gets its first token at the step's end, so the budget trades first
tokens sooner (small steps) against fewer, fuller matmuls and fewer chunk boundaries (large ones), and where it
lands depends on how fast the host computes a step:
- on the 2-core AVX2 EPYC (Zen 3, fp32), where 2048 tokens of the embedded model take ~4.5 s, 1024 against 2048
  gave prefix_repetition (4 x 1024 + 128, 32 at once) a 15-20% lower mean TTFT in process, and 32 x 512/64 at
  once a ~7% shorter wall time;
- on a 2-core Intel Xeon with AMX (bf16), where they take ~0.6 s, `ucm-serve up` with 2048 against 1024 served a
  cold 2048-token prompt in 0.62 s against 0.86-0.90, prefix_repetition in 2.59 s against 2.79-3.02 mean TTFT and
  random 512/64 at 139 against 132-134 tok/s (docs/history/benchmarks.json: the AMX host's "First runs");
- on that Xeon with Llama-1B's shape in bf16, where 2048 tokens take ~2.0 s, 2048 against 1024 in process (the two
  alternated): a cold 2048-token prompt's first token 1977-2029 against 2044-2087 ms, and vs_vllm's random shape
  (32 x 512/64, 8 at a time, closed loop) 52.6-52.7 against 50.9-51.3 tok/s (its mean TTFT 1.8 s against 1.2 s:
  the opening burst of 8 prompts goes 4 a step instead of 2).
So: vLLM's own CPU default (`FAST_BUDGET`, 2048) where a step of that many tokens is predicted to take at most
`FAST_STEP_S` (between the ~2 s where 2048 still won and the ~4.5 s where 1024 did), else `SLOW_BUDGET`. The
prediction is the model's linear layers (2 flops per weight and token), which dominate a long step (attention adds a
share that grows with the context), at the rate they run at here: one decoder layer's matmuls of the served model's
shapes (fused qkv, o, fused gate_up with its SiLU, down), at a `FAST_BUDGET`-row step, through the engine's own path
(`engine.models.dense`: the packed copies and kernels a prompt step takes, the AMX kernel where oneDNN is not
row-invariant), random weights, best of rounds; cached per CPU, library, torch, threads and shapes
(ucm_kernels/cpu/calibration_store.py). It had been the dtype calibration's one F.linear of 64 x 2048 -> 5632: on
the 2-core Xeon with AMX that logged 789 GFLOP/s where a 1536-token step of Llama-1B's shapes runs at 1.8-2.2
TFLOP/s (issue 49). CUDA takes `FAST_BUDGET`.
The start-up measurement is one moment of the host, and a shared host's speed moves: on the 2-core Xeon with AMX (a
VM) a loop of TDPBF16PS on register-resident tiles runs at ~5.5 TFLOP/s or at ~2.1 for seconds to minutes at a time,
and this calibration of Llama-1B's layer read 1528-1712 GFLOP/s in the one phase and 722-814 in the other: 2048 or
1024 tokens by the phase of the first start, stored for every later one. So `LiveBudget` applies the same rule to the
engine's own long steps while it runs (their wall time per token, attention and all: the rule's step times were such
steps' times), with hysteresis, deciding only on LIVE_STEPS of them: a served Llama-1B node's first step under vLLM's
client (512 tokens, partly on one thread while the governor still lent a core to the client) alone had set 1024 for
good (its later ~518-token steps predicted 2.85 s, inside the hysteresis). vs_vllm's random shape on Llama-1B in
process (32 x 512/64, 8 at a time), the budget fixed at 1024, at 2048 and live from 1024 alternated in one process:
40.5-40.8, 42.7-48.0 and 46.1-52.9 tok/s (live went to 2048); beside a busy loop on one core (one thread left)
28.2-30.1, 29.0-30.1 and 29.8-30.6 (live stayed).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model_config import ModelConfig
from ucm_kernels.cpu.choice_threads import choice_threads

log = logging.getLogger(__name__)

FAST_BUDGET = 2048  # vLLM's CPU default for its OpenAI server
SLOW_BUDGET = 1024
FAST_STEP_S = 3.0  # ... where a FAST_BUDGET step's matmuls take at most this long
RATE_ROUNDS = 3  # timed calls of a layer's matmuls, the best counts
RATE_SPREAD = 1.5  # slowest over fastest past which other load decided them: stored as provisional
# LiveBudget: steps of at least LONG_STEP_TOKENS rows count (fewer rows read the weights more than they compute); the
# prediction is the median of the last LIVE_STEPS of them, made once there are that many; the budget changes once it
# is HYSTERESIS past FAST_STEP_S.
LONG_STEP_TOKENS = SLOW_BUDGET // 2
LIVE_STEPS = 3
HYSTERESIS = 1.15


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


class LiveBudget:
    """An auto budget (`choose`'s) re-chosen from the engine's own long steps (module doc): `observe` each step's
    tokens and wall time; it says the new budget when the last LIVE_STEPS long steps put a FAST_BUDGET-token step
    HYSTERESIS past FAST_STEP_S on the other side. A change moves first tokens and throughput, not outputs: a row's
    bits do not depend on the step it runs in wherever a prefix-cache hit's do not (the row-invariant kernels;
    engine_core warns where bf16 has none)."""

    def __init__(self, start: StepBudget, clock: Callable[[], float] = time.perf_counter) -> None:
        assert start.tokens in (FAST_BUDGET, SLOW_BUDGET), f"not an auto budget: {start}"
        self.budget = start
        self.clock = clock  # what steps are timed with
        self._per_token: deque[float] = deque(maxlen=LIVE_STEPS)  # seconds a token, the last long steps

    def observe(self, tokens: int, seconds: float) -> StepBudget | None:
        """One step's scheduled tokens and wall time; the new budget when this changes it, else None."""
        if tokens < LONG_STEP_TOKENS or seconds <= 0:
            return None
        self._per_token.append(seconds / tokens)
        if len(self._per_token) < LIVE_STEPS:
            return None  # one slow first step (a thread lent out, a neighbour's burst) is no phase
        step_s = FAST_BUDGET * statistics.median(self._per_token)
        if self.budget.tokens == FAST_BUDGET and step_s > FAST_STEP_S * HYSTERESIS:
            tokens = SLOW_BUDGET
        elif self.budget.tokens == SLOW_BUDGET and step_s < FAST_STEP_S / HYSTERESIS:
            tokens = FAST_BUDGET
        else:
            return None
        self.budget = StepBudget(
            tokens,
            f"the median of the last {len(self._per_token)} step(s) of {LONG_STEP_TOKENS}+ tokens predicts a "
            f"{FAST_BUDGET}-token step at {step_s:.2f} s, {'under' if tokens == FAST_BUDGET else 'over'} "
            f"{FAST_STEP_S:.1f} s by more than {HYSTERESIS:.2f}x",
        )
        return self.budget


@dataclass(frozen=True)
class LayerMatmul:
    """One matmul of a decoder layer: its weight's shape, and whether it is the gate_up (its SiLU in the call)."""

    n: int  # out features
    k: int  # in features
    gate_up: bool = False


def layer_matmuls(mc: ModelConfig) -> list[LayerMatmul]:
    """A decoder layer's matmuls in the order its forward calls them (`DecoderLayer.matmul_weights`)."""
    return [
        LayerMatmul(mc.q_size + 2 * mc.kv_size, mc.hidden_size),
        LayerMatmul(mc.hidden_size, mc.q_size),
        LayerMatmul(2 * mc.intermediate_size, mc.hidden_size, gate_up=True),
        LayerMatmul(mc.hidden_size, mc.intermediate_size),
    ]


def layer_step(mc: ModelConfig, dtype: torch.dtype, rows: int) -> tuple[Callable[[], object], int]:
    """(one call of a layer's matmuls on `rows` prompt rows through the engine's path, its FLOPs): random weights of
    the model's shapes, packed as the loader packs them (`engine.models.dense.pack_weight`)."""
    from engine.models.dense import dense, dense_silu_and_mul, pack_weight

    gen = torch.Generator().manual_seed(0)
    calls: list[Callable[[], torch.Tensor]] = []
    flops = 0
    for mm in layer_matmuls(mc):
        w = (torch.randn(mm.n, mm.k, generator=gen) * 0.02).to(dtype)
        x = torch.randn(rows, mm.k, generator=gen).to(dtype)
        fn = dense_silu_and_mul if mm.gate_up else dense
        calls.append(functools.partial(fn, x, w, None, pack_weight(w, gate_up=mm.gate_up)))
        flops += 2 * rows * mm.n * mm.k
    return (lambda: [call() for call in calls]), flops


def measure_layer_gflops(mc: ModelConfig, dtype: torch.dtype, rows: int = FAST_BUDGET) -> tuple[float, list[str]]:
    """(GFLOP/s of one layer's matmuls at `rows` rows, best of RATE_ROUNDS calls; what the calls disagreed on)."""
    run, flops = layer_step(mc, dtype, rows)
    run()  # warm-up: first touch of the outputs, the kernels' lazy set-up
    seconds = []
    for _ in range(RATE_ROUNDS):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    spread = max(seconds) / min(seconds)
    return flops / min(seconds) / 1e9, [f"calls {spread:.2f}x apart"] if spread > RATE_SPREAD else []


def _parse_rate(stored: object) -> float | None:
    gflops = stored.get("gflops") if isinstance(stored, dict) else None
    return float(gflops) if isinstance(gflops, (int, float)) and gflops > 0 else None


def step_matmul_gflops(mc: ModelConfig, dtype: torch.dtype, root: Path | None = None) -> float:
    """GFLOP/s of a FAST_BUDGET-row step's matmuls of this model in `dtype` on this CPU: read from the cache file,
    else measured (`measure_layer_gflops`) and stored. Without the native library (no compiler) the dtype
    calibration's one F.linear stands in, as before."""
    from ucm_kernels.cpu import native
    from ucm_kernels.cpu.calibration_store import stored_or_measured

    lib = native.load()
    if lib is None:
        from ucm_kernels.cpu.calibration import MATMUL_SHAPE, matmul_times

        t, k, n = MATMUL_SHAPE
        ms = matmul_times(root)["bfloat16" if dtype == torch.bfloat16 else "float32"]
        return 2 * t * k * n / (ms * 1e-3) / 1e9
    shapes = " ".join(f"{m.n}x{m.k}{' silu' if m.gate_up else ''}" for m in layer_matmuls(mc))
    name = f"{str(dtype).removeprefix('torch.')} {FAST_BUDGET} rows: {shapes}"
    threads = choice_threads()
    gflops, where = stored_or_measured(
        "step", name, lib, threads, root, _parse_rate, lambda: measure_layer_gflops(mc, dtype), lambda g: {"gflops": g}
    )
    log.info("step matmuls (%s) at %.0f GFLOP/s, %d thread(s) (%s)", name, gflops, threads, where)
    return gflops


def auto_budget(mc: ModelConfig, dtype_name: str, device: str) -> StepBudget:
    """`choose` on this host: the CPU's rate at this model's layer shapes (`step_matmul_gflops`)."""
    if device != "cpu":
        return choose(mc, None)
    return choose(mc, step_matmul_gflops(mc, getattr(torch, dtype_name)))
