"""SwiGLU MLP with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from engine.generated_rows import GeneratedRows
from engine.models.dense import (
    DecodePanels,
    LayerCalls,
    Packed,
    decode_panels,
    dense,
    dense_silu_and_mul,
    pack_weight,
    release_if_unread,
)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # rows [0, I) = gate_proj, rows [I, 2I) = up_proj
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.gate_up_bias = nn.Parameter(torch.empty(2 * intermediate_size)) if bias else None
        self.down_weight = nn.Parameter(torch.empty(hidden_size, intermediate_size))
        self.down_bias = nn.Parameter(torch.empty(hidden_size)) if bias else None
        self.gate_up_packed: Packed = None
        self.down_packed: Packed = None
        self._decode: dict[str, DecodePanels | None] = {}

    def derive_decode_panels(self) -> None:
        """A bf16 model's decode panels, if any: 4-bit ones while the weights are still fp32 (being loaded), bf16 ones
        of bf16 weights (dense.decode_panels)."""
        self._decode = {"gate_up": decode_panels(self.gate_up_weight), "down": decode_panels(self.down_weight)}

    def pack_weights(self, layer: LayerCalls | None = None) -> None:
        self.gate_up_packed = pack_weight(self.gate_up_weight, self._decode.get("gate_up"), gate_up=True, layer=layer)
        self.down_packed = pack_weight(self.down_weight, self._decode.get("down"), layer=layer)
        release_if_unread(self, "gate_up_weight", self.gate_up_packed)
        release_if_unread(self, "down_weight", self.down_packed)

    def forward(self, x: torch.Tensor, rows: GeneratedRows | None = None) -> torch.Tensor:
        """`rows`: x's rows' classes where x is not the step's every row (dense takes the forward context's)."""
        h = dense_silu_and_mul(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed, rows)
        return dense(h, self.down_weight, self.down_bias, self.down_packed, rows)
