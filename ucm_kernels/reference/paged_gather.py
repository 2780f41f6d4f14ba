"""Turn paged K/V into dense per-sequence tensors (shared by the reference attentions)."""

from __future__ import annotations

import threading

import torch

# Per-thread scratch buffers for the gathered context on CPU. Fresh multi-MB allocations there come back from
# the OS each call and pay a page fault per 4 KiB on first touch (measured 2-10x the cost of the copy itself);
# a gathered context never outlives the attention call that made it, so one buffer per slot and dtype suffices.
_scratch = threading.local()


def _scratch_rows(slot: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty((rows, cols), dtype=dtype, device=device)  # the CUDA caching allocator already reuses
    buffers: dict = _scratch.__dict__.setdefault("buffers", {})
    key = (slot, dtype)
    buf = buffers.get(key)
    # A buffer made under inference_mode is an inference tensor, which may not be written outside it (a start-up
    # calibration measures under inference_mode, callers after it need not); a normal one serves both.
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.numel() < rows * cols:
        buf = torch.empty(rows * cols, dtype=dtype)
        buffers[key] = buf
    return buf[: rows * cols].view(rows, cols)


def gather_context(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: int,
    dtype: torch.dtype | None = None,
    slot: str = "k",
) -> torch.Tensor:
    """cache [N, bs, H, D], block_tables [B, >=num_blocks] -> [B, H, num_blocks*bs, D], optionally cast to dtype.

    On CPU the result lives in this thread's scratch buffer named `slot`: it is valid until the next gather into
    the same slot, so gather K and V into different slots and use them before gathering again.
    """
    n, bs, h, d = cache.shape
    b = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    # Row-wise index_select on a 2-D view, into a preallocated out: on CPU both are several times faster
    # (fp32 index_select without out= measured ~10x slower).
    rows = _scratch_rows(slot, ids.shape[0], bs * h * d, cache.dtype, cache.device)
    torch.index_select(cache.reshape(n, bs * h * d), 0, ids, out=rows)
    if dtype is not None and dtype != cache.dtype:
        cast = _scratch_rows(slot + ":cast", ids.shape[0], bs * h * d, dtype, cache.device)
        rows = cast.copy_(rows)
    return rows.view(b, num_blocks * bs, h, d).transpose(1, 2)
