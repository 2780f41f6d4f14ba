"""fp32 weights that are exactly bf16, packed for skinny_gemm.c's bf16 panels: a decode step reads half the bytes.

A bf16 checkpoint (Llama 3.2, Qwen2.5: most models people serve) runs in fp32 on a CPU without bf16 arithmetic
(an AVX2-only x86), and its fp32 weights are the bf16 values widened: every float's low 16 bits are zero. Kept as
their upper halves and widened back by the tiles as they take them (a shuffle with zeros), they are the floats the
fp32 panels hold, so the results are the fp32 panels' bit for bit, and the step streams 2 bytes a weight where the
fp32 panels and the BLAS stream 4. Packing checks every value and gives None if one is not exactly a bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.q4_panels import NR, skinny_operands


@dataclass(frozen=True)
class BF16Panels:
    """bp [ceil(N / 16) * K * 16] int16: the weights' bf16 bits, panel by panel, k by k (skinny_gemm.c's slot order)."""

    bp: torch.Tensor


def pack_bf16(lib: NativeLib, weight: torch.Tensor) -> BF16Panels | None:
    """`weight` [N, K] (fp32, CPU) as bf16 panels, or None where some value is not exactly a bf16."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"bf16 panels take a 2-D fp32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().contiguous()
    bp = torch.empty(-(-n // NR) * k * NR, dtype=torch.int16)
    return BF16Panels(bp) if lib.pack_panels_bf16(w.data_ptr(), bp.data_ptr(), n, k) == 0 else None


def skinny_linear_bf16(
    lib: NativeLib,
    x: torch.Tensor,
    panels: BF16Panels,
    n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W packed by `pack_bf16`: bit-identical to skinny_linear on the fp32 panels.
    `out`: where to write it (`fp32_output`)."""
    ops = skinny_operands("skinny_linear_bf16", x, n, bias, out)
    m, k = ops.x.shape
    if panels.bp.numel() != -(-n // NR) * k * NR:
        raise ValueError(f"skinny_linear_bf16: panels of {panels.bp.numel()} values are not {n} x {k}")
    status = lib.skinny_gemm_bf16(
        ops.x.data_ptr(), m, k, panels.bp.data_ptr(), n, ops.bias_ptr, ops.y.data_ptr(), torch.get_num_threads()
    )
    assert status == 0, f"skinny_linear_bf16: skinny_gemm.c returned {status}, which it never does"
    return ops.y


def random_bf16_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """An [n, k] fp32 weight that is exactly bf16 (calibration, tests)."""
    return torch.randn(n, k, generator=gen).bfloat16().float()
