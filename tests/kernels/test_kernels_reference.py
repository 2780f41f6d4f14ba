"""The torch references against textbook dense attention: this is what makes them a trustworthy oracle."""

from __future__ import annotations

import pytest
import torch

from ucm_kernels.reference import (
    copy_blocks_torch,
    decode_attention_torch,
    gather_blocks_torch,
    prefill_attention_torch,
    scatter_blocks_torch,
    write_kv_torch,
)
from ucm_kernels.testing import make_paged_case, naive_attention

# bf16 inputs: SDPA rounds its output to bf16 (8 bits of mantissa) -> ~1e-2 absolute on O(1) outputs.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_reference_matches_dense(dtype, hq, hkv, head_dim):
    ctx = [15, 16, 17, 1, 140]  # block boundaries, a single token, > 8 blocks
    case = make_paged_case(ctx, [1] * len(ctx), hq, hkv, head_dim, dtype=dtype, seed=hq + head_dim)
    scale = head_dim**-0.5
    out = decode_attention_torch(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    ref = naive_attention(case.q, case.keys, case.values, [1] * len(ctx), scale)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_reference_matches_dense(dtype, hq, hkv, head_dim):
    # (context, new tokens): full prompt, prefix hit at a block boundary, chunked mid-block, decode-like, long.
    ctx = [15, 32, 17, 1, 150, 9]
    new = [15, 16, 5, 1, 40, 1]
    case = make_paged_case(ctx, new, hq, hkv, head_dim, dtype=dtype, seed=hq * head_dim)
    scale = head_dim**-0.5
    out = prefill_attention_torch(
        case.q,
        case.k_cache,
        case.v_cache,
        case.query_start_loc,
        case.seq_lens,
        case.block_tables,
        scale,
        case.max_query_len,
    )
    ref = naive_attention(case.q, case.keys, case.values, new, scale)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def test_prefill_rejects_more_queries_than_context():
    case = make_paged_case([4], [4], 2, 2, 64)
    with pytest.raises(ValueError, match="context"):
        prefill_attention_torch(
            case.q,
            case.k_cache,
            case.v_cache,
            case.query_start_loc,
            torch.tensor([3], dtype=torch.int32),
            case.block_tables,
            0.125,
            4,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(6, 16, 2, 64, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, 2, 64, generator=gen).to(dtype)
    value = torch.randn(5, 2, 64, generator=gen).to(dtype)
    slots = torch.tensor([17, -1, 95, 0, 40], dtype=torch.int64)
    write_kv_torch(key, value, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // 16, s % 16], key[t])
            assert torch.equal(v_cache[s // 16, s % 16], value[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4, "the -1 slot must not be written anywhere"


def test_block_ops_reference():
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(8, 16, 2, 64, generator=gen)
    ids = torch.tensor([5, 1, 7])
    staged = gather_blocks_torch(cache, ids)
    assert staged.is_contiguous() and torch.equal(staged, cache[[5, 1, 7]])
    other = torch.zeros_like(cache)
    scatter_blocks_torch(staged, other, torch.tensor([0, 2, 3]))
    assert torch.equal(other[[0, 2, 3]], staged) and not other[[1, 4, 5, 6, 7]].any()
    k, v = cache.clone(), cache.clone() * 2
    before_k, before_v = k.clone(), v.clone()
    # dst 3 is also a source: every source is read before any write.
    copy_blocks_torch([(k, v)], torch.tensor([3, 6]), torch.tensor([4, 3]))
    assert torch.equal(k[4], before_k[3]) and torch.equal(k[3], before_k[6]) and torch.equal(v[3], before_v[6])
    assert torch.equal(k[[0, 1, 2, 5, 6, 7]], before_k[[0, 1, 2, 5, 6, 7]])


def test_gather_scratch_made_under_inference_mode_serves_outside_it() -> None:
    """The CPU gather's per-thread scratch: a buffer first made under inference_mode (a start-up calibration) must
    not be handed to a later call outside it, where writing an inference tensor raises."""
    from ucm_kernels.reference.paged_gather import gather_context

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 4, 2, 8, generator=gen)
    tables = torch.tensor([[5, 1, 3], [2, 0, 4]], dtype=torch.int32)
    want = cache[tables.long()].reshape(2, 12, 2, 8).transpose(1, 2)
    with torch.inference_mode():
        inside = gather_context(cache, tables, 3, slot="scratch-test").clone()
    outside = gather_context(cache, tables, 3, slot="scratch-test")
    assert torch.equal(inside, want) and torch.equal(outside, want)
    with torch.inference_mode():
        assert torch.equal(gather_context(cache, tables, 3, slot="scratch-test"), want)
