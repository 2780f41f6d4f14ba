"""A decode step's forward on CPU with the per-op Python taken out: the same native kernels, called directly.

A decode step of 8 rows on SmolLM2 runs ~290 us of kernels a layer, and the generic forward added ~100 us a layer
around them (module calls, `kernels.api`'s checks and dispatch per call, the matmuls' row routing): 2.9 of 15.3 ms
a step on the 2-core Zen 5 EPYC. Here a step decides once what the generic path decides on every call (which
kernels run, the threads, the metadata as int32) and then calls the C kernels' Python wrappers in the order
`DecoderLayer.forward` does, so every row gets the same bits as there (tests/engine/test_native_decode.py).

It takes only the steps where that equality is plain to keep: every row a generated token (a decode; a one-token
prompt chunk is a prompt row and goes generic), no connector hooks bound, and the CPU path running its native
kernels for the step's ops (`kernels.api.native_ops_lib`, `native_decode_lib`). Anything else runs the generic
forward. A matmul this step cannot call directly (no 4-bit panels, a bias, fp32's packed copies) goes through
`dense` as the generic path does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention import current_forward_context
from engine.models.dense import BF16Packed, Packed, dense
from kernels.api import native_decode_lib, native_ops_lib
from kernels.cpu import elementwise, q4_bf16
from kernels.cpu import write_kv as native_write
from kernels.cpu.native import NativeLib
from kernels.cpu.paged_attention import paged_attention_native

if TYPE_CHECKING:
    from engine.models.llama import DecoderLayer, LlamaForCausalLM


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step's layers share: the library, and its metadata in the kernels' types."""

    lib: NativeLib
    seq_lens: torch.Tensor  # int32
    block_tables: torch.Tensor  # int32
    slot_mapping: torch.Tensor  # int64


class NativeDecode:
    """The decode-step forward of one `LlamaForCausalLM` (built with its packed weights; see the module doc)."""

    def __init__(self, model: LlamaForCausalLM, layers: list[DecoderLayer]) -> None:
        self.model = model
        self.layers = layers  # model.layers, typed
        self.steps = 0  # decode steps run here (tests check that this path ran)

    @classmethod
    def build(cls, model: LlamaForCausalLM, layers: list[DecoderLayer]) -> NativeDecode | None:
        """For a CPU model whose norm weights the elementwise kernels take as they are; else None (generic)."""
        dtype = model.embed_tokens.dtype
        norms = [model.norm, *(n for layer in layers for n in (layer.input_norm, layer.post_attn_norm))]
        if model.embed_tokens.device.type != "cpu" or dtype not in elementwise.NATIVE_DTYPES or not layers:
            return None
        if any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
            return None
        return cls(model, layers)

    def plan(self, num_tokens: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodeStep | None:
        """This step's shared operands, or None when it takes the generic forward."""
        context = current_forward_context()
        if context is None or context.layer_hooks is not None:
            return None
        rows, md = context.generated_rows, context.attn_metadata
        if rows is None or rows.count != rows.total or not md.is_decode_only or md.num_seqs != num_tokens:
            return None
        config = self.model.config
        k_cache, v_cache = kv_caches[0]
        dtype = self.model.embed_tokens.dtype
        if k_cache.device.type != "cpu" or native_ops_lib() is None:
            return None
        q_like = torch.empty((1, config.num_heads, config.head_dim), dtype=dtype)
        kv_like = torch.empty((1, config.num_kv_heads, config.head_dim), dtype=dtype)
        lib = native_decode_lib(q_like, k_cache, v_cache)
        if lib is None or not native_write.supports(kv_like, kv_like, k_cache, v_cache):
            return None
        return DecodeStep(
            lib,
            md.seq_lens.to(torch.int32).contiguous(),
            md.block_tables.to(torch.int32).contiguous(),
            md.slot_mapping.to(torch.int64).contiguous(),
        )

    def forward(
        self,
        step: DecodeStep,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """`LlamaForCausalLM.forward` after the embedding and RoPE tables, for a step `plan` accepted."""
        model, lib = self.model, step.lib
        config = model.config
        tokens = h.shape[0]
        q_size, kv_size = config.q_size, config.kv_size
        residual = h
        first = self.layers[0].input_norm
        x = elementwise.rms_norm_native(lib, h, first.weight, first.eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i:
                x = elementwise.fused_add_rms_norm_native(
                    lib, h, residual, layer.input_norm.weight, layer.input_norm.eps
                )
            attn = layer.attn
            qkv = _matmul(x, attn.qkv_weight, attn.qkv_bias, attn.qkv_packed)
            qk = qkv[:, : q_size + kv_size].view(tokens, config.num_heads + config.num_kv_heads, config.head_dim)
            elementwise.rotary_embedding_native(lib, qk, cos, sin)
            q, k = qk.split((config.num_heads, config.num_kv_heads), dim=1)
            v = qkv[:, q_size + kv_size :].view(tokens, config.num_kv_heads, config.head_dim)
            native_write.write_kv_native(lib, k, v, k_cache, v_cache, step.slot_mapping)
            out = paged_attention_native(lib, q, k_cache, v_cache, None, step.seq_lens, step.block_tables, attn.scale)
            o = _matmul(out.view(tokens, q_size), attn.o_weight, attn.o_bias, attn.o_packed)
            post = layer.post_attn_norm
            x = elementwise.fused_add_rms_norm_native(lib, o, residual, post.weight, post.eps)
            mlp = layer.mlp
            gate_up = _matmul(x, mlp.gate_up_weight, mlp.gate_up_bias, mlp.gate_up_packed)
            h = _matmul(elementwise.silu_and_mul_native(lib, gate_up), mlp.down_weight, mlp.down_bias, mlp.down_packed)
        self.steps += 1
        return elementwise.fused_add_rms_norm_native(lib, h, residual, model.norm.weight, model.norm.eps)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: Packed) -> torch.Tensor:
    """What `dense` does with a decode step's rows (all generated), minus its routing where the call is direct."""
    if isinstance(packed, BF16Packed) and packed.decode is not None and bias is None:
        return q4_bf16.linear(packed.decode.lib, x, packed.decode.panels)
    return dense(x, weight, bias, packed)
