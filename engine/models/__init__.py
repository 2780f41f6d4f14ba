"""Model implementations. Every supported architecture (Llama, SmolLM2, Mistral, Qwen2) is the Llama block;
Qwen2's qkv bias, GQA and RoPE scaling are switches in `ModelConfig`."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
