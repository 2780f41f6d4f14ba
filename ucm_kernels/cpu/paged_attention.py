"""Python side of the native CPU paged-attention kernel (`paged_attention.c`): layout checks and the ctypes call.

The kernel reads K/V in place from the paged cache; the only tensor made per call is the output. Metadata
tensors are passed by pointer, so decode steps never copy them into Python lists.

Whole prompts (a sequence whose new tokens are its entire context, more than one) are native too: 1024 tokens
in 11.8 ms vs 19.9 ms through torch's causal SDPA, and the 32-request throughput run drops from 17.6 to 16.2
engine CPU s. The price is bit-equality with HF transformers in bf16, which runs that SDPA: the kernel sums in
another order, and over 30 bf16 layers that grows to ~0.7 logits. It is not less accurate: against fp32 logits
(SmolLM2, 4 prompts, max |diff|) native 0.75/0.74/1.30/1.37 vs HF 0.47/0.83/1.30/1.37, which
tests/engine/test_model_hf.py asserts (ours within HF's own bf16 error, not bit-equal). `WHOLE_PROMPTS_ON_TORCH = True`
sends them to SDPA again (tests use it to check the two agree).

Whether a call comes here at all is measured per machine (ucm_kernels/cpu/calibration.py); the figures above are
from an AVX-512 host.

Threads: the kernel splits its work items (a sequence's query rows, 32 (token, head) pairs at a time on the
AVX-512 path, 64 on the AVX2/NEON one; a prefill's rows of one kv head, 16 or 32 at a time, in the lanes bodies) over
`torch.get_num_threads()` OpenMP threads (the libgomp thread pool torch uses); with one torch thread it runs
on the calling thread. Measured on the 2-core box, DRAM-resident decode (32 sequences, SmolLM2 shapes):
777 us a layer on 1 thread, 499 on 2.
"""

from __future__ import annotations

import ctypes

import torch

from ucm_kernels.cpu.native import NativeLib
from ucm_kernels.reference import prefill_attention_torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 256  # MAX_D in paged_attention.c
WHOLE_PROMPTS_ON_TORCH = False  # read per call (module doc)

_ERRORS = {
    1: "has more query tokens than context tokens (seq_lens counts the new tokens too)",
    2: "needs more blocks than block_tables has columns",
    3: "has a block id outside the cache",
    4: "has query_start_loc entries out of order or past the query tokens",
    5: "has an unsupported shape (head_dim > 256, or query heads not a multiple of kv heads)",
    6: "could not be given its scratch memory (the host is out of memory)",  # no sequence at fault: seq -1
}


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors as they are (else the caller uses the torch path)."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPE_CODES
        and q.dtype == k_cache.dtype
        and k_cache.shape[3] <= MAX_HEAD_DIM
        and q.stride(2) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _call(
    lib: NativeLib,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    skip_whole_prompts: bool,
    prompt_queries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """One kernel call -> (out, number of whole prompts it skipped). prompt_queries [num_seqs] (None: none): how
    many of each sequence's first queries are prompt tokens (AttentionMetadata.prompt_queries)."""
    num_tokens, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    out = torch.empty((num_tokens, hq, d), dtype=q.dtype)
    seq_lens, block_tables = _int32(seq_lens), _int32(block_tables)
    qsl_ptr = None if query_start_loc is None else _int32(query_start_loc).data_ptr()
    if prompt_queries is not None:
        prompt_queries = _int32(prompt_queries)
        if prompt_queries.shape != seq_lens.shape:
            raise ValueError(f"prompt_queries {tuple(prompt_queries.shape)} must be [num_seqs] like seq_lens")
    pq_ptr = None if prompt_queries is None else prompt_queries.data_ptr()
    err_seq, skipped = ctypes.c_int32(-1), ctypes.c_int32(0)
    rc = lib.paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        qsl_ptr, seq_lens.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], num_blocks,
        seq_lens.shape[0], num_tokens, hq, hkv, d, block_size,
        DTYPE_CODES[q.dtype], scale, skip_whole_prompts, pq_ptr, torch.get_num_threads(),
        ctypes.byref(err_seq), ctypes.byref(skipped),
    )  # fmt: skip
    if rc != 0:
        raise attention_error(rc, err_seq.value)
    return out, skipped.value


def attention_error(rc: int, seq: int) -> ValueError:
    """The error for the kernel's non-zero return `rc` about sequence `seq`."""
    what = _ERRORS.get(rc, f"failed with code {rc}")
    return ValueError(f"paged attention: sequence {seq} {what}" if seq >= 0 else f"paged attention: the call {what}")


def shared_prefix_groups(
    lib: NativeLib, seq_lens: torch.Tensor, block_tables: torch.Tensor, num_q_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int,
) -> list[int] | None:  # fmt: skip
    """How the kernel groups a bf16 decode batch whose sequences begin with the same cache blocks (one item a
    group reads their shared chunks once: paged_attention_shared.h), with this process's torch threads: each
    sequence's group index, -1 for one on its own; None where the build has no such groups."""
    fn = lib.cdll.ucm_shared_prefix_groups
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, i32, i32, i32, i32, i32, i32, ptr]
    fn.restype = i32
    seq_lens, block_tables = _int32(seq_lens), _int32(block_tables)
    out = torch.empty(seq_lens.shape[0], dtype=torch.int32)
    n = fn(
        seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), seq_lens.shape[0],
        num_q_heads, num_kv_heads, head_dim, block_size, torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    return None if n < 0 else out.tolist()


def paged_attention_native(
    lib: NativeLib,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    prompt_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel alone on every sequence, whole prompts included; query_start_loc None: one query per
    sequence, row b (`ucm_kernels.decode_attention`'s contract; the caller checked `supports`)."""
    return _call(lib, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, False, prompt_queries)[0]


def prefill_attention_native(
    lib: NativeLib,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    whole_prompts_on_torch: bool = False,
    prompt_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ucm_kernels.prefill_attention`'s contract (packed varlen, causal); whole prompts go to torch's SDPA when
    `whole_prompts_on_torch` (the calibration measured it faster) or WHOLE_PROMPTS_ON_TORCH (module doc)."""
    skip = whole_prompts_on_torch or WHOLE_PROMPTS_ON_TORCH
    out, skipped = _call(lib, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, skip, prompt_queries)
    if not skipped:
        return out
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, ctx in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        if hi - lo > 1 and hi - lo == ctx:
            one = torch.tensor([0, ctx], dtype=torch.int32)
            out[lo:hi] = prefill_attention_torch(
                q[lo:hi], k_cache, v_cache, one, seq_lens[i : i + 1], block_tables[i : i + 1], scale, ctx
            )
    return out
