"""A vLLM per-layer KV cache seen as `[num_blocks, page_bytes]` rows of opaque bytes.

vLLM-CPU's cache for one layer is `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, and how K and V sit
inside a block depends on the instruction set its attention kernels were built for. We never look inside: a
block is moved whole, as bytes, and the key namespace names the layout (key_scope.py). Any dense layout whose
outermost dimension is the block works, including kernel blocks smaller than vLLM's block (their rows are
consecutive).
"""

from __future__ import annotations

import torch


def block_rows(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A uint8 `[num_blocks, page_bytes]` view of `cache`'s memory (writes go to the cache)."""
    if num_blocks <= 0 or cache.dim() < 2:
        raise ValueError(f"expected a paged cache with num_blocks > 0, got shape {tuple(cache.shape)} / {num_blocks}")
    itemsize = cache.element_size()
    nbytes = cache.numel() * itemsize
    if nbytes % num_blocks or cache.shape[0] % num_blocks:
        raise ValueError(f"cache of shape {tuple(cache.shape)} does not split into {num_blocks} blocks")
    dims = sorted((cache.stride(d), cache.shape[d]) for d in range(cache.dim()) if cache.shape[d] > 1)
    expect = 1
    for stride, size in dims:  # dense: some permutation of a contiguous layout
        if stride != expect:
            raise ValueError(f"cache of shape {tuple(cache.shape)}, strides {cache.stride()} is not dense")
        expect *= size
    if cache.stride(0) * cache.shape[0] != cache.numel():
        raise ValueError(f"cache strides {cache.stride()}: the block dimension must be outermost")
    page = nbytes // num_blocks
    rows = torch.empty(0, dtype=torch.uint8, device=cache.device)
    rows.set_(cache.untyped_storage(), cache.storage_offset() * itemsize, (num_blocks, page), (page, 1))
    return rows
