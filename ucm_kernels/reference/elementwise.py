"""Pure-torch references for the Llama block's elementwise ops: the CPU fallback, the CUDA and fp32 path, and
the oracle for the native kernels in ucm_kernels/cpu/elementwise.c.

These are the model's original expressions, unchanged, so fp32 models stay bit-identical to HF transformers
and bf16 ones round exactly where HF does (after every op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back to x's dtype, then scale (two roundings in bf16)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place, then rms_norm(residual): the residual add of a layer folded into the next norm."""
    residual.add_(x)
    return rms_norm_torch(residual, weight, eps)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) -> silu(gate) * up [..., I]."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_torch(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated (rotate-half layout) by cos and sign-folded sin [T, 1, D]: x*cos + cat(x2, x1)*sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
