"""`VllmKeyScope`: everything that must match for a block saved by one vLLM to be loadable by another.

A stored block is one vLLM cache block of one layer as opaque bytes, and the layout inside it depends on vLLM's
version, its attention backend and, on the CPU, the instruction set the backend picked (`vec`, `vec16`, `amx`,
`neon`...). So the layout tag names all of them, and the namespace also carries the TP rank and size (a rank
holds only its heads). The scope becomes `common.keys.KeyNamespace(model_fingerprint=<this text>, ...)`: a
ucm-serve engine's fingerprint is a bare content hash, so the two never share a root key (and never should:
their block layouts differ).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.keys import BlockKey, KeyNamespace, root_key


@dataclass(frozen=True)
class VllmKeyScope:
    model: str  # model_identity(...)
    dtype: str  # the KV cache's dtype, e.g. "float32" (or vLLM's kv_cache_dtype when quantized)
    block_size: int  # vLLM's block size: one stored block is one vLLM block
    layout_tag: str  # e.g. "vllm-0.32.0+cpu/CPU_ATTN/vec"
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside 0..{self.tp_size - 1}")
        if not self.model or not self.layout_tag:
            raise ValueError("model and layout_tag must be non-empty")

    @property
    def namespace(self) -> KeyNamespace:
        fingerprint = f"vllm|{self.model}|{self.layout_tag}|tp{self.tp_rank}of{self.tp_size}"
        return KeyNamespace(fingerprint, self.dtype, self.block_size)

    def root(self, cache_salt: str | None) -> BlockKey:
        return root_key(self.namespace, cache_salt)


def layout_tag(vllm_version: str, backend: str, isa: str) -> str:
    return f"vllm-{vllm_version}/{backend}/{isa}"
