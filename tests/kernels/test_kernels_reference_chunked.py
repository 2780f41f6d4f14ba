"""The fast CPU decode path (length-sorted chunks) against the plain reference oracle and dense attention."""

from __future__ import annotations

import random

import pytest
import torch

from ucm_kernels.reference import decode_attention_chunked_torch, decode_attention_torch
from ucm_kernels.testing import make_paged_case, naive_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
@pytest.mark.parametrize(
    "ctx",
    [
        [random.Random(7).randint(1, 300) for _ in range(37)],  # mixed lengths, a ragged last chunk
        [0, 5, 0] + [random.Random(8).randint(1, 90) for _ in range(20)],  # padding rows (seq_len 0)
        [33] * 16,  # equal lengths: one plain call
        [3, 200, 17],  # too few rows to chunk
    ],
)
def test_chunked_decode_matches_reference(dtype, hq, hkv, ctx):
    head_dim = 64
    case = make_paged_case(ctx, [1] * len(ctx), hq, hkv, head_dim, dtype=dtype, seed=len(ctx) + hq)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, head_dim**-0.5)
    fast = decode_attention_chunked_torch(*args)
    ref = decode_attention_torch(*args)
    assert fast.dtype == dtype and fast.shape == case.q.shape
    # Each row is the reference's computation on the same keys; only the padded length per call differs.
    torch.testing.assert_close(fast, ref, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-6)
    live = [i for i, n in enumerate(ctx) if n > 0]
    dense = naive_attention(
        case.q[live], [case.keys[i] for i in live], [case.values[i] for i in live], [1] * len(live), head_dim**-0.5
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast[live].double(), dense, atol=tol, rtol=tol)
    assert not fast[[i for i, n in enumerate(ctx) if n == 0]].any(), "padding rows must be 0"
