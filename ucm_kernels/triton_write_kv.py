"""Triton reshape-and-cache: one program per new token copies its [Hkv, D] K and V rows into their cache slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm_kernels.reference.write_kv import write_kv_torch

__all__ = ["write_kv_torch", "write_kv_triton"]


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + h * value_stride_h + d, mask=mask)
    dst = block * cache_stride_block + offset * cache_stride_slot + h * cache_stride_head + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] (any token/head strides, unit head_dim stride) -> caches at slot_mapping [T]; -1 skips."""
    num_tokens, num_heads, head_dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("write_kv: key/value need a unit stride along head_dim")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"write_kv: caches need equal strides and unit head_dim stride, got {k_cache.stride()}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
