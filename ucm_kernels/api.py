"""The kernel entry points the engine and connector call; each picks Triton or the CPU path per call from the device.

CUDA prefills run the Triton kernel, or the torch path (a gather, then flash SDPA) for calls whose new tokens per
sequence reach the length from which that path measured faster on this GPU (`ucm_kernels/gpu_prefill_choice.py`).

CPU attention runs, per shape class (decode, prefill chunk over a cached prefix, whole prompt), whichever of the
native C kernel (`ucm_kernels/cpu/`, K/V read in place from the paged cache) and the torch path measured faster on
this machine (`ucm_kernels/cpu/calibration.py`: once per machine, geometry and thread count, cached on disk);
ucm_kernels/cpu/paged_attention.py says what native whole prompts cost in bit-equality with HF's SDPA. write_kv is a
C copy loop. `UCM_CPU_ATTENTION=native|torch` forces one path; torch also runs when the library cannot be built
or the dtype/layout is not one it takes.

The Llama block's elementwise ops (RMSNorm with the residual add folded in, SiLU-and-mul, RoPE) run the same
library's fused kernels for contiguous bf16 CPU tensors under the same switch, bit-identical to torch's bf16
math up to the order of one fp32 sum; fp32, CUDA and `UCM_CPU_ATTENTION=torch` run that torch math itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ucm_kernels import gpu_prefill_choice
from ucm_kernels.backend import AttentionBackend, CpuAttention, cpu_attention, forced_backend, select_backend
from ucm_kernels.cpu import calibration, native
from ucm_kernels.cpu import elementwise as native_elementwise
from ucm_kernels.cpu import write_kv as native_write
from ucm_kernels.cpu.calibration import Geometry, Plan, ShapeClass
from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.cpu.paged_attention import DTYPE_CODES as NATIVE_DTYPES
from ucm_kernels.cpu.paged_attention import paged_attention_native, prefill_attention_native, supports
from ucm_kernels.gpu_prefill_choice import GpuPrefillPlan
from ucm_kernels.reference import (
    copy_blocks_torch,
    decode_attention_chunked_torch,
    fused_add_rms_norm_torch,
    gather_blocks_torch,
    prefill_attention_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    scatter_blocks_torch,
    silu_and_mul_torch,
    write_kv_torch,
)

if TYPE_CHECKING:
    from ucm_kernels.attention_metadata import AttentionMetadata


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} {v_cache.dtype} differ"
        )


def _check_query(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if d != dk:
        raise ValueError(f"q head_dim {d} != cache head_dim {dk}")
    if hq % hkv != 0:
        raise ValueError(f"num query heads {hq} must be a multiple of num kv heads {hkv}")


def _native_lib(supported: bool) -> NativeLib | None:
    """The C library when the CPU path should run it and it takes these tensors (`supported`), else None (torch)."""
    if cpu_attention() is CpuAttention.TORCH or not supported:  # the env check first: a bad value always raises
        return None
    return native.load()


def native_ops_lib() -> NativeLib | None:
    """The C library when the CPU path runs write_kv and the elementwise ops natively (not forced to torch, and
    the library built), else None. Whether given tensors' layouts suit it is the caller's check, as here
    (`ucm_kernels.cpu.write_kv.supports`, `ucm_kernels.cpu.elementwise.supports_rows`)."""
    return _native_lib(True)


def native_decode_lib(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> NativeLib | None:
    """The C library when `decode_attention` over tensors like these runs the native kernel (the calibration's
    choice for decodes, or a forced one), else None (the torch path)."""
    lib = _native_lib(supports(q, k_cache, v_cache))
    if lib is None:
        return None
    plan = _auto_plan(lib, q, k_cache)
    return lib if plan is None or plan[ShapeClass.DECODE].impl == calibration.NATIVE else None


def _geometry_of(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> Geometry:
    return Geometry(str(dtype).removeprefix("torch."), num_q_heads, num_kv_heads, head_dim, block_size)


def _geometry(q: torch.Tensor, k_cache: torch.Tensor) -> Geometry:
    return _geometry_of(q.dtype, q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1])


def _auto_plan(lib: NativeLib, q: torch.Tensor, k_cache: torch.Tensor) -> Plan | None:
    """The calibrated plan when UCM_CPU_ATTENTION is auto (measured on the first call per geometry), else None."""
    return calibration.plan(lib, _geometry(q, k_cache)) if cpu_attention() is CpuAttention.AUTO else None


def calibrate_cpu_attention(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> Plan | None:
    """Run (or read) the CPU attention calibration now, e.g. at engine start-up rather than on the first step.
    None when it does not apply: a forced UCM_CPU_ATTENTION, no native library, a dtype the kernel does not take."""
    if cpu_attention() is not CpuAttention.AUTO or dtype not in NATIVE_DTYPES:
        return None
    lib = native.load()
    if lib is None:
        return None
    return calibration.plan(lib, _geometry_of(dtype, num_q_heads, num_kv_heads, head_dim, block_size))


def _all_whole_prompts(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    n = query_start_loc[1:] - query_start_loc[:-1]
    return bool(((n == seq_lens) | (n == 0)).all())


def calibrate_gpu_prefill(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device
) -> GpuPrefillPlan | None:
    """Measure now which path CUDA prefills of this geometry run (ucm_kernels/gpu_prefill_choice.py), e.g. at engine
    start-up rather than on the first prefill; None where no choice is made (not CUDA, a forced backend)."""
    if device.type != "cuda" or forced_backend() is not None or dtype not in gpu_prefill_choice.FLASH_DTYPES:
        return None
    return gpu_prefill_choice.plan(_geometry_of(dtype, num_q_heads, num_kv_heads, head_dim, block_size), device)


def gpu_prefill_on_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_tokens: int | None = None,
) -> bool:
    """On CUDA with the backend not forced: whether this GPU measured the torch path faster for a call like this.
    `context_tokens` (sum of seq_lens, from the host) tells whole prompts from chunks without a device sync:
    each sequence's new tokens are at most its context, so they sum to it exactly when all are whole prompts."""
    if (q.device.type != "cuda" or forced_backend() is not None or q.dtype not in gpu_prefill_choice.FLASH_DTYPES
            or torch.cuda.is_current_stream_capturing()):  # fmt: skip
        return False
    chosen = gpu_prefill_choice.plan(_geometry(q, k_cache), q.device)

    def whole() -> bool:
        if context_tokens is not None:
            return q.shape[0] == context_tokens
        return _all_whole_prompts(query_start_loc, seq_lens)

    return chosen.runs_torch(q.shape[0], seq_lens.shape[0], whole)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, Hkv, D] into the paged caches at slot_mapping [T] (block * block_size + offset; -1 skips)."""
    _check_cache_pair(k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} must both be "
            f"[T, {k_cache.shape[2]}, {k_cache.shape[3]}]"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if select_backend(key.device) is AttentionBackend.TRITON:
        from ucm_kernels.triton_write_kv import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    lib = _native_lib(native_write.supports(key, value, k_cache, v_cache))
    if lib is not None:
        native_write.write_kv_native(lib, key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    prompt_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] over seq_lens[b] cached tokens -> [B, Hq, D].

    max_seq_len (optional, additive to the team API) saves a device sync when the caller knows it.
    prompt_queries (optional, additive): AttentionMetadata.prompt_queries (a row that is a prompt's last token).
    """
    _check_cache_pair(k_cache, v_cache)
    _check_query(q, k_cache)
    if seq_lens.shape != (q.shape[0],) or block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(
            f"decode batch mismatch: q {tuple(q.shape)}, seq_lens {tuple(seq_lens.shape)}, "
            f"block_tables {tuple(block_tables.shape)}"
        )
    if select_backend(q.device) is AttentionBackend.TRITON:
        from ucm_kernels.triton_decode_attention import decode_attention_triton

        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)
    lib = native_decode_lib(q, k_cache, v_cache)
    if lib is not None:
        return paged_attention_native(lib, q, k_cache, v_cache, None, seq_lens, block_tables, scale, prompt_queries)
    # Torch: the length-chunked path (same result as the plain reference, which stays the oracle).
    return decode_attention_chunked_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    context_tokens: int | None = None,
    prompt_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed varlen causal attention: q [T, Hq, D]; each sequence's new tokens are the last of its seq_lens.

    context_tokens (optional, additive to the team API): sum of seq_lens when the caller knows it on the host,
    which saves a CUDA call long enough to weigh the torch path a device sync. prompt_queries (optional,
    additive): AttentionMetadata.prompt_queries, which the native CPU kernel sends to its AMX body where it has one;
    there, rows not named so are generated rows and take their own body, a token at a time (a long prompt passed
    unnamed is correct but slow).
    """
    _check_cache_pair(k_cache, v_cache)
    _check_query(q, k_cache)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"prefill batch mismatch: query_start_loc {tuple(query_start_loc.shape)}, "
            f"seq_lens {tuple(seq_lens.shape)}, block_tables {tuple(block_tables.shape)}"
        )
    if select_backend(q.device) is AttentionBackend.TRITON:
        if gpu_prefill_on_torch(q, k_cache, query_start_loc, seq_lens, context_tokens):
            return prefill_attention_torch(
                q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len
            )
        from ucm_kernels.triton_prefill_attention import prefill_attention_triton

        return prefill_attention_triton(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len
        )
    lib = _native_lib(supports(q, k_cache, v_cache))
    plan = _auto_plan(lib, q, k_cache) if lib is not None else None
    prompts_native = plan is None or plan[ShapeClass.PROMPT].impl == calibration.NATIVE
    # Chunks on native: the kernel leaves whole prompts to torch when they measured faster there. Chunks on torch: a
    # batch of whole prompts only may still go native; a mixed one runs torch whole (splitting it would copy q and
    # the output). No plan (a forced path): native for every class.
    if lib is not None and (
        plan is None
        or plan[ShapeClass.CHUNK].impl == calibration.NATIVE
        or (prompts_native and _all_whole_prompts(query_start_loc, seq_lens))
    ):
        return prefill_attention_native(
            lib, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
            whole_prompts_on_torch=not prompts_native, prompt_queries=prompt_queries,
        )  # fmt: skip
    return prefill_attention_torch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a packed step (new K/V already written): decode kernel when every sequence has one new token.

    On CPU both branches may reach the same native varlen kernel; the decode one just skips query_start_loc.
    """
    md = attn_metadata
    if md.is_decode_only and q.shape[0] == md.num_seqs:
        return decode_attention(
            q, k_cache, v_cache, md.block_tables, md.seq_lens, scale, md.max_seq_len, md.prompt_queries
        )
    return prefill_attention(
        q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale, md.max_query_len,
        md.context_tokens, md.prompt_queries,
    )  # fmt: skip


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks block_ids [n] of one layer's cache [N, bs, H, D] into a contiguous [n, bs, H, D].

    out (optional, additive to the team API): a preallocated contiguous staging buffer to fill and return.
    """
    if cache.dim() != 4:
        raise ValueError(f"cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(cache.shape)}")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got {tuple(block_ids.shape)}")
    if select_backend(cache.device) is AttentionBackend.TRITON:
        from ucm_kernels.triton_block_transfer import gather_blocks_triton

        return gather_blocks_triton(cache, block_ids, out)
    return gather_blocks_torch(cache, block_ids, out)


def scatter_blocks(src: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write staging src [n, bs, H, D] into cache blocks block_ids [n]."""
    if cache.dim() != 4 or block_ids.dim() != 1 or src.shape != (block_ids.shape[0], *cache.shape[1:]):
        raise ValueError(
            f"scatter_blocks: src {tuple(src.shape)} must be [len(block_ids), *cache.shape[1:]] with 1-D block_ids "
            f"{tuple(block_ids.shape)} and cache {tuple(cache.shape)}"
        )
    if select_backend(cache.device) is AttentionBackend.TRITON:
        from ucm_kernels.triton_block_transfer import scatter_blocks_triton

        scatter_blocks_triton(src, cache, block_ids)
    else:
        scatter_blocks_torch(src, cache, block_ids)


