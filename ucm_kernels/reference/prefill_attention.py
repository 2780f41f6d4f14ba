"""Reference prefill attention: packed varlen queries, causal, over a context already in the paged cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ucm_kernels.reference.decode_attention import decode_attention_torch
from ucm_kernels.reference.paged_gather import gather_context


def prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """q [T, Hq, D] packed; sequence i owns q[qsl[i]:qsl[i+1]], its last tokens among seq_lens[i] context tokens.

    Query token j of a sequence with context L and n new tokens sits at position L - n + j and sees keys 0..L-n+j.
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    # Single-token sequences (decodes mixed into a chunked-prefill step) go through one batched decode call.
    single = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if single:
        rows = torch.tensor([starts[i] for i in single], device=q.device)
        seqs = torch.tensor(single, device=q.device)
        out[rows] = decode_attention_torch(
            q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale, max(lens[i] for i in single)
        )
    for i, ctx in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        n = hi - lo
        if n == 0 or n == 1:
            continue
        if n > ctx:
            raise ValueError(f"sequence {i}: {n} query tokens but only {ctx} tokens of context")
        num_blocks = -(-ctx // bs)
        table = block_tables[i : i + 1]
        k = gather_context(k_cache, table, num_blocks, q.dtype)[:, :, :ctx]  # [1, Hkv, L, D]
        v = gather_context(v_cache, table, num_blocks, q.dtype, slot="v")[:, :, :ctx]
        qi = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if n == ctx:
            mask, causal = None, True  # no cached prefix: plain causal lets SDPA take its fastest path
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=hq != hkv
        )
        out[lo:hi] = o[0].transpose(0, 1)
    return out
