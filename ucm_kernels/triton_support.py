"""What the Triton kernels' wrappers share: interpreter facts, the layout checks and launch arguments of the
two paged attention kernels, and the block-layout check of the block movers."""

from __future__ import annotations

import torch

from ucm_kernels.backend import triton_interpreted

# fp32 operands: "ieee" keeps fp32 caches exact on GPU (the default tf32 would round to 10 mantissa bits);
# bf16/fp16 operands ignore it and take the tensor-core path.
DOT_PRECISION = "ieee"
# The attention kernels compute softmax with exp2, so the score scale is premultiplied by log2(e).
LOG2E = 1.4426950408889634
INDEX_DTYPES = (torch.int32, torch.int64)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should upcast tl.dot operands to fp32.

    The triton 3.9 interpreter returns garbage for tl.dot on bf16/fp16 operands, so interpreted runs (CPU CI)
    compute the dots in fp32; compiled kernels keep 16-bit operands with fp32 accumulation.
    """
    return dtype == torch.float32 or triton_interpreted()


def check_attention_operands(
    kernel: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    **index_vectors: torch.Tensor,
) -> None:
    """The layout the paged attention kernels index by hand (shapes are checked by `ucm_kernels.api`)."""
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(f"{kernel}: q and caches need unit head_dim stride; k/v caches equal strides")
    if block_tables.stride(-1) != 1 or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError(f"{kernel}: block_tables must be int32/int64 with contiguous rows")
    for name, t in index_vectors.items():
        if t.dtype not in INDEX_DTYPES or not t.is_contiguous():
            raise ValueError(f"{kernel}: {name} must be a contiguous int32/int64 vector")


def attention_launch_args(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, scale: float
) -> tuple[float | int, ...]:
    """The arguments both attention kernels take after their tensors, in their order: scale_log2e, the q / out
    token and head strides, the cache block / slot / head strides, the block-table row stride, block_size."""
    return (
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_cache.shape[1],
    )


def check_block_contiguous(kernel: str, cache: torch.Tensor) -> None:
    """The block movers copy a block as one flat run of elements from cache_ptr + block * stride(0)."""
    _, h, d = cache.shape[1:]
    if cache.stride()[1:] != (h * d, d, 1):
        raise ValueError(f"{kernel}: each cache block must be contiguous, got strides {cache.stride()}")