def copy_blocks(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """Copy-on-write for every layer: block dst[i] <- block src[i]."""
    if src_block_ids.shape != dst_block_ids.shape or src_block_ids.dim() != 1:
        raise ValueError(f"src {tuple(src_block_ids.shape)} and dst {tuple(dst_block_ids.shape)} must be equal 1-D")
    if not kv_caches or src_block_ids.numel() == 0:
        return
    for k_cache, v_cache in kv_caches:
        _check_cache_pair(k_cache, v_cache)
    if select_backend(kv_caches[0][0].device) is AttentionBackend.TRITON:
        from ucm_kernels.triton_block_copy import copy_blocks_triton

        copy_blocks_triton(kv_caches, src_block_ids, dst_block_ids)
    else:
        copy_blocks_torch(kv_caches, src_block_ids, dst_block_ids)


def _check_norm_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} must be [hidden] for x {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm of x [..., hidden]: weight * (x * rsqrt(mean(x^2) + eps)) with x's dtype's roundings."""
    _check_norm_weight(x, weight)
    lib = _native_lib(native_elementwise.supports_rows(x, weight))
    if lib is not None:
        return native_elementwise.rms_norm_native(lib, x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, rounded to its dtype), then rms_norm(residual): vLLM's fused_add_rms_norm, one
    pass instead of a residual add and a norm."""
    _check_norm_weight(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    lib = _native_lib(native_elementwise.supports_rows(x, residual, weight))
    if lib is not None:
        return native_elementwise.fused_add_rms_norm_native(lib, x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [..., 2I] = (gate | up) -> silu(gate) * up [..., I]."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension (gate | up), got {tuple(x.shape)}")
    lib = _native_lib(native_elementwise.supports_rows(x))
    if lib is not None:
        return native_elementwise.silu_and_mul_native(lib, x)
    return silu_and_mul_torch(x)


def rotary_embedding_(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate qk [T, H, D] in place (rotate-half layout) by cos and sign-folded sin [T, 1, D]
    (engine/models/rope.py's `cos_sin`); qk may be a token-strided view, e.g. the q|k heads of a fused qkv."""
    if qk.dim() != 3 or qk.shape[2] % 2:
        raise ValueError(f"qk must be [tokens, heads, head_dim] with an even head_dim, got {tuple(qk.shape)}")
    want = (qk.shape[0], 1, qk.shape[2])
    if cos.shape != want or signed_sin.shape != want:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(signed_sin.shape)} must be {want}")
    lib = _native_lib(native_elementwise.supports_rope(qk, cos, signed_sin))
    if lib is not None:
        native_elementwise.rotary_embedding_native(lib, qk, cos, signed_sin)
    else:
        qk.copy_(rotary_embedding_torch(qk, cos, signed_sin))
