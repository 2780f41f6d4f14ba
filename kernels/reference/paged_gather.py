"""Turn paged K/V into dense per-sequence tensors (shared by the reference attentions)."""

from __future__ import annotations

import torch


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """cache [N, bs, H, D], block_tables [B, >=num_blocks] -> [B, H, num_blocks*bs, D], optionally cast to dtype."""
    n, bs, h, d = cache.shape
    b = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    # Row-wise index_select on a 2-D view, into a preallocated out: on CPU both are several times faster
    # (fp32 index_select without out= measured ~10x slower).
    rows = torch.empty((ids.shape[0], bs * h * d), dtype=cache.dtype, device=cache.device)
    torch.index_select(cache.reshape(n, bs * h * d), 0, ids, out=rows)
    if dtype is not None:
        rows = rows.to(dtype)
    return rows.view(b, num_blocks * bs, h, d).transpose(1, 2)
