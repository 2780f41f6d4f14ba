"""Self-attention over the paged KV cache: one fused QKV matmul, RoPE on q and k together, GQA."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import paged_attention_forward
from engine.generated_rows import RowSubset
from engine.model_config import ModelConfig
from engine.models.dense import DecodePanels, LayerCalls, Packed, decode_panels, dense, pack_weight, release_if_unread
from ucm_kernels.api import rotary_embedding_


class PagedSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        # rows: [q | k | v]
        self.qkv_weight = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, config.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size)) if config.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(config.hidden_size, self.q_size))
        self.o_bias = nn.Parameter(torch.empty(config.hidden_size)) if config.o_bias else None
        self.qkv_packed: Packed = None
        self.o_packed: Packed = None
        self._decode: dict[str, DecodePanels | None] = {}

    def derive_decode_panels(self) -> None:
        """A bf16 model's decode panels, if any: 4-bit ones while the weights are still fp32 (being loaded), bf16 ones
        of bf16 weights (dense.decode_panels)."""
        self._decode = {"qkv": decode_panels(self.qkv_weight), "o": decode_panels(self.o_weight)}

    def pack_weights(self, layer: LayerCalls | None = None) -> None:
        self.qkv_packed = pack_weight(self.qkv_weight, self._decode.get("qkv"), layer=layer)
        self.o_packed = pack_weight(self.o_weight, self._decode.get("o"), layer=layer)
        release_if_unread(self, "qkv_weight", self.qkv_packed)
        release_if_unread(self, "o_weight", self.o_packed)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        keep: RowSubset | None = None,
    ) -> torch.Tensor:
        """Every row's k and v go to the cache; the output (the o projection) is `keep`'s rows only, where given."""
        num_tokens = x.shape[0]
        qkv = dense(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # In place inside qkv: q and k go through together (one call), and stay views with qkv's token stride,
        # which the attention and write_kv kernels take as they are.
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        rotary_embedding_(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        # The step's attention metadata and connector hooks come from the forward context (engine/attention.py).
        out = paged_attention_forward(self.layer_index, q, k, v, k_cache, v_cache, self.scale)
        out = out.reshape(num_tokens, self.q_size)
        if keep is None:
            return dense(out, self.o_weight, self.o_bias, self.o_packed)
        picked = out.index_select(0, keep.index)
        if picked.shape[0] == 0:  # a step that samples nothing (a prompt's chunk): no matmul of no rows
            return picked.new_empty((0, self.hidden_size))
        return dense(picked, self.o_weight, self.o_bias, self.o_packed, keep.rows)
