"""The model's single call site into the paged-attention kernels, and the per-step forward context it reads.

`ucm_kernels` picks Triton for CUDA tensors and, on CPU, the native C kernel (ucm_kernels/cpu/, built on first use) or,
where it cannot run, the torch path (`UCM_ATTENTION_BACKEND` and `UCM_CPU_ATTENTION` force one).

The model runner sets a `ForwardContext` around each step's forward (`set_forward_context`, as vLLM does): the
step's attention metadata, the worker-side connector's per-layer hooks and which rows are generated tokens.
Every attention layer (and bf16 matmul) fetches it here, so none of them travels through the models' `forward`
signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch

import ucm_kernels
from engine.generated_rows import GeneratedRows
from ucm_kernels.attention_metadata import AttentionMetadata


class LayerHooks(Protocol):
    """The worker-side connector's per-layer calls (connector/base.py `KVConnectorWorker`, steps 6)."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(
        self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None: ...


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    layer_hooks: LayerHooks | None = None  # None: no connector, or none bound in this step
    generated_rows: GeneratedRows | None = None  # None: every row a prompt row (engine/models/dense.py)
    # Called before each decoder layer after the first: a long prompt step's thread count follows the thread governor
    # within the step (engine/engine_core.py), not only at its start.
    between_layers: Callable[[], None] | None = None


# A ContextVar rather than a module global: engines in different threads each see their own step.
_forward_context: ContextVar[ForwardContext | None] = ContextVar("forward_context", default=None)


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata,
    layer_hooks: LayerHooks | None = None,
    generated_rows: GeneratedRows | None = None,
    between_layers: Callable[[], None] | None = None,
) -> Iterator[ForwardContext]:
    """The context of one forward pass; restored to the enclosing one (normally none) on exit."""
    context = ForwardContext(attn_metadata, layer_hooks, generated_rows, between_layers)
    token = _forward_context.set(context)
    try:
        yield context
    finally:
        _forward_context.reset(token)


def current_forward_context() -> ForwardContext | None:
    """The running forward pass's context, or None outside one (a matmul may run outside a step: logits)."""
    return _forward_context.get()


def get_forward_context() -> ForwardContext:
    context = _forward_context.get()
    assert context is not None, "attention ran outside set_forward_context (the model runner sets it per step)"
    return context


def paged_attention_forward(
    layer_index: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write this step's k/v [T, Hkv, D] into layer `layer_index`'s paged cache, then attend q [T, Hq, D] over
    it -> [T, Hq, D]. The connector's load of this layer is waited for first; its save starts once the new
    K/V is in the cache."""
    context = get_forward_context()
    hooks, attn_metadata = context.layer_hooks, context.attn_metadata
    if hooks is not None:
        hooks.wait_for_layer_load(layer_index)
    ucm_kernels.write_kv(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
    out = ucm_kernels.paged_attention(q, k_cache, v_cache, attn_metadata, scale)
    if hooks is not None:
        hooks.save_kv_layer(layer_index, k_cache, v_cache, attn_metadata)
    return out
