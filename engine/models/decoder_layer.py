"""One decoder layer of the Llama family: input norm, paged self-attention, post-attention norm, gated MLP, with the
residual stream carried between layers (engine/models/llama.py stacks them; native_decode.py runs them in C)."""

from __future__ import annotations

import torch
from torch import nn

from engine.generated_rows import RowSubset
from engine.model_config import ModelConfig
from engine.models.attention_layer import PagedSelfAttention
from engine.models.mlp import GatedMLP
from engine.models.rmsnorm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = PagedSelfAttention(config, layer_index)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def matmul_weights(self) -> list[torch.Tensor]:
        """The layer's matmul weights in the order its forward calls them."""
        return [self.attn.qkv_weight, self.attn.o_weight, self.mlp.gate_up_weight, self.mlp.down_weight]

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        keep: RowSubset | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this layer's MLP output, the residual stream before adding it).

        The residual stream is the previous layer's input plus its two sublayer outputs; its last add (the
        previous MLP output, h) happens in this layer's input norm. Layer 0 gets the embeddings and None.
        `keep`: past the attention only these rows (both outputs have them alone); every row's k and v are cached."""
        if residual is None:
            residual = h
            x = self.input_norm(h)
        else:
            x = self.input_norm(h, residual)
        x = self.attn(x, cos, sin, kv_cache, keep)
        if keep is not None:
            residual = residual.index_select(0, keep.index)
            if keep.index.numel() == 0:
                return x, residual
        x = self.post_attn_norm(x, residual)
        return self.mlp(x, keep.rows if keep is not None else None), residual
