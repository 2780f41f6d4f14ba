"""Triton copy-on-write: copy whole blocks src[i] -> dst[i] inside each layer's K and V cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ucm_kernels.reference.block_ops import copy_blocks_torch
from ucm_kernels.triton_support import check_block_contiguous

__all__ = ["copy_blocks_torch", "copy_blocks_triton"]

_CHUNK = 1024


@triton.jit
def _block_copy_kernel(
    k_cache_ptr,
    v_cache_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    cache_stride_block,
    BLOCK_ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ids_ptr + i).to(tl.int64) * cache_stride_block
    dst = tl.load(dst_ids_ptr + i).to(tl.int64) * cache_stride_block
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    tl.store(k_cache_ptr + dst + offs, tl.load(k_cache_ptr + src + offs, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst + offs, tl.load(v_cache_ptr + src + offs, mask=mask), mask=mask)


def copy_blocks_triton(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """One launch per layer. Programs run in parallel, so destinations must be distinct and never also a source
    (true for copy-on-write, whose destinations are freshly allocated); checked when the ids live on the CPU."""
    if src_block_ids.device.type == "cpu":
        src_set, dst_list = set(src_block_ids.tolist()), dst_block_ids.tolist()
        if len(set(dst_list)) != len(dst_list) or src_set.intersection(dst_list):
            raise ValueError("copy_blocks: destination ids must be distinct and disjoint from the sources")
    device = kv_caches[0][0].device
    src = src_block_ids.to(device, non_blocking=True)
    dst = dst_block_ids.to(device, non_blocking=True)
    n = src.shape[0]
    if n == 0:
        return
    for k_cache, v_cache in kv_caches:
        check_block_contiguous("copy_blocks", k_cache)
        if k_cache.stride() != v_cache.stride():
            raise ValueError(f"copy_blocks: k/v caches need equal strides, got {k_cache.stride()} {v_cache.stride()}")
        elems = k_cache[0].numel()
        _block_copy_kernel[(n, triton.cdiv(elems, _CHUNK))](
            k_cache, v_cache, src, dst, k_cache.stride(0), BLOCK_ELEMS=elems, CHUNK=_CHUNK
        )
