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
    MASKED: tl.constexpr = True,
):
    """Keys at positions `pos` [BLOCK_N] (n_mask: inside the range read) of one sequence, whose block table row
    starts at table_row_ptr; score_mask says which (query row, key) pairs may attend. Returns the running max,
    sum and output (m_i, l_i, acc) updated, in log2 units. MASKED=False: every key of the tile is in range and
    every row may attend to it (a tile wholly before a prefill tile's first query), so n_mask and score_mask are
    not applied: most of a long prompt's tiles, and the masking is what separated this loop from flash speed."""
    if MASKED:
        page = tl.load(table_row_ptr + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        page = tl.load(table_row_ptr + pos // block_size).to(tl.int64)
        kv_mask = d_mask[None, :]
    kv_off = page * cache_stride_block + (pos % block_size) * cache_stride_slot + head_off
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2e
    if MASKED:
        s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
