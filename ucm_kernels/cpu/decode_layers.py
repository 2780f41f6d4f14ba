"""Python side of `decode_layers.c`: a decode step's decoder layers in one native call.

engine/models/native_decode.py builds the layers' table once (weights, packed panels, caches: all fixed for the
model's life) and a step's arguments per step; `run` calls the library and turns a failure into the error the
kernel's own Python wrapper raises for it.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ucm_kernels.cpu import amx_gemm, q4_bf16
from ucm_kernels.cpu import write_kv as native_write
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.paged_attention import attention_error
from ucm_kernels.cpu.skinny_gemm import PanelFormat

_i64, _ptr, _f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double


class LinearFormat(enum.IntEnum):
    """Which kernel a matmul takes (DL_* in decode_layers.c)."""

    Q4_BF16 = 0  # q4_bf16.c on Q4_1 panels
    F32_PANELS = 1  # skinny_gemm.c on fp32 panels
    Q4_F32 = 2  # skinny_gemm.c on 4-bit panels
    Q8_F32 = 3  # skinny_gemm.c on 8-bit panels
    AMX_BF16 = 4  # amx_gemm.c (a bf16 weight that no quantized panels stand for, where AMX replaces oneDNN)
    AMX_BF16_PAIRS = 5  # amx_gemm.c on a gate_up weight packed paired, SiLU-and-mul in its epilogue
    BF16_F32 = 6  # skinny_gemm.c on bf16 panels (an fp32 model whose weights are exactly bf16)
    BF16_BF16 = 7  # q4_bf16.c on bf16 panels (a bf16 model's weight, without AMX)


# The kernels with a bf16 output, after which decode_layers.c adds a bias (Qwen2's qkv).
BIASED_FORMATS = frozenset({LinearFormat.AMX_BF16, LinearFormat.Q4_BF16, LinearFormat.BF16_BF16})

SKINNY_FORMATS = {  # skinny_gemm.c's format for each kind of panels (`PanelWeight.operands`)
    PanelFormat.FP32: LinearFormat.F32_PANELS,
    PanelFormat.Q4: LinearFormat.Q4_F32,
    PanelFormat.Q8: LinearFormat.Q8_F32,
    PanelFormat.BF16: LinearFormat.BF16_F32,
}


class _Failure(enum.IntEnum):
    OK = 0
    LINEAR = 1
    WRITE_KV = 2
    ATTENTION = 3


class CLinear(ctypes.Structure):
    _fields_ = [("q", _ptr), ("scales", _ptr), ("bias", _ptr), ("n", _i64), ("k", _i64), ("format", _i64)]


class CLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_attn_norm", _ptr),
        ("qkv", CLinear),
        ("o", CLinear),
        ("gate_up", CLinear),
        ("down", CLinear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("input_eps", _f64),
        ("post_attn_eps", _f64),
        ("scale", _f64),
    ]


class CStep(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("tokens", "hidden", "inter", "num_heads", "num_kv_heads", "head_dim", "dtype")),
        *((name, _ptr) for name in ("residual", "x", "qkv", "att", "o_out", "gate_up", "act", "down_out", "out")),
        ("cos", _ptr),
        ("sin", _ptr),
        ("final_norm", _ptr),
        ("final_eps", _f64),
        ("slots", _ptr),
        ("seq_lens", _ptr),
        ("block_tables", _ptr),
        *((name, _i64) for name in ("num_slots", "block_table_stride", "max_blocks", "num_blocks", "block_size")),
        ("threads", _i64),
        ("pad", _ptr),  # AMX_BF16's scratch: threads x 32 x the widest k, bf16
    ]


class CFailure(ctypes.Structure):
    _fields_ = [("op", _i64), ("layer", _i64), ("status", _i64), ("detail", ctypes.c_int32), ("pad", ctypes.c_int32)]


@dataclass(frozen=True)
class Linear:
    """One matmul's packed weight as decode_layers.c takes it (the tensors are kept alive by the model)."""

    q: torch.Tensor
    scales: torch.Tensor | None
    n: int
    k: int
    format: LinearFormat
    panels: q4_bf16.DecodePanelsOf | None = None  # for the q4_bf16 error message
    bias: torch.Tensor | None = None  # [n] bf16, after a bf16 kernel only: added after it as torch adds it

    def __post_init__(self) -> None:
        if self.bias is not None:
            assert self.format in BIASED_FORMATS, (
                f"decode_layers.c adds a bias after bf16 kernels only, not {self.format.name}"
            )
            assert self.bias.dtype == torch.bfloat16 and self.bias.shape == (self.n,) and self.bias.is_contiguous(), (
                "a bias as decode_layers.c reads it: [n] bf16, contiguous"
            )

    def c(self) -> CLinear:
        scales = self.scales.data_ptr() if self.scales is not None else None
        bias = self.bias.data_ptr() if self.bias is not None else None
        return CLinear(self.q.data_ptr(), scales, bias, self.n, self.k, int(self.format))


@dataclass(frozen=True)
class Layer:
    """A decoder layer's operands: its norms' weights and epsilons, its four matmuls in call order (qkv, o,
    gate_up, down), its attention scale."""

    input_norm: torch.Tensor
    input_eps: float
    post_attn_norm: torch.Tensor
    post_attn_eps: float
    linears: tuple[Linear, ...]  # qkv, o, gate_up, down
    scale: float

    def __post_init__(self) -> None:
        assert len(self.linears) == 4, f"a layer's four matmuls, got {len(self.linears)}"


class NativeLayers:
    """A model's layers over its caches as decode_layers.c takes them: the C table is built once (every pointer in
    it is fixed while the weights and caches live; the caller keeps them alive)."""

    def __init__(self, lib: NativeLib, layers: Sequence[Layer], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self.lib, self.layers = lib, list(layers)
        self.fn = lib.cdll.ucm_decode_layers
        self.fn.argtypes = [ctypes.POINTER(CStep), ctypes.POINTER(CLayer), _i64, ctypes.POINTER(CFailure)]
        self.fn.restype = ctypes.c_int32
        self.table = (CLayer * len(self.layers))()
        for row, layer, (k_cache, v_cache) in zip(self.table, self.layers, kv_caches, strict=True):
            row.input_norm, row.post_attn_norm = layer.input_norm.data_ptr(), layer.post_attn_norm.data_ptr()
            row.qkv, row.o, row.gate_up, row.down = (linear.c() for linear in layer.linears)
            row.k_cache, row.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            row.input_eps, row.post_attn_eps, row.scale = layer.input_eps, layer.post_attn_eps, layer.scale

    def run(self, step: CStep, slots: torch.Tensor) -> None:
        """One step's layers; raises what the failing kernel's Python wrapper would have raised."""
        failure = CFailure()
        if self.fn(ctypes.byref(step), self.table, len(self.table), ctypes.byref(failure)) == _Failure.OK:
            return
        op, status = _Failure(failure.op), int(failure.status)
        if op is _Failure.WRITE_KV:
            raise native_write.slot_error(slots, status, step.num_slots)
        if op is _Failure.ATTENTION:
            raise attention_error(status, failure.detail)
        linear = self.layers[failure.layer].linears[failure.detail]
        if linear.format in (LinearFormat.AMX_BF16, LinearFormat.AMX_BF16_PAIRS):
            raise amx_gemm.status_error(status)
        assert linear.panels is not None, f"only q4_bf16 and the AMX kernel fail, got status {status} from {op.name}"
        raise q4_bf16.status_error(self.lib, status, step.tokens, linear.panels)
