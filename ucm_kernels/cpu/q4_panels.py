"""fp32 weights that are exactly 4-bit, packed for skinny_gemm.c's q4 kernel: a decode step reads 0.16x the bytes.

The embedded model is a GGUF Q4_1: each 32-wide block of a weight row is d * q + m with q in 0..15 (d and m
fp16), and its fp32 weights are exactly those values (fp32 mul, then add). `find_q4` recovers (q, d, m) from the
fp32 weight and keeps them only if every block reproduces every weight bit for bit with those two roundings, the
ones the kernel makes when it expands a panel; so the q4 kernel's output is bit-identical to the fp32 panel
kernel's. A weight that is not exactly 4-bit (random test weights, another model's) gets None and stays fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ucm_kernels.cpu.native import CFunction, NativeLib

QB = 32  # k per scale block (skinny_gemm.c)
NR = 16  # outputs per panel (skinny_gemm.c)
_D_STEPS = (1, -1, 2, -2)  # fp16 neighbours of the first guess for d, for the blocks it does not reproduce


@dataclass(frozen=True)
class Q4Panels:
    """qp [panels, K, 8] uint8 (outputs j and j + 8 of a panel in one byte) and dm [panels, K / 32, 2, 16] fp32."""

    qp: torch.Tensor
    dm: torch.Tensor


def gguf_blocks(weight: torch.Tensor) -> np.ndarray | None:
    """`weight` [N, K] as its [N, K / 32, 32] fp32 blocks, or None where it cannot hold a GGUF block format (not
    fp32 2-D, K not whole blocks, empty, not finite)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % QB or weight.numel() == 0:
        return None
    n, k = weight.shape
    w = weight.detach().contiguous().numpy().reshape(n, k // QB, QB)
    return w if np.isfinite(w).all() else None


def find_q4(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(q [N, K] uint8, d [N, K / 32], m [N, K / 32] fp32) with weight == q * d + m exactly, or None."""
    w = gguf_blocks(weight)
    if w is None:
        return None
    n, k = weight.shape
    m = w.min(-1)  # the block's q = 0 element is m itself (0 * d + m)
    guess = ((w.max(-1) - m) / 15).astype(np.float16)
    d = guess.astype(np.float32)
    ok = _reproduces(w, d, m)
    for step in _D_STEPS:
        if ok.all():
            break
        bad = ~ok
        cand = (guess[bad].view(np.int16) + step).view(np.float16).astype(np.float32)
        cand_ok = _reproduces(w[bad], cand, m[bad])
        d_bad = d[bad]
        d_bad[cand_ok] = cand[cand_ok]
        d[bad] = d_bad
        ok[bad] = cand_ok
    if not ok.all():
        return None
    return _quantize(w, d, m).reshape(n, k), d, m


def _quantize(w: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint((w - m[..., None]) / d[..., None]), 0)
    return np.clip(q, 0, 15).astype(np.uint8)


def _reproduces(w: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Per block: q * d + m (fp32 product, then fp32 sum) gives w's exact bits."""
    if d.size and (d < 0).any():
        return np.zeros(d.shape, dtype=bool)
    rec = _quantize(w, d, m).astype(np.float32) * d[..., None] + m[..., None]
    return (rec.view(np.int32) == w.view(np.int32)).all(-1)


def find_q4_padded(weight: torch.Tensor, nr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`find_q4` with the outputs padded to a multiple of `nr` (a panel): padded outputs have q = d = m = 0, so
    they compute 0, like the fp32 panels' zeros."""
    found = find_q4(weight)
    if found is None:
        return None
    q, d, m = pad_outputs(nr, *found)
    return q, d, m


def pad_outputs(nr: int, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-output arrays ([N, ...] each) padded with zeros to a multiple of `nr` outputs (a panel)."""
    pad = ((0, -arrays[0].shape[0] % nr), (0, 0))
    return tuple(np.pad(a, pad) for a in arrays)


def pack_q4(weight: torch.Tensor) -> Q4Panels | None:
    """`weight` [N, K] as 4-bit panels, or None where it is not exactly 4-bit (see the module doc)."""
    found = find_q4_padded(weight, NR)
    if found is None:
        return None
    q, d, m = found
    k = q.shape[1]
    panels = q.shape[0] // NR
    qn = q.reshape(panels, NR, k)
    qp = (qn[:, : NR // 2] | (qn[:, NR // 2 :] << 4)).transpose(0, 2, 1)  # [panels, K, 8]
    dm = np.stack([x.reshape(panels, NR, k // QB).transpose(0, 2, 1) for x in (d, m)], axis=2)  # [P, K/32, 2, 16]
    return Q4Panels(torch.from_numpy(np.ascontiguousarray(qp)), torch.from_numpy(np.ascontiguousarray(dm)))


def fp32_output(out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    """A skinny kernel's [m, n] fp32 output: `out` (a caller's buffer, e.g. a decode step's) checked, or a new one."""
    if out is None:
        return torch.empty((m, n), dtype=torch.float32)
    if out.shape != (m, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{m}, {n}], got {out.dtype} {tuple(out.shape)}")
    return out


@dataclass(frozen=True)
class SkinnyOperands:
    """What every skinny kernel's C entry takes besides its weight and threads: x [m, k] contiguous fp32, the output
    y [m, n] and the bias as fp32 (None: no bias)."""

    x: torch.Tensor
    y: torch.Tensor
    bias: torch.Tensor | None

    @property
    def bias_ptr(self) -> int | None:
        return self.bias.data_ptr() if self.bias is not None else None


def skinny_operands(
    what: str, x: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor | None
) -> SkinnyOperands:
    """x checked (2-D fp32) and made contiguous, the output (`fp32_output`) and the bias as fp32, for kernel `what`."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"{what} takes a 2-D fp32 input, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    b = bias.detach().contiguous().float() if bias is not None else None
    return SkinnyOperands(x, fp32_output(out, x.shape[0], n), b)


def quantized_linear(
    what: str,
    kernel: CFunction,
    x: torch.Tensor,
    qp: torch.Tensor,
    scales: torch.Tensor,
    panel_k_bytes: int,
    n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] @ W.T + bias through a quantized skinny kernel (`kernel`: skinny_gemm.c's q4 or q8 entry) on W's
    panels `qp` (`panel_k_bytes` bytes per k of a panel) and their `scales`."""
    ops = skinny_operands(what, x, n, bias, out)
    m, k = ops.x.shape
    if qp.numel() != -(-n // NR) * k * panel_k_bytes:
        raise ValueError(f"{what}: panels of {qp.numel()} bytes are not {n} x {k}")
    status = kernel(
        ops.x.data_ptr(), m, k, qp.data_ptr(), scales.data_ptr(), n, ops.bias_ptr, ops.y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    # The quantized entries fall back to the few-row loop (stack scratch only) when the blocked one lacks memory.
    assert status == 0, f"{what}: skinny_gemm.c's quantized entry returned {status}, which it never does"
    return ops.y


def skinny_linear_q4(
    lib: NativeLib,
    x: torch.Tensor,
    panels: Q4Panels,
    n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W packed by `pack_q4`: bit-identical to skinny_linear on the fp32 panels.
    `out`: where to write it (`fp32_output`)."""
    return quantized_linear("skinny_linear_q4", lib.skinny_gemm_q4, x, panels.qp, panels.dm, NR // 2, n, bias, out)


def random_q4_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """An [n, k] fp32 weight that is exactly 4-bit, with scales like a trained model's (calibration, tests)."""
    blocks = (n, k // QB)
    d = (torch.rand(blocks, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(blocks, generator=gen) * 0.08).half().float()
    q = torch.randint(0, 16, (n, k // QB, QB), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # each block spans its full range, as a quantizer's blocks do
    return (q * d[..., None] + m[..., None]).reshape(n, k)
