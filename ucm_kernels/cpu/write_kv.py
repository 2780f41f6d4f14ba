"""Python side of `ucm_write_kv` (paged_attention.c): this step's K/V rows copied into their cache slots.

The torch reference (`write_kv_torch`) masks, compacts and index_copies: about 60 us a call for a 32-token
decode step, 30 times a step; the C loop is two memcpy per token.
"""

from __future__ import annotations

import torch

from ucm_kernels.cpu.native import NativeLib


def _token_rows(t: torch.Tensor) -> bool:
    """Each token's [Hkv, D] is one contiguous run (the model hands over views into its fused qkv output)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def supports(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        key.device.type == "cpu"
        and key.dtype == value.dtype == k_cache.dtype
        and _token_rows(key)
        and _token_rows(value)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def write_kv_native(
    lib: NativeLib,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`ucm_kernels.write_kv`'s contract (slot -1 skips); the caller checked shapes and `supports`."""
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
    esize = key.element_size()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = lib.write_kv(
        key.data_ptr(), key.stride(0) * esize, value.data_ptr(), value.stride(0) * esize,
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0], num_slots,
        key.shape[1] * key.shape[2] * esize, torch.get_num_threads(),
    )  # fmt: skip
    if bad:
        raise slot_error(slot_mapping, bad, num_slots)


def slot_error(slot_mapping: torch.Tensor, bad: int, num_slots: int) -> ValueError:
    """The error for the kernel's non-zero return `bad` (1 + the first token whose slot is outside the cache)."""
    slot = int(slot_mapping[bad - 1])
    return ValueError(f"write_kv: token {bad - 1} has slot {slot}, outside the cache's {num_slots} slots (-1 skips)")
