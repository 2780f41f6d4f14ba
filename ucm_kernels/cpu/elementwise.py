"""Python side of the fused elementwise kernels: layout checks and the ctypes calls.

bf16 runs `elementwise.c` (bit for bit torch's bf16 math), fp32 its twin `elementwise_f32.c` (torch's math to a
few ulps: see that file). Both are serving dtypes, and torch spends a dispatch and a pass over memory per op in
either. Each call allocates at most its output; threads as in paged_attention.py (`torch.get_num_threads()`,
small calls stay on the calling thread). `UCM_CPU_ATTENTION=torch` keeps torch's own math for every op.
"""

from __future__ import annotations

import torch

from ucm_kernels.cpu import amx_gemm
from ucm_kernels.cpu.native import CFunction, NativeLib

NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def _native_cpu(first: torch.Tensor, *others: torch.Tensor) -> bool:
    """CPU tensors of one dtype that the kernels take."""
    return first.dtype in NATIVE_DTYPES and all(
        t.device.type == "cpu" and t.dtype == first.dtype for t in (first, *others)
    )


def entry(lib: NativeLib, name: str, dtype: torch.dtype) -> CFunction:
    """The entry point for `dtype`: `name` (bf16) or its fp32 twin (their arguments: ucm_kernels/cpu/native.py)."""
    return getattr(lib, name + ("_f32" if dtype == torch.float32 else ""))


def supports_rows(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Norms and SiLU: contiguous CPU rows of one native dtype (weights and residuals alike)."""
    return _native_cpu(x, *others) and x.dim() >= 1 and all(t.is_contiguous() for t in (x, *others))


def supports_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """qk [T, H, D] with heads and head_dim contiguous inside a token (any token stride: a view into qkv);
    cos and sin [T, 1, D] contiguous."""
    return (
        _native_cpu(qk, cos, sin)
        and qk.dim() == 3
        and qk.stride(2) == 1
        and qk.stride(1) == qk.shape[2]
        and cos.shape == sin.shape == (qk.shape[0], 1, qk.shape[2])
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def _rows(x: torch.Tensor) -> tuple[int, int]:
    width = x.shape[-1]
    return (x.numel() // width if width else 0), width


def _norm_output(x: torch.Tensor) -> torch.Tensor:
    """An empty like x for a norm's output, the next matmul's x: where the AMX kernel takes that matmul, its rows
    padded off 4 KB strides (amx_gemm.padded_rows: Llama-1B's qkv and gate_up); every kernel takes rows any stride
    apart or copies them."""
    if x.dim() == 2 and x.dtype == torch.bfloat16 and amx_gemm.needed_and_available() is not None:
        return amx_gemm.padded_rows(x.shape[0], x.shape[1])
    return torch.empty_like(x)


def _row_stride(out: torch.Tensor) -> int:
    return out.stride(0) if out.dim() == 2 else out.shape[-1]


def rms_norm_native(lib: NativeLib, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ucm_kernels.rms_norm`'s contract; the caller checked `supports_rows` and the weight's shape."""
    out = _norm_output(x)
    rows, hidden = _rows(x)
    entry(lib, "rms_norm", x.dtype)(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, hidden, _row_stride(out), eps, torch.get_num_threads()
    )
    return out


def fused_add_rms_norm_native(
    lib: NativeLib, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`ucm_kernels.fused_add_rms_norm`'s contract (residual updated in place); the caller checked the layout."""
    out = _norm_output(x)
    rows, hidden = _rows(x)
    entry(lib, "fused_add_rms_norm", x.dtype)(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, hidden, _row_stride(out), eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_and_mul_native(lib: NativeLib, x: torch.Tensor) -> torch.Tensor:
    """`ucm_kernels.silu_and_mul`'s contract: [..., 2I] -> [..., I]."""
    rows, width = _rows(x)
    out = torch.empty((*x.shape[:-1], width // 2), dtype=x.dtype)
    entry(lib, "silu_and_mul", x.dtype)(x.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def rotary_embedding_native(lib: NativeLib, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`ucm_kernels.rotary_embedding_`'s contract (in place); the caller checked `supports_rope`."""
    tokens, heads, head_dim = qk.shape
    entry(lib, "rotary_embedding", qk.dtype)(
        qk.data_ptr(), qk.stride(0), tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
    )
