"""The inner step both paged attention kernels share: fold one tile of cached keys into an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    pos,
    n_mask,
    score_mask,
    d,
    d_mask,
    block_size,
    cache_stride_block,
    cache_stride_slot,
    head_off,
    scale_log2e,
    DOT_PRECISION: tl.constexpr,
):
    """Keys at positions `pos` [BLOCK_N] (n_mask: inside the range read) of one sequence, whose block table row
    starts at table_row_ptr; score_mask says which (query row, key) pairs may attend. Returns the running max,
    sum and output (m_i, l_i, acc) updated, in log2 units."""
    page = tl.load(table_row_ptr + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    kv_off = page * cache_stride_block + (pos % block_size) * cache_stride_slot + head_off
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2e
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
