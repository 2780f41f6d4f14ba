"""Paged-KV kernels: Triton on CUDA, the pure-torch reference on CPU (`UCM_ATTENTION_BACKEND=torch|triton` forces).

Importing this package does not import triton; the Triton modules load on their first use.
"""

from kernels.api import (
    copy_blocks,
    decode_attention,
    gather_blocks,
    paged_attention,
    prefill_attention,
    scatter_blocks,
    write_kv,
)
from kernels.backend import AttentionBackend, select_backend

__all__ = [
    "AttentionBackend",
    "copy_blocks",
    "decode_attention",
    "gather_blocks",
    "paged_attention",
    "prefill_attention",
    "scatter_blocks",
    "select_backend",
    "write_kv",
]
