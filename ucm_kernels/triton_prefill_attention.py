"""Triton paged prefill attention: packed varlen queries, causal, over a context partly cached already.

Grid (query tile, sequence, query head). A sequence with context L and n new tokens has its queries at positions
L-n .. L-1 (the first L-n tokens being a prefix hit or earlier chunks); query at position p sees keys 0..p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ucm_kernels.reference.prefill_attention import prefill_attention_torch
from ucm_kernels.triton_attention_tile import attend_tile
from ucm_kernels.triton_support import DOT_PRECISION, attention_launch_args, check_attention_operands, dot_in_fp32

__all__ = ["PrefillTile", "default_tile", "prefill_attention_torch", "prefill_attention_triton"]


@dataclass(frozen=True)
class PrefillTile:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_tile(head_dim: int, dtype: torch.dtype) -> PrefillTile:
    """The fastest tile of benchmarks/kernels.py's sweep on an H100 (bf16, one 4k or 8k prompt, whole or its
    second half over a cached first): head_dim 64 128 x 64 with 8 warps (0.123 / 0.110 ms on SmolLM2's heads at
    4k), head_dim 128 128 x 128 with 8 warps (2.11 / 1.61 ms on Llama-8B's at 8k). The 32 x 32 tiles and Triton's
    default launch used before ran 2.5-2.8x slower on all four. fp32 tiles take twice the shared memory: at
    head_dim 128 the 128 x 128 one (~320 KB over two stages) is past a Hopper SM's 228 KB, so 64 x 64 there."""
    if head_dim <= 64:
        return PrefillTile(128, 64, 8, 2)
    return PrefillTile(128, 128, 8, 2) if dtype.itemsize <= 2 else PrefillTile(64, 64, 4, 2)


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
    # Keys before this tile's first query position are seen by every row: those tiles go unmasked. Keys past
    # its last query position are masked for every row: stop there.
    hi = tl.minimum(ctx, prefix + (m_tile + 1) * BLOCK_M)
    full = ((prefix + m_tile * BLOCK_M) // BLOCK_N) * BLOCK_N
    table_row = block_tables_ptr + seq * bt_stride_b
    for tile in range(0, full, BLOCK_N):
        pos = tile + n
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table_row,
            pos,
            n < BLOCK_N,
            m_mask[:, None],
            d,
            d_mask,
            block_size,
            cache_stride_block,
            cache_stride_slot,
            head_off,
            scale_log2e,
            DOT_PRECISION,
            MASKED=False,
        )
    for tile in range(full, hi, BLOCK_N):
        pos = tile + n
        n_mask = pos < hi
        causal = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table_row,
            pos,
            n_mask,
            causal,
            d,
            d_mask,
            block_size,
            cache_stride_block,
            cache_stride_slot,
            head_off,
            scale_log2e,
            DOT_PRECISION,
        )
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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] packed by query_start_loc [B + 1]; seq_lens [B] include the new tokens -> [T, Hq, D].

    block_m / block_n / num_warps / num_stages are tuning knobs (None: `default_tile(head_dim, q.dtype)`);
    benchmarks/kernels.py sweeps them on a GPU."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_attention_operands(
        "prefill_attention", q, k_cache, v_cache, block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens
    )
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    tile = default_tile(head_dim, q.dtype)
    block_m, block_n = block_m or tile.block_m, block_n or tile.block_n
    launch = dict(num_warps=num_warps or tile.num_warps, num_stages=num_stages or tile.num_stages)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        out,
        *attention_launch_args(q, out, k_cache, block_tables, scale),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_F32=dot_in_fp32(q.dtype),
        DOT_PRECISION=DOT_PRECISION,
        **launch,
    )
    return out
