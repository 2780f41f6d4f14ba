"""Every Triton kernel against its torch reference: interpreted on CPU (TRITON_INTERPRET=1), compiled on CUDA.

Tolerances: fp32 1e-5 (same maths, different summation order); bf16 2e-2 absolute + relative (both sides round the
output to bf16, ~2 ulps apart at |x| ~ 2). Note: the triton interpreter computes tl.dot in fp32 for bf16 inputs
(its bf16 dot is broken), so the 16-bit tl.dot itself is only exercised by the compiled (CUDA) run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    # Must precede triton's first import: @triton.jit reads it when decorating, triton's own tl.* helpers too.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import triton.language as tl

import ucm_kernels
from engine.attention import set_forward_context
from ucm_kernels.attention_metadata import AttentionMetadata
from ucm_kernels.testing import make_paged_case, naive_attention
from ucm_kernels.triton_block_copy import _block_copy_kernel, copy_blocks_torch, copy_blocks_triton
from ucm_kernels.triton_block_transfer import (
    gather_blocks_torch,
    gather_blocks_triton,
    scatter_blocks_torch,
    scatter_blocks_triton,
)
from ucm_kernels.triton_decode_attention import decode_attention_torch, decode_attention_triton
from ucm_kernels.triton_prefill_attention import prefill_attention_torch, prefill_attention_triton
from ucm_kernels.triton_write_kv import write_kv_torch, write_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]
GQA = [(4, 4), (9, 3), (8, 1)]  # ratios 1, 3, 8
DECODE_CTX = [15, 16, 17, 1, 140]  # block boundaries at block 16, a single token, > 8 blocks
PREFILL_CTX = [15, 32, 17, 1, 150, 9]  # (context, new): whole prompt, prefix hit, mid-block chunk, 1/1, long, decode
PREFILL_NEW = [15, 16, 5, 1, 40, 1]


# Another test module imported triton (compiled mode) before this one could set TRITON_INTERPRET: triton's own
# tl.* helpers are then compiled-only, so run this whole module again in a fresh interpreter process instead.
RUN_ELSEWHERE = DEVICE == "cpu" and type(tl.cdiv).__name__ != "InterpretedFunction"


@pytest.fixture(autouse=True)
def _interpreted_or_elsewhere(request):
    if RUN_ELSEWHERE and request.node.name != "test_module_in_fresh_process":
        pytest.skip("triton was imported before TRITON_INTERPRET=1; test_module_in_fresh_process covers this")


def test_module_in_fresh_process():
    if not RUN_ELSEWHERE:
        pytest.skip("the kernels run interpreted in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_kernels_are_interpreted_on_cpu():
    if DEVICE == "cpu":
        assert type(_block_copy_kernel).__name__ == "InterpretedFunction", (
            "a ucm_kernels.triton_* module was imported before TRITON_INTERPRET=1 was set"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", [(1, 64), (3, 64), (8, 128)])
def test_write_kv(dtype, num_heads, head_dim):
    gen = torch.Generator().manual_seed(num_heads)
    # key/value as strided slices of one fused projection, the way a model produces them.
    qkv = torch.randn(7, 3 * num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, num_heads : 2 * num_heads], qkv[:, 2 * num_heads :]
    slots = torch.tensor([17, -1, 95, 0, 40, -1, 15], device=DEVICE)
    caches = [torch.randn(6, 16, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    expect = [c.clone() for c in caches]
    write_kv_triton(key, value, caches[0], caches[1], slots)
    write_kv_torch(key, value, expect[0], expect[1], slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention(dtype, hq, hkv, head_dim, num_splits):
    case = make_paged_case(DECODE_CTX, [1] * len(DECODE_CTX), hq, hkv, head_dim, dtype=dtype, seed=hq, device=DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = decode_attention_triton(*args, num_splits=num_splits)
    torch.testing.assert_close(out, decode_attention_torch(*args), **TOL[dtype])


def test_decode_attention_strided_query_and_many_splits():
    case = make_paged_case([200, 3, 64], [1, 1, 1], 6, 2, 64, seed=5, device=DEVICE)
    q = torch.cat([case.q, case.q], dim=-1)[..., :64]  # non-contiguous rows
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    # 8 splits: the 3-token sequence leaves most splits empty (lse -inf) and the merge must ignore them.
    out = decode_attention_triton(*args, num_splits=8)
    torch.testing.assert_close(out, decode_attention_torch(*args), **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_attention_padding_rows_are_zero(num_splits):
    """seq_len 0 marks a padding row (fixed-size CUDA-graph batches): output 0, never NaN, on both paths."""
    case = make_paged_case([20, 5, 33], [1, 1, 1], 4, 2, 64, seed=9, device=DEVICE)
    seq_lens = torch.tensor([20, 0, 33], dtype=torch.int32, device=DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, seq_lens, 0.125)
    out = decode_attention_triton(*args, num_splits=num_splits)
    ref = decode_attention_torch(*args)
    assert not out[1].any() and not ref[1].any()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_attention(dtype, hq, hkv, head_dim):
    case = make_paged_case(PREFILL_CTX, PREFILL_NEW, hq, hkv, head_dim, dtype=dtype, seed=hkv, device=DEVICE)
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.query_start_loc,
        case.seq_lens,
        case.block_tables,
        head_dim**-0.5,
        case.max_query_len,
    )
    torch.testing.assert_close(prefill_attention_triton(*args), prefill_attention_torch(*args), **TOL[dtype])


@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages", [(64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2)])
def test_prefill_attention_tiles(block_m, block_n, num_warps, num_stages):
    """The tiles benchmarks/kernels.py sweeps on a GPU compute the same attention (tiles past a block, past the
    longest query)."""
    case = make_paged_case(PREFILL_CTX, PREFILL_NEW, 9, 3, 64, dtype=torch.bfloat16, seed=7, device=DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables)
    args += (0.125, case.max_query_len)
    out = prefill_attention_triton(*args, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    torch.testing.assert_close(out, prefill_attention_torch(*args), **TOL[torch.bfloat16])


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes_and_strided_queries(block_size):
    ctx, new = [40, 9, 70], [40, 1, 6]
    case = make_paged_case(ctx, new, 6, 2, 64, block_size=block_size, seed=block_size, device=DEVICE)
    q = torch.cat([case.q, case.q], dim=-1)[..., :64]  # non-contiguous rows, as a slice of a fused qkv
    tables = case.block_tables.long()
    args = (q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, tables, 0.125, case.max_query_len)
    torch.testing.assert_close(prefill_attention_triton(*args), prefill_attention_torch(*args), **TOL[torch.float32])
    last = (case.query_start_loc[1:] - 1).long()
    dec = (q[last], case.k_cache, case.v_cache, tables, case.seq_lens, 0.125)
    torch.testing.assert_close(
        decode_attention_triton(*dec, num_splits=2), decode_attention_torch(*dec), **TOL[torch.float32]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_blocks(dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(12, 16, 3, 64, generator=gen).to(dtype).to(DEVICE)
    ids = torch.tensor([9, 2, 11, 0, 5], device=DEVICE)
    staged = gather_blocks_triton(cache, ids)
    assert staged.is_contiguous() and torch.equal(staged, gather_blocks_torch(cache, ids))
    into = torch.empty_like(staged)
    assert gather_blocks_triton(cache, ids, out=into) is into and torch.equal(into, staged)
    dst_ids = torch.tensor([1, 3, 4, 7, 10], device=DEVICE)
    got, want = torch.zeros_like(cache), torch.zeros_like(cache)
    scatter_blocks_triton(staged, got, dst_ids)
    scatter_blocks_torch(staged, want, dst_ids)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype):
    gen = torch.Generator().manual_seed(4)
    layers = [tuple(torch.randn(10, 16, 2, 64, generator=gen).to(dtype).to(DEVICE) for _ in range(2)) for _ in range(3)]
    expect = [(k.clone(), v.clone()) for k, v in layers]
    src, dst = torch.tensor([4, 1, 8]), torch.tensor([0, 6, 9])
    copy_blocks_triton(layers, src, dst)
    copy_blocks_torch(expect, src, dst)
    for (k, v), (ek, ev) in zip(layers, expect):
        assert torch.equal(k, ek) and torch.equal(v, ev)
    with pytest.raises(ValueError, match="disjoint"):
        copy_blocks_triton(layers, torch.tensor([1, 2]), torch.tensor([2, 3]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_then_decode_through_dispatch(backend, monkeypatch):
    """The engine's view: write_kv + paged_attention per step, chunked prefill then decode, vs dense attention."""
    monkeypatch.setenv("UCM_ATTENTION_BACKEND", backend)
    hq, hkv, d, bs = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(7)
    prompt_lens, chunk = [37, 20], 16
    total = [n + 2 for n in prompt_lens]  # two decode steps after the prompt
    keys = [torch.randn(n, hkv, d, generator=gen).to(DEVICE) for n in total]
    values = [torch.randn(n, hkv, d, generator=gen).to(DEVICE) for n in total]
    queries = [torch.randn(n, hq, d, generator=gen).to(DEVICE) for n in total]
    k_cache = torch.zeros(16, bs, hkv, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[7, 2, 12, 5], [3, 14, 9, 0]], dtype=torch.int32, device=DEVICE)
    done = [0, 0]
    while done != total:
        steps = [min(chunk, p - n) if n < p else (1 if n < t else 0) for n, p, t in zip(done, prompt_lens, total)]
        seqs = [i for i, s in enumerate(steps) if s]
        pos = [list(range(done[i], done[i] + steps[i])) for i in seqs]
        slots = [int(tables[i, p // bs]) * bs + p % bs for i, ps in zip(seqs, pos) for p in ps]
        key = torch.cat([keys[i][ps[0] : ps[-1] + 1] for i, ps in zip(seqs, pos)])
        value = torch.cat([values[i][ps[0] : ps[-1] + 1] for i, ps in zip(seqs, pos)])
        q = torch.cat([queries[i][ps[0] : ps[-1] + 1] for i, ps in zip(seqs, pos)])
        ucm_kernels.write_kv(key, value, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
        lens = [done[i] + steps[i] for i in seqs]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=DEVICE),
            query_start_loc=torch.tensor(
                [0] + torch.tensor([steps[i] for i in seqs]).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE
            ),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables[seqs].contiguous(),
            max_query_len=max(steps[i] for i in seqs),
            max_seq_len=max(lens),
        )
        out = ucm_kernels.paged_attention(q, k_cache, v_cache, md, d**-0.5)
        want = naive_attention(
            q,
            [keys[i][:n] for i, n in zip(seqs, lens)],
            [values[i][:n] for i, n in zip(seqs, lens)],
            [steps[i] for i in seqs],
            d**-0.5,
        )
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        for i in seqs:
            done[i] += steps[i]


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("UCM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ucm_kernels.select_backend(torch.device("cpu"))
    monkeypatch.setenv("UCM_ATTENTION_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="UCM_ATTENTION_BACKEND"):
        ucm_kernels.select_backend(torch.device("cpu"))
    monkeypatch.delenv("UCM_ATTENTION_BACKEND")
    assert ucm_kernels.select_backend(torch.device("cpu")) is ucm_kernels.AttentionBackend.TORCH
    assert ucm_kernels.select_backend(torch.device("cuda")) is ucm_kernels.AttentionBackend.TRITON


def _smollm2_steps(lm, backend: str, monkeypatch) -> list[torch.Tensor]:
    """A packed prefill of two prompts (one spans two blocks) then one decode step each; logits per step."""
    monkeypatch.setenv("UCM_ATTENTION_BACKEND", backend)
    c, bs = lm.config, 16
    caches = [
        tuple(torch.full((8, bs, c.num_kv_heads, c.head_dim), 7.0, dtype=lm.dtype) for _ in range(2))
        for _ in range(c.num_layers)
    ]
    tables = torch.tensor([[5, 2], [6, 0]], dtype=torch.int32)
    prompts = [list(range(100, 120)), [7, 8, 9, 10, 11]]
    steps = [[(0, prompts[0]), (1, prompts[1])], [(0, [42]), (1, [43])]]
    done, logits = [0, 0], []
    for step in steps:
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for sid, new in step:
            positions = range(done[sid], done[sid] + len(new))
            ids += new
            pos += positions
            slots += [int(tables[sid, p // bs]) * bs + p % bs for p in positions]
            qsl.append(qsl[-1] + len(new))
            done[sid] += len(new)
            lens.append(done[sid])
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(len(new) for _, new in step),
            max_seq_len=max(lens),
        )
        with set_forward_context(md):
            hidden = lm.model.forward(torch.tensor(ids), torch.tensor(pos), caches)
        logits.append(lm.model.compute_logits(hidden))
    return logits


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU model fixture; on CUDA the engine's own tests cover this")
def test_smollm2_forward_triton_matches_torch_backend(smollm2_fp32, monkeypatch):
    """The real model (30 layers, GQA 9/3, head dim 64) through write_kv + paged attention on both backends."""
    want = _smollm2_steps(smollm2_fp32, "torch", monkeypatch)
    got = _smollm2_steps(smollm2_fp32, "triton", monkeypatch)
    for step, (g, w) in enumerate(zip(got, want)):
        assert (g - w).abs().max().item() < 1e-3, f"step {step}: logits differ by {(g - w).abs().max().item():.2e}"
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"step {step}: argmax differs"
