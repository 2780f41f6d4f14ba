"""Row copies by slices: what ucm-serve's connector and the vLLM plugin use to move KV blocks on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_rows(dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]) -> None:
    """`dst[dst_rows[k]] = src[src_rows[k]]` for every k, one slice copy per run of consecutive rows in both.

    Not `index_copy_`: on uint8 rows of a few hundred KiB it moves well under 1 GB/s (3.7 ms per layer of 16
    blocks of 192 KiB on a 2-core EPYC, against 0.15 ms for a slice copy), which made a 2048-token load
    spend ~120 ms copying out of staging.
    """
    assert len(dst_rows) == len(src_rows), "one source row per destination row"
    k, n = 0, len(dst_rows)
    while k < n:
        end = k + 1
        while end < n and dst_rows[end] == dst_rows[end - 1] + 1 and src_rows[end] == src_rows[end - 1] + 1:
            end += 1
        dst[dst_rows[k] : dst_rows[k] + end - k].copy_(src[src_rows[k] : src_rows[k] + end - k])
        k = end
