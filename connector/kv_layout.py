"""Block <-> bytes for one layer: a block's payload is its K then its V, `[2, block_size, num_kv_heads, head_dim]`.

The store sees opaque bytes; this module is the only place that knows the layout (bump
`common.keys.KV_LAYOUT_VERSION` when it changes). Staging buffers live in host memory (the store's shared memory for
a CPU cache, pinned memory for a CUDA one) and are reused from step to step: a save or load is always finished
within the step that started it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from connector.row_copy import copy_rows
from connector.staging_rows import StagingRows
from ucm_kernels import gather_blocks, scatter_blocks


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_caches(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVLayout:
        if not kv_caches:
            raise ValueError("kv_caches is empty: expected one (k_cache, v_cache) pair per layer")
        k0, _v0 = kv_caches[0]
        for i, (k, v) in enumerate(kv_caches):
            if k.dim() != 4 or k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype:
                raise ValueError(
                    f"layer {i}: caches {tuple(k.shape)}/{tuple(v.shape)} differ from layer 0 {tuple(k0.shape)}"
                )
            if not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError(f"layer {i}: paged caches must be contiguous")
        _, bs, h, d = k0.shape
        return cls(len(kv_caches), int(bs), int(h), int(d), k0.dtype, k0.device)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class StagingBuffer:
    """Growable host staging of payloads, seen both as bytes (for the store) and as typed blocks.

    `alloc`: where the memory comes from (`KVStore.staging_buffer` for a cache on the CPU: a store daemon on this
    host then reads saves and writes loads there itself); a CUDA cache stages through pinned private memory."""

    def __init__(self, layout: KVLayout, alloc: Callable[[int], memoryview] | None = None) -> None:
        self._layout = layout
        pin = layout.device.type == "cuda"
        self._rows = StagingRows(layout.payload_nbytes, None if pin else alloc, pin=pin)

    def reserve(self, n: int) -> None:
        self._rows.rows(n)

    def blocks(self, n: int) -> torch.Tensor:
        """`[n, 2, block_size, num_kv_heads, head_dim]` view of the first n payloads."""
        lay = self._layout
        return self._rows.rows(n).view(lay.dtype).view(n, *lay.block_shape)

    def memoryviews(self, n: int) -> list[memoryview]:
        """One writable memoryview per payload (what the store reads from or writes into)."""
        return self._rows.memoryviews(n)


# Up to this many runs of consecutive blocks, slice copies straight into the staging rows beat one gather and a
# copy; past it a gather wins. A 2-core Zen 5 EPYC, SmolLM2's 30 layers of 6 KiB K and V blocks, 32 blocks: 0.71 vs
# 1.12 ms in 1 run, 1.04 vs 1.08 in 2, 1.60 vs 1.20 in 4, 6.6 vs 1.26 scattered (as a full cache evicts them).
_SLICE_RUNS = 2


def _runs(ids: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(ids) if b != a + 1) + (1 if ids else 0)


def pack_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, out: StagingBuffer, first_row: int = 0
) -> None:
    """Copy blocks `block_ids` of one layer into rows `first_row...` of `out` (so the cache may be overwritten
    right after)."""
    n = int(block_ids.numel())
    out.reserve(first_row + n)
    dst = out.blocks(first_row + n)[first_row:]
    ids = block_ids.tolist() if k_cache.device.type == "cpu" else None
    if ids is not None and _runs(ids) <= _SLICE_RUNS:  # straight into the staging rows
        rows = list(range(n))
        copy_rows(dst[:, 0], rows, k_cache, ids)
        copy_rows(dst[:, 1], rows, v_cache, ids)
        return
    dst[:, 0].copy_(gather_blocks(k_cache, block_ids))
    dst[:, 1].copy_(gather_blocks(v_cache, block_ids))


def unpack_blocks(
    src: StagingBuffer,
    rows: torch.Tensor,
    n: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
) -> None:
    """Write payload rows `rows` (of the first n) of `src` into cache blocks `block_ids` of one layer."""
    staged = src.blocks(n)
    if rows.numel() != n:
        staged = staged.index_select(0, rows)
    device = k_cache.device
    if device.type != "cpu":  # one host-to-device copy of K and V together
        staged = staged.to(device, non_blocking=True)
        block_ids = block_ids.to(device, non_blocking=True)
    k, v = staged[:, 0], staged[:, 1]
    if device.type != "cpu":  # the Triton kernel wants dense rows; the torch path takes strided views as they are
        k, v = k.contiguous(), v.contiguous()
    scatter_blocks(k, k_cache, block_ids)
    scatter_blocks(v, v_cache, block_ids)
