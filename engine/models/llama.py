"""Llama-family causal LM (Llama, SmolLM2, Mistral, Qwen2) reading and writing a paged KV cache.

All tokens of all sequences in a step are packed along one axis; per-layer work is a handful of big matmuls
(fused QKV, fused gate/up), one call into the paged-attention kernels and three fused elementwise kernels.

The residual stream is carried beside the hidden states as vLLM does: each residual add happens inside the
norm that follows it (layer i's post-attention norm, layer i+1's input norm, the final norm), which is the
same sum in the same order as `h = h + sublayer(norm(h))`, so results do not change, only the op count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import current_forward_context
from engine.generated_rows import GeneratedRows, RowSubset
from engine.model_config import ModelConfig
from engine.models.decoder_layer import DecoderLayer
from engine.models.dense import DecodePanels, Packed, dense, f32_layer_choice, lm_head_panels, pack_weight
from engine.models.native_decode import NativeDecode
from engine.models.rmsnorm import RMSNorm
from engine.models.rope import RotaryEmbedding


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        self.lm_head_packed: Packed = None
        self.native_decode: NativeDecode | None = None  # set by pack_weights where it applies
        self._lm_head_decode: DecodePanels | None = None  # the lm_head's Q8_0 panels (derive_decode_panels)

    def pack_weights(self) -> None:
        """Pre-pack the matmul weights for the CPU backend (see engine/models/dense.py); call once the weights
        are loaded and on their final device/dtype. The packed copies add the matmul weights' size in memory, or take
        a layer weight's place where they take every call (`release_if_unread`)."""
        layers = self.decoder_layers()
        # fp32: the layers' prefill-sized matmuls through one library where switching between them costs time
        layer_calls = f32_layer_choice(layers[0].matmul_weights()) if layers else None
        for layer in layers:
            layer.attn.pack_weights(layer_calls)
            layer.mlp.pack_weights(layer_calls)
        self.lm_head_packed = pack_weight(self.lm_head_weight, self._lm_head_decode)
        self.native_decode = NativeDecode.build(self, layers)

    def decoder_layers(self) -> list[DecoderLayer]:
        """self.layers, typed."""
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        assert len(layers) == len(self.layers), "layers holds DecoderLayers only"
        return layers

    def derive_decode_panels(self) -> None:
        """Each layer's decode panels and the lm_head's (dense.py): 4-bit and 8-bit ones while the model is fp32, before
        casting it to bf16; bf16 ones once it is bf16."""
        for layer in self.decoder_layers():
            layer.attn.derive_decode_panels()
            layer.mlp.derive_decode_panels()
        self._lm_head_decode = lm_head_panels(self.lm_head_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 (packed) -> final-normed hidden states [T, hidden], or only rows `keep`
        (int64 indices, in that order) where given. Runs inside `engine.attention.set_forward_context` (the step's
        attention metadata and connector hooks).

        With `keep` (the rows a step samples: a prompt's last token, each decode) the last layer runs its o
        projection, MLP and final norm on those rows alone: no other row's output is ever read, and its k and v,
        which are, come before them. On SmolLM2 that is 84% of a layer's matmul FLOPs, 2.8% of a prompt's."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} (k, v) cache pairs, got {len(kv_caches)}")
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]")
        h = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        step = self.native_decode.plan(input_ids.shape[0], kv_caches) if self.native_decode is not None else None
        if step is not None:
            assert self.native_decode is not None, "a step plan comes from the native decode path"
            hidden = self.native_decode.forward(step, h, cos, sin, kv_caches)
            return hidden if keep is None else hidden.index_select(0, keep)
        layers = self.decoder_layers()
        if not layers:
            return self.norm(h if keep is None else h.index_select(0, keep))
        context = current_forward_context()
        subset = None if keep is None else RowSubset.of(keep, context.generated_rows if context else None)
        residual: torch.Tensor | None = None
        between = context.between_layers if context is not None else None
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if i and between is not None:
                between()
            h, residual = layer(h, residual, cos, sin, kv_cache, subset if i == len(layers) - 1 else None)
        assert residual is not None, "a layer returns the residual stream"
        return self.norm(h, residual) if h.shape[0] else h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (only the rows being sampled) -> float32 logits [N, vocab]. A bf16 lm_head with Q8_0
        panels (the embedded model's tied embedding is exactly Q8_0) sends every sampled row through the 8-bit
        kernel, a prompt's last row as well as a generated one: it reads half the bf16 copy's bytes (one row on the
        Xeon with AMX: 1.46 against 2.56 ms), a step that samples both classes no longer runs both paths, and the
        kernel is row-invariant, so a row's logits still do not depend on its step."""
        n = hidden.shape[0]  # every row in the generated class: `dense` sends it to the panels where there are any
        return dense(hidden, self.lm_head_weight, None, self.lm_head_packed, GeneratedRows(n, n, None)).float()
