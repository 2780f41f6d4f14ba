"""fp32 linear layers for prefill-sized row counts through oneDNN, on a weight reordered once, where that measured
faster than `F.linear` on this machine.

`F.linear` on fp32 CPU tensors is MKL's sgemm. oneDNN's matmul on a weight reordered into its blocked layout at
load was faster for some of SmolLM2's shapes and slower for others on the 2-core AVX2 EPYC (Zen 3), 2 threads,
1024 rows, median of 15: [3072 x 576] 106 -> 134 GFLOPS, [960 x 576] 117 -> 132, [576 x 1536] 124 -> 115. So
`UCM_CPU_LINEAR=auto` measures each weight shape once per machine at `ROWS` rows (two rounds, `REPS` alternating
calls each), keeps the reordered copy only where oneDNN won both rounds, logs the numbers, and caches the answer
beside the skinny kernel's (kernels/cpu/calibration_store.py: same key, same file rules). `native` takes oneDNN
wherever it is available, `torch` never. The engine uses it above the skinny kernel's row counts
(engine/models/dense.py). Results differ from `F.linear`'s in the last bits (another summation order), as the
skinny kernel's do; the engine's greedy outputs are tested against HF transformers either way.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu.linear_choice import WinMemo, measured_win
from kernels.cpu.native import NativeLib
from kernels.cpu.skinny_gemm import MIN_PACK_BYTES, CpuLinear, cpu_linear_mode
from kernels.cpu.timing import two_way_rounds

log = logging.getLogger(__name__)

ROWS = 512  # a prefill chunk's rows: what the choice is for (fewer go to the skinny kernel or F.linear)
MAX_FLOP = 2 << 30  # ... but a wide weight (lm_head: 49152 x 576) is measured at fewer, so start-up stays short
REPS = 3


def measured_rows(k: int, n: int) -> int:
    """The row count a [n, k] weight is measured at: ROWS, fewer (not under 16) where that passes MAX_FLOP."""
    return max(16, min(ROWS, MAX_FLOP // (2 * k * n)))


Timings = tuple[float, float]  # (oneDNN ms, F.linear ms), best of REPS


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (fp32, CPU) in oneDNN's blocked layout for `linear`."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"oneDNN reorder takes a 2-D fp32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias with W from `reorder`."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


def measure(k: int, n: int) -> list[Timings]:
    """One (oneDNN, F.linear) pair per round (tests replace this to force a result)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(measured_rows(k, n), k, generator=gen)
    packed = reorder(w)
    return two_way_rounds([lambda: linear(x, packed, None), lambda: F.linear(x, w)], REPS)


_memo = WinMemo()


def onednn_wins(lib: NativeLib, k: int, n: int, root: Path | None = None) -> bool:
    """Whether oneDNN runs a [n, k] weight's prefill-sized calls on this machine (see the module doc)."""
    mode = cpu_linear_mode()
    if mode is CpuLinear.TORCH or not available():
        return False
    if mode is CpuLinear.NATIVE:
        return True
    if 4 * k * n < MIN_PACK_BYTES:
        return False  # cache-sized: the tests' tiny models would spend their start-up measuring noise
    # Disagreeing rounds: F.linear now (no extra copy), measured again by the next process.
    return measured_win(
        _memo, lib, root, f"onednn fp32 {n}x{k}", "onednn", lambda: measure(k, n),
        ("oneDNN", "F.linear"), "calls above the skinny kernel's rows", f"{measured_rows(k, n)} rows", log,
    )  # fmt: skip


def onednn_weight(lib: NativeLib, weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered for oneDNN where that wins here, else None (F.linear, no extra memory)."""
    n, k = weight.shape
    return reorder(weight) if onednn_wins(lib, k, n) else None


def forget() -> None:
    """Drop this process's memoised choices (tests)."""
    _memo.clear()
