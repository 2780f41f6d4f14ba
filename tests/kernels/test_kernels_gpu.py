"""Compiled Triton kernels on CUDA (bf16 tl.dot, split-KV heuristic, CUDA graphs); skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import ucm_kernels
from ucm_kernels.cpu.calibration import ShapeClass
from ucm_kernels.reference import decode_attention_torch, prefill_attention_torch
from ucm_kernels.testing import make_paged_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hq,hkv,head_dim", [(32, 8, 128), (9, 3, 64), (16, 16, 128)])
def test_decode_long_context_auto_splits(hq, hkv, head_dim):
    gen = torch.Generator().manual_seed(hq)
    ctx = torch.randint(1, 3000, (12,), generator=gen).tolist() + [4096, 1, 16, 17]
    case = make_paged_case(ctx, [1] * len(ctx), hq, hkv, head_dim, dtype=torch.bfloat16, device="cuda")
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = ucm_kernels.decode_attention(*args, max_seq_len=case.max_seq_len)
    torch.testing.assert_close(out, decode_attention_torch(*args), **BF16)


def test_prefill_compiled_matches_reference():
    ctx, new = [700, 33, 1024, 5, 300], [700, 17, 100, 1, 299]
    case = make_paged_case(ctx, new, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.query_start_loc,
        case.seq_lens,
        case.block_tables,
        128**-0.5,
        case.max_query_len,
    )
    torch.testing.assert_close(ucm_kernels.prefill_attention(*args), prefill_attention_torch(*args), **BF16)


def test_decode_under_cuda_graph():
    """Captured once, replayed with new queries and longer contexts (the split count is fixed at capture)."""
    ctx = [100, 17, 640, 1]
    case = make_paged_case([2048] * 4, [1] * 4, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = case.q.clone()
    call = lambda: ucm_kernels.decode_attention(  # noqa: E731
        q, case.k_cache, case.v_cache, case.block_tables, seq_lens, 128**-0.5, max_seq_len=2048
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(3):
        q.copy_(torch.randn_like(q))
        seq_lens.copy_(torch.tensor([c + 500 * step for c in ctx], device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = decode_attention_torch(q, case.k_cache, case.v_cache, case.block_tables, seq_lens, 128**-0.5)
        torch.testing.assert_close(out, want, **BF16)


def test_block_transfer_roundtrip_compiled():
    cache = torch.randn(512, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    ids = torch.randperm(512, device="cuda")[:200]
    staged = ucm_kernels.gather_blocks(cache, ids)
    assert torch.equal(staged, cache[ids])
    other = torch.zeros_like(cache)
    ucm_kernels.scatter_blocks(staged, other, ids)
    assert torch.equal(other[ids], cache[ids])


@pytest.fixture
def torch_path_calls(monkeypatch):
    """Count the CUDA prefills that the dispatch sends to the torch path, with this process's plans forgotten."""
    import ucm_kernels.api as api
    from ucm_kernels import gpu_prefill_choice

    gpu_prefill_choice.forget()
    calls = []
    real = api.prefill_attention_torch

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "prefill_attention_torch", counted)
    yield calls
    gpu_prefill_choice.forget()


def test_prefill_dispatch_follows_a_forced_plan(monkeypatch, torch_path_calls):
    """Whole prompts of 512+ tokens measured faster on torch, chunks never: the dispatch runs what was measured,
    and both paths give the reference's output."""
    from ucm_kernels import gpu_prefill_choice
    from ucm_kernels.gpu_prefill_choice import LENGTHS, LengthTiming

    def forced(g, device):
        prompt = tuple(LengthTiming(n, 2.0, 1.0 if n >= 512 else 3.0) for n in LENGTHS)
        return {ShapeClass.PROMPT: prompt, ShapeClass.CHUNK: tuple(LengthTiming(n, 1.0, 2.0) for n in LENGTHS)}

    monkeypatch.setattr(gpu_prefill_choice, "measure", forced)
    for ctx, new, want_torch in (([600], [600], True), ([1200], [600], False), ([300], [300], False)):
        case = make_paged_case(ctx, new, 9, 3, 64, dtype=torch.bfloat16, device="cuda")
        args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables,
                64**-0.5, case.max_query_len)  # fmt: skip
        for context_tokens in (None, sum(ctx)):  # told from the device's seq_lens, or from the host's sum
            before = len(torch_path_calls)
            out = ucm_kernels.prefill_attention(*args, context_tokens=context_tokens)
            assert (len(torch_path_calls) > before) is want_torch, (ctx, new, context_tokens)
            torch.testing.assert_close(out, prefill_attention_torch(*args), **BF16)


def test_prefill_dispatch_measured_on_this_gpu(torch_path_calls):
    """The real measurement: a plan for both classes, and a long prompt dispatched by it matches the reference."""
    plan = ucm_kernels.calibrate_gpu_prefill(torch.bfloat16, 32, 8, 128, 16, torch.device("cuda"))
    assert plan is not None and all(len(plan.timings[c]) > 0 for c in (ShapeClass.PROMPT, ShapeClass.CHUNK))
    case = make_paged_case([4096], [4096], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables,
            128**-0.5, case.max_query_len)  # fmt: skip
    torch.testing.assert_close(ucm_kernels.prefill_attention(*args), prefill_attention_torch(*args), **BF16)
    crossing = plan.crossover(ShapeClass.PROMPT)
    assert (len(torch_path_calls) == 1) is (crossing is not None and crossing <= 4096), plan.describe()
