"""Reference block gather / scatter (connector staging) and block copy (copy-on-write)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gather_blocks_torch(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [N, bs, H, D] -> contiguous [n, bs, H, D] holding blocks block_ids [n] (into out when given)."""
    ids = block_ids.to(cache.device).long()
    n = ids.shape[0]
    if out is None:
        out = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    if out.shape != (n, *cache.shape[1:]) or not out.is_contiguous() or out.dtype != cache.dtype:
        raise ValueError(f"gather_blocks: out must be contiguous {cache.dtype} [{n}, ...], got {tuple(out.shape)}")
    # Row-wise index_select on 2-D views: ~2x faster on CPU than on the 4-D tensor, and no extra copy into out.
    rows = cache.view(cache.shape[0], -1) if cache.is_contiguous() else cache.reshape(cache.shape[0], -1)
    torch.index_select(rows, 0, ids, out=out.view(n, -1))
    return out


def scatter_blocks_torch(src: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write src [n, bs, H, D] into cache blocks block_ids [n]."""
    cache.index_copy_(0, block_ids.to(cache.device).long(), src.to(cache.dtype))


def copy_blocks_torch(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """For every layer's (k_cache, v_cache): block dst[i] <- block src[i] (sources read before any write)."""
    for k_cache, v_cache in kv_caches:
        src = src_block_ids.to(k_cache.device).long()
        dst = dst_block_ids.to(k_cache.device).long()
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
