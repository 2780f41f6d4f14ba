"""Turn paged K/V into dense per-sequence tensors (shared by the reference attentions)."""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache [N, bs, H, D], block_tables [B, >=num_blocks] -> [B, H, num_blocks*bs, D] (one index_select)."""
    n, bs, h, d = cache.shape
    b = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    dense = cache.index_select(0, ids).view(b, num_blocks * bs, h, d)
    return dense.transpose(1, 2)
