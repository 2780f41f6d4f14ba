"""Triton block gather / scatter between one layer's paged cache and a contiguous staging buffer (connector I/O)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm_kernels.reference.block_ops import gather_blocks_torch, scatter_blocks_torch
from ucm_kernels.triton_support import INDEX_DTYPES, check_block_contiguous

__all__ = ["gather_blocks_torch", "gather_blocks_triton", "scatter_blocks_torch", "scatter_blocks_triton"]

_CHUNK = 1024  # elements per program: one block of 16 x 8 x 128 bf16 is 16 programs of 2 KiB


@triton.jit
def _block_transfer_kernel(
    cache_ptr,
    staging_ptr,
    block_ids_ptr,
    cache_stride_block,
    BLOCK_ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
    TO_STAGING: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    cache_at = cache_ptr + block * cache_stride_block + offs
    staging_at = staging_ptr + i * BLOCK_ELEMS + offs
    if TO_STAGING:
        tl.store(staging_at, tl.load(cache_at, mask=mask), mask=mask)
    else:
        tl.store(cache_at, tl.load(staging_at, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)


def _check(cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor) -> None:
    check_block_contiguous("block transfer", cache)
    bs, h, d = cache.shape[1:]
    if not staging.is_contiguous() or staging.shape != (block_ids.shape[0], bs, h, d):
        raise ValueError(f"block transfer: staging must be contiguous [n, {bs}, {h}, {d}], got {tuple(staging.shape)}")
    if block_ids.device != cache.device or block_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"block transfer: block_ids must be int32/int64 on {cache.device}")


def _launch(cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor, to_staging: bool) -> None:
    n = block_ids.shape[0]
    if n == 0:
        return
    elems = cache[0].numel()
    grid = (n, triton.cdiv(elems, _CHUNK))
    _block_transfer_kernel[grid](
        cache, staging, block_ids, cache.stride(0), BLOCK_ELEMS=elems, CHUNK=_CHUNK, TO_STAGING=to_staging
    )


def gather_blocks_triton(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [N, bs, H, D] -> out [n, bs, H, D] (new, or the given contiguous staging buffer)."""
    block_ids = block_ids.to(cache.device)
    if out is None:
        out = torch.empty((block_ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    if out.dtype != cache.dtype:
        raise ValueError(f"gather_blocks: out dtype {out.dtype} != cache dtype {cache.dtype}")
    _check(cache, out, block_ids)
    _launch(cache, out, block_ids, to_staging=True)
    return out


def scatter_blocks_triton(src: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Contiguous src [n, bs, H, D] -> cache blocks block_ids [n] (cast to the cache dtype)."""
    block_ids = block_ids.to(cache.device)
    _check(cache, src, block_ids)
    _launch(cache, src, block_ids, to_staging=False)
