"""Reference reshape-and-cache: scatter new tokens' K/V into the paged cache by slot."""

from __future__ import annotations

import torch


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # view (not reshape): a copy would silently drop the writes.
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))
