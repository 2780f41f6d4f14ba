"""The paged KV cache tensors, sized from a byte budget: per layer K and V `[num_blocks, block_size, Hkv, D]`."""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def num_blocks_for_budget(budget_bytes: int, model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_block = model_config.kv_bytes_per_block(block_size, dtype)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={budget_bytes} bytes holds no KV block: one block of {block_size} tokens needs "
            f"{per_block} bytes ({model_config.num_layers} layers, {model_config.num_kv_heads} KV heads, "
            f"head dim {model_config.head_dim}, {dtype})"
        )
    return int(num_blocks)


def allocate_kv_caches(
    num_blocks: int, model_config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> KVCaches:
    shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    # Zeroed, not empty: a slot read before it is written (never in correct operation) then gives 0, not NaN.
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(model_config.num_layers)
    ]
