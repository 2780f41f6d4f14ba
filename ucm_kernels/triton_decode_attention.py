"""Triton paged decode attention (one query token per sequence), with a split-KV variant for long contexts.

Grid (batch, kv_head, split): a program loads the whole GQA group of query heads that share one KV head, so each
K/V byte is read once per group. With more than one split, every split writes a normalised partial output and its
log-sum-exp, and a second kernel merges them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ucm_kernels.reference.decode_attention import decode_attention_torch
from ucm_kernels.triton_attention_tile import attend_tile
from ucm_kernels.triton_support import DOT_PRECISION, attention_launch_args, check_attention_operands, dot_in_fp32

__all__ = ["choose_num_splits", "decode_attention_torch", "decode_attention_triton"]


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_ptr,
    lse_ptr,
    scale_log2e,
    q_stride_b,
    q_stride_h,
    out_stride_b,
    out_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    bt_stride_b,
    block_size,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Splits get equal, BLOCK_N-aligned shares of this sequence's context; trailing ones may be empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)  # every tl.dot below then runs in fp32 (k, p and v are cast to q's dtype)
    # Finite start for the running max: an all-masked tile then yields p = 0 instead of NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    head_off = kv_head * cache_stride_head
    table_row = block_tables_ptr + b * bt_stride_b
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        n_mask = pos < end
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
            n_mask[None, :],
            d,
            d_mask,
            block_size,
            cache_stride_block,
            cache_stride_slot,
            head_off,
            scale_log2e,
            DOT_PRECISION,
        )
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )
    else:
        # partial [B, Hq, S, D] and lse [B, Hq, S] are contiguous fp32 scratch; lse in log2 units.
        num_heads = tl.num_programs(1) * GROUP
        row = (b * num_heads + heads) * NUM_SPLITS + split
        tl.store(partial_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    out_stride_b,
    out_stride_h,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(lse_ptr + row * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence (seq_len 0): all weights 0, output 0
    w = tl.exp2(lse - m)
    parts = tl.load(
        partial_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# A grid of at least 2 programs per SM is not split; a smaller one is split up to 4 per SM. On an H200 (132 SMs,
# bf16): llama8b b64x2k (512 programs) runs 0.133 ms whole vs 0.142 split in 2; llama8b b4x32k 0.158 ms at 2 per
# SM vs 0.136 at 4; smollm2 b8x4k 0.058 vs 0.052 (`benchmarks.kernels`' sweep: docs/history/benchmarks.json,
# "GPU: NVIDIA H200").
NO_SPLIT_PER_SM, SPLIT_TO_PER_SM = 2, 4


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split a grid smaller than 2 programs per SM into about 4 per SM, keeping >= 256 tokens per split."""
    programs = batch * num_kv_heads
    if programs >= NO_SPLIT_PER_SM * num_sms or max_seq_len <= 512:
        return 1
    by_occupancy = triton.cdiv(SPLIT_TO_PER_SM * num_sms, programs)
    by_length = max(1, max_seq_len // 256)
    return max(1, min(by_occupancy, by_length, 32))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int | None = 2,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]. num_splits None = heuristic (needs max_seq_len, else reads seq_lens.max()).

    block_n / num_warps / num_stages are tuning knobs (benchmarks/kernels.py sweeps them on a GPU).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    check_attention_operands("decode_attention", q, k_cache, v_cache, block_tables, seq_lens=seq_lens)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        sms = 1  # interpreted on CPU
        if q.is_cuda:
            sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, sms)
    meta = dict(
        GROUP=group,
        NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        DOT_F32=dot_in_fp32(q.dtype),
        DOT_PRECISION=DOT_PRECISION,
    )
    launch = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    if num_splits == 1:
        partial = lse = out  # unused by the kernel on this path
    else:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial,
        lse,
        *attention_launch_args(q, out, k_cache, block_tables, scale),
        **meta,
        **launch,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            partial,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=meta["BLOCK_D"],
        )
    return out
