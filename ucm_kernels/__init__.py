"""Paged-KV kernels: Triton on CUDA; on CPU native C kernels (attention, write_kv, fused norm/SiLU/RoPE) and the
pure-torch reference for the rest (`UCM_ATTENTION_BACKEND=torch|triton` forces the device path,
`UCM_CPU_ATTENTION=auto|native|torch` the CPU kernels; auto, the default, runs the attention path measured faster on
this machine).

Map (caches are per layer `[num_blocks, block_size, num_kv_heads, head_dim]`):
  api.py                       the entry points below: validate, then pick a backend per call from the device
  backend.py                   AttentionBackend {TORCH, TRITON}, CpuAttention {AUTO, NATIVE, TORCH}, the selection rules
  cpu/                         native CPU kernels (paged attention, write_kv, residual-add+RMSNorm, RMSNorm,
                               silu_and_mul, in-place RoPE, the fp32 skinny GEMM of decode steps): C sources
                               built on first use, ctypes wrappers; calibration.py times native vs torch
                               attention once per machine (auto dispatch), skinny_gemm.py the matmul rows
  reference/                   pure-torch implementations: the CPU fallback path and the test oracle
  triton_write_kv.py           reshape-and-cache (slot -1 skips)
  triton_decode_attention.py   one query per sequence, GQA, split-KV + merge kernel for long contexts
  triton_prefill_attention.py  packed varlen causal queries over a partly cached context
  gpu_prefill_choice.py        CUDA prefill: Triton or the torch path (flash SDPA), by lengths measured on the GPU
  triton_block_transfer.py     gather / scatter blocks <-> contiguous staging (connector save/load)
  triton_block_copy.py         copy-on-write block copies across all layers
  triton_attention_tile.py     the online-softmax tile step both attention kernels run
  triton_support.py            what the wrappers share: layout checks, launch arguments, interpreter facts
  compile_check.py             AOT-compile every kernel for sm_80/90 without a GPU
  testing.py                   random paged batches + a naive dense attention oracle for tests
  attention_metadata.py        AttentionMetadata: the kernels' input contract for one packed step
  cache_dir.py                 the project's on-disk cache root (stdlib-only; the built C kernels live under it)

Importing this package imports neither torch nor triton: the names below load on first use, so torch-free code
(the model cache, the launcher) can import `ucm_kernels.cache_dir`.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "calibrate_cpu_attention": "ucm_kernels.api",
    "calibrate_gpu_prefill": "ucm_kernels.api",
    "copy_blocks": "ucm_kernels.api",
    "decode_attention": "ucm_kernels.api",
    "gather_blocks": "ucm_kernels.api",
    "paged_attention": "ucm_kernels.api",
    "prefill_attention": "ucm_kernels.api",
    "scatter_blocks": "ucm_kernels.api",
    "write_kv": "ucm_kernels.api",
    "AttentionBackend": "ucm_kernels.backend",
    "select_backend": "ucm_kernels.backend",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ucm_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
