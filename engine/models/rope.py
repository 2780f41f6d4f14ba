"""Rotary position embedding (rotate-half layout, as in HF checkpoints) with plain, linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import RopeScaling, RopeType


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies after scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type is RopeType.LINEAR:
        return inv_freq / scaling.factor
    if scaling.rope_type is RopeType.LLAMA3:
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [T, 1, head_dim], for positions [T]; fp32 math then cast, as HF does.

        HF rotates with x*cos + cat(-x2, x1)*sin. The sign goes into sin here ([-sin | sin]), which is exact
        in floating point and saves a negation per layer; `ucm_kernels.api.rotary_embedding_` applies them."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return (
            torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
            torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype),
        )
