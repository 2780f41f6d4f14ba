"""RMSNorm exactly as HF's Llama computes it (fp32 inside, cast back, then scaled), optionally with the
residual add before it fused in (vLLM's layout: see DecoderLayer)."""

from __future__ import annotations

import torch
from torch import nn

from ucm_kernels.api import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with a residual, norm(residual + x) and the sum left in `residual` (updated in place)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
