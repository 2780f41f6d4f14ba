"""Pure-torch references: the CPU serving path and the oracle every Triton kernel is tested against."""

from ucm_kernels.reference.block_ops import copy_blocks_torch, gather_blocks_torch, scatter_blocks_torch
from ucm_kernels.reference.decode_attention import decode_attention_torch
from ucm_kernels.reference.decode_attention_chunked import decode_attention_chunked_torch
from ucm_kernels.reference.elementwise import (
    fused_add_rms_norm_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    silu_and_mul_torch,
)
from ucm_kernels.reference.paged_gather import gather_context
from ucm_kernels.reference.prefill_attention import prefill_attention_torch
from ucm_kernels.reference.write_kv import write_kv_torch

__all__ = [
    "copy_blocks_torch",
    "decode_attention_chunked_torch",
    "decode_attention_torch",
    "fused_add_rms_norm_torch",
    "gather_blocks_torch",
    "gather_context",
    "prefill_attention_torch",
    "rms_norm_torch",
    "rotary_embedding_torch",
    "scatter_blocks_torch",
    "silu_and_mul_torch",
    "write_kv_torch",
]
