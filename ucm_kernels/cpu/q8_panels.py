"""fp32 weights that are exactly Q8_0, packed for skinny_gemm.c's q8 kernel: a decode step reads 0.27x the bytes.

The embedded model's tied embedding and lm_head are GGUF Q8_0: each 32-wide block of a row is d * q with q an int8
and d an fp16, and the fp32 weights are exactly those products (11 by 8 significant bits: the fp32 product is
exact). `find_q8` recovers (q, d) and keeps them only if every block reproduces every weight bit for bit, so the
kernel, which expands a panel with that one product, gives the fp32 panel kernel's exact results. In an fp32 model
that is the lm_head of every decode step: 113 MB of fp32 panels against 31 MB here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.q4_panels import NR, QB, gguf_blocks, pad_outputs, quantized_linear


@dataclass(frozen=True)
class Q8Panels:
    """qp [panels, K, 16] int8 (the 16 outputs' q at each k) and d [panels, K / 32, 16] fp32."""

    qp: torch.Tensor
    d: torch.Tensor


def find_q8(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """(q [N, K] int8, d [N, K / 32] fp32) with weight == q * d exactly (fp32 product), or None. A Q8_0 block's
    scale is its largest |w| over 127, so that q is +-127 there and the product gives w back exactly."""
    w = gguf_blocks(weight)
    if w is None:
        return None
    n, k = weight.shape
    d = (np.abs(w).max(-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(w / d[..., None]), 0)
    if np.abs(q).max() > 127:
        return None
    q8 = q.astype(np.int8)
    if not ((q8.astype(np.float32) * d[..., None]).view(np.int32) == w.view(np.int32)).all():
        return None
    return q8.reshape(n, k), d


def find_q8_padded(weight: torch.Tensor, nr: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`find_q8` with the outputs padded to a multiple of `nr` (a panel): padded outputs have q = d = 0."""
    found = find_q8(weight)
    if found is None:
        return None
    q, d = pad_outputs(nr, *found)
    return q, d


def pack_q8(weight: torch.Tensor) -> Q8Panels | None:
    """`weight` [N, K] as 8-bit panels, or None where it is not exactly Q8_0 (see the module doc)."""
    found = find_q8_padded(weight, NR)
    if found is None:
        return None
    q, d = found
    k = q.shape[1]
    panels = q.shape[0] // NR
    qp = q.reshape(panels, NR, k).transpose(0, 2, 1)  # [panels, K, 16]
    dp = d.reshape(panels, NR, k // QB).transpose(0, 2, 1)  # [panels, K / 32, 16]
    return Q8Panels(torch.from_numpy(np.ascontiguousarray(qp)), torch.from_numpy(np.ascontiguousarray(dp)))


def skinny_linear_q8(
    lib: NativeLib,
    x: torch.Tensor,
    panels: Q8Panels,
    n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W packed by `pack_q8`: bit-identical to skinny_linear on the fp32 panels.
    `out`: where to write it (`fp32_output`)."""
    return quantized_linear("skinny_linear_q8", lib.skinny_gemm_q8, x, panels.qp, panels.d, NR, n, bias, out)


def random_q8_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """An [n, k] fp32 weight that is exactly Q8_0 (calibration, tests)."""
    q = torch.randint(-127, 128, (n, k // QB, QB), generator=gen).float()
    q[..., 0] = 127  # each block's largest |q|, as a quantizer's blocks have
    d = (torch.rand((n, k // QB), generator=gen) * 0.01 + 1e-3).half().float()
    return (q * d[..., None]).reshape(n, k)
