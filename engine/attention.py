"""The model's single call site into the paged-attention kernels, so the backend can switch in one place.

`kernels` picks Triton for CUDA tensors and, on CPU, the native C kernel (kernels/cpu/, built on first use) or,
where it cannot run, the torch path (`UCM_ATTENTION_BACKEND` and `UCM_CPU_ATTENTION` force one).
"""

from __future__ import annotations

import torch

import kernels
from kernels.attention_metadata import AttentionMetadata


def paged_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's k/v [T, Hkv, D] into the paged cache, then attend q [T, Hq, D] over it -> [T, Hq, D]."""
    kernels.write_kv(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
    return kernels.paged_attention(q, k_cache, v_cache, attn_metadata, scale)
