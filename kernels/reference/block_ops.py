"""Reference block gather / scatter (connector staging) and block copy (copy-on-write)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gather_blocks_torch(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, H, D] -> contiguous [n, bs, H, D] holding blocks block_ids [n]."""
    return cache.index_select(0, block_ids.to(cache.device).long())


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
