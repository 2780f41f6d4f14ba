"""Test support: random paged batches and a naive dense attention oracle (no SDPA, no paging)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCase:
    """A packed batch whose context K/V sit both dense (per sequence) and paged (in the caches)."""

    q: torch.Tensor  # [T, Hq, D] packed new tokens
    k_cache: torch.Tensor  # [N, bs, Hkv, D]
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [L, Hkv, D]
    values: list[torch.Tensor]
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int


def make_paged_case(
    ctx_lens: list[int],
    query_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    device: str | torch.device = "cpu",
) -> PagedCase:
    """Random K/V scattered into shuffled (non-contiguous, non-monotonic) block ids; block 0 left as garbage."""
    assert len(ctx_lens) == len(query_lens), "one query length per sequence"
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for i, (n, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        mine = [ids.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(mine, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(n):
            k_cache[mine[t // block_size], t % block_size] = k[t]
            v_cache[mine[t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)
    total_q = sum(query_lens)
    q = torch.randn(total_q, num_q_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    dev = torch.device(device)
    return PagedCase(
        q=q.to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        keys=[k.to(dev) for k in keys],
        values=[v.to(dev) for v in values],
        query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev),
        max_query_len=max(query_lens),
        max_seq_len=max(ctx_lens),
    )


def naive_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], query_lens: list[int], scale: float
) -> torch.Tensor:
    """Textbook causal softmax attention in float64 on dense per-sequence tensors -> [T, Hq, D] (float64)."""
    outs = []
    start = 0
    for k, v, n in zip(keys, values, query_lens):
        qi = q[start : start + n].double()  # [n, Hq, D]
        start += n
        ctx = k.shape[0]
        group = qi.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", qi, kk) * scale
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        allowed = torch.arange(ctx)[None, :] <= q_pos  # [n, L]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv))
    return torch.cat(outs)
