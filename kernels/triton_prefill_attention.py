"""Triton paged prefill attention: packed varlen queries, causal, over a context partly cached already.

Grid (query tile, sequence, query head). A sequence with context L and n new tokens has its queries at positions
L-n .. L-1 (the first L-n tokens being a prefix hit or earlier chunks); query at position p sees keys 0..p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference.prefill_attention import prefill_attention_torch
from kernels.triton_support import DOT_PRECISION, dot_in_fp32

__all__ = ["prefill_attention_torch", "prefill_attention_triton"]

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    scale_log2e,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    bt_stride_b,
    block_size,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    num_q = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    if m_tile * BLOCK_M >= num_q:  # the grid is sized for the longest query; shorter ones exit
        return
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int64)
    prefix = ctx - num_q

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < num_q
    d_mask = d < HEAD_DIM
    q_pos = prefix + m
    q = tl.load(
        q_ptr + (q_start + m)[:, None] * q_stride_t + head * q_stride_h + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows give p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    head_off = (head // GROUP) * cache_stride_head
    # Keys past this tile's last query position are masked for every row: stop there.
    hi = tl.minimum(ctx, prefix + (m_tile + 1) * BLOCK_M)
    for tile in range(0, hi, BLOCK_N):
        pos = tile + n
        n_mask = pos < hi
        page = tl.load(block_tables_ptr + seq * bt_stride_b + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        kv_off = page * cache_stride_block + (pos % block_size) * cache_stride_slot + head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2e
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + m)[:, None] * out_stride_t + head * out_stride_h + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int = 32,
    block_n: int = 32,
) -> torch.Tensor:
    """q [T, Hq, D] packed by query_start_loc [B + 1]; seq_lens [B] include the new tokens -> [T, Hq, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("prefill_attention: q and caches need unit head_dim stride; k/v caches equal strides")
    if block_tables.stride(-1) != 1 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("prefill_attention: block_tables must be int32/int64 with contiguous rows")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
            raise ValueError(f"prefill_attention: {name} must be a contiguous int32/int64 vector")
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_cache.shape[1],
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_F32=dot_in_fp32(q.dtype),
        DOT_PRECISION=DOT_PRECISION,
    )
    return out
