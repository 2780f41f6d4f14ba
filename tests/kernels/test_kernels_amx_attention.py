"""The native attention's AMX body for bf16 prompt rows (ucm_kernels/cpu/paged_attention_amx.h): against the oracles,
the same bits for a row however its prompt was split or batched, and the routing by row class (prompt rows given
as such take it; generated rows, and calls that give no classes, keep their own body's bits: test_kernels_amx_rows.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm_kernels.cpu import native
from ucm_kernels.cpu.paged_attention import paged_attention_native
from ucm_kernels.reference import prefill_attention_torch
from ucm_kernels.testing import PagedCase, make_paged_case, naive_attention

TOL = dict(atol=2e-2, rtol=2e-2)  # both sides round the output to bf16
# SmolLM2's GQA; head_dim 128 (four k tiles a score); MQA at head_dim 32 (one); no GQA
HEADS = [(9, 3, 64), (8, 1, 128), (32, 1, 32), (4, 4, 64)]


@pytest.fixture(scope="module")
def amx_lib(native_lib) -> native.NativeLib:
    if not native_lib.has_amx_attention:
        pytest.skip("no AMX here (or the OS refused it): prompt rows take the VDPBF16PS bodies")
    return native_lib


def _prompts(n: list[int]) -> torch.Tensor:
    return torch.tensor(n, dtype=torch.int32)


def _last_rows(lib: native.NativeLib, case: PagedCase, k: int, scale: float) -> torch.Tensor:
    """The last k rows of the case's one prompt, computed as a chunk over the cached rest of it."""
    length = int(case.seq_lens[0])
    qsl = torch.tensor([0, k], dtype=torch.int32)
    return paged_attention_native(
        lib, case.q[length - k :], case.k_cache, case.v_cache, qsl, case.seq_lens, case.block_tables, scale,
        _prompts([k]),
    )  # fmt: skip


@pytest.mark.parametrize(("hq", "hkv", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 24])  # 24: sixteen keys cross a block's end (gathered, not loaded)
def test_prompt_rows_match_the_oracles_on_any_thread_count(amx_lib, hq, hkv, head_dim, block_size):
    # a whole prompt, a chunk over a prefix that ends mid-block, a 1-token suffix, a long chunk over many softmax
    # steps, a padding row, and an odd number of keys
    ctx = [150, 77, 41, 530, 0, 63]
    new = [150, 20, 1, 300, 1, 63]
    case = make_paged_case(ctx, new, hq, hkv, head_dim, block_size=block_size, dtype=torch.bfloat16, seed=hq + 7)
    scale = head_dim**-0.5
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, scale)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_native(amx_lib, *args, _prompts(new))
        torch.set_num_threads(2)
        two = paged_attention_native(amx_lib, *args, _prompts(new))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two), "work items are independent: the thread count changes nothing"
    live = [i for i, n in enumerate(ctx) if n > 0]
    rows = torch.cat([torch.arange(case.query_start_loc[i], case.query_start_loc[i + 1]) for i in live])
    torch.testing.assert_close(one[rows], prefill_attention_torch(*args, case.max_query_len)[rows], **TOL)
    dense = naive_attention(
        case.q[rows], [case.keys[i] for i in live], [case.values[i] for i in live], [new[i] for i in live], scale
    )
    torch.testing.assert_close(one[rows].double(), dense, **TOL)
    assert not one[int(case.query_start_loc[4])].any(), "the padding row (seq_len 0) must be 0"
    plain = paged_attention_native(amx_lib, *args)
    assert not torch.equal(one, plain), (
        "the prompt rows ran the AMX prompt body (its sums differ from the generated rows' body's)"
    )


def test_scores_that_rise_past_the_lazy_max_rescale_the_output(amx_lib):
    """The softmax reference lags a row's max by up to 2^8 (LAZY_MAX_LOG2); keys 128 on scaled 4x make every row's
    scores rise far past that in a later chunk, so the output's rescale must run, and the rows still match."""
    ctx, new, bs = [300], [300], 16
    case = make_paged_case(ctx, new, 9, 3, 64, block_size=bs, dtype=torch.bfloat16, seed=3)
    for t in range(128, 300):
        case.keys[0][t] *= 4  # a power of two: exact in bf16
        case.k_cache[case.block_tables[0, t // bs], t % bs] = case.keys[0][t]
    scale = 64**-0.5
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, scale)
    out = paged_attention_native(amx_lib, *args, _prompts(new))
    dense = naive_attention(case.q, case.keys, case.values, new, scale)
    late = slice(200, 300)  # rows whose keys since 128 outscore the first chunk's by far
    torch.testing.assert_close(out[late].double(), dense[late], **TOL)
    torch.testing.assert_close(out.double(), dense, **TOL)


@pytest.mark.parametrize(("hq", "hkv", "head_dim"), HEADS[:3])
def test_a_prompt_row_has_the_same_bits_however_the_prompt_was_split(amx_lib, hq, hkv, head_dim):
    """Whole, in a chunk over a cached prefix of any length, or as a prompt's last token in a decode-form call (a
    full prefix hit recomputes it): the cache-hit oracle needs all of these to agree bit for bit."""
    length = 300
    case = make_paged_case([length], [length], hq, hkv, head_dim, dtype=torch.bfloat16, seed=21)
    scale = head_dim**-0.5
    whole = _last_rows(amx_lib, case, length, scale)
    for k in (299, 70, 33, 11, 5, 2, 1):
        assert torch.equal(_last_rows(amx_lib, case, k, scale), whole[length - k :]), (
            f"the last {k} rows differ from the whole prompt's"
        )
    decode_form = paged_attention_native(
        amx_lib, case.q[length - 1 :], case.k_cache, case.v_cache, None, case.seq_lens, case.block_tables, scale,
        _prompts([1]),
    )  # fmt: skip
    assert torch.equal(decode_form, whole[length - 1 :]), "the prompt's last row as a one-row call"


def test_far_apart_scores_keep_the_bits_and_the_callers_mode(amx_lib):
    """A scale that sets a row's scores hundreds of log2 units apart: most weights fall below fp32's smallest normal,
    which the body flushes to zero (it runs with DAZ and FTZ: run_item; as denormals they had made it ~4x slower).
    The rows still match the oracle and keep their bits however the prompt was split, and the calling thread gets
    its floating-point mode back."""
    length, scale = 400, 40.0
    case = make_paged_case([length], [length], 8, 2, 64, dtype=torch.bfloat16, seed=5)
    whole = _last_rows(amx_lib, case, length, scale)
    smallest = np.float32(np.finfo(np.float32).tiny)
    assert smallest / np.float32(4) > 0, "FTZ left set on the calling thread"
    torch.testing.assert_close(whole.double(), naive_attention(case.q, case.keys, case.values, [length], scale), **TOL)
    for k in (333, 64, 7, 1):
        assert torch.equal(_last_rows(amx_lib, case, k, scale), whole[length - k :]), f"the last {k} rows"


def test_generated_rows_keep_their_bits_in_a_recompute(amx_lib):
    """A sequence recomputed after preemption holds prompt rows then generated ones: each class gets its own body's
    bits, the same as in the steps that first computed them, and a batch's other sequences change nothing."""
    prompt, generated = 90, 12
    ctx = [prompt + generated, 40]
    case = make_paged_case(ctx, ctx, 9, 3, 64, dtype=torch.bfloat16, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, 0.125)
    mixed = paged_attention_native(amx_lib, *args, _prompts([prompt, 40]))
    all_prompt = paged_attention_native(amx_lib, *args, _prompts(ctx))
    none = paged_attention_native(amx_lib, *args)
    assert torch.equal(mixed[:prompt], all_prompt[:prompt]), "prompt rows: the AMX body's bits"
    assert torch.equal(mixed[prompt : prompt + generated], none[prompt : prompt + generated]), "generated rows"
    assert torch.equal(mixed[prompt + generated :], all_prompt[prompt + generated :]), "the other sequence"
    # Each generated row as the decode that first computed it (all of a decode's rows are generated).
    for i in range(prompt, prompt + generated):
        seq_lens = _prompts([i + 1])
        decode = paged_attention_native(
            amx_lib, case.q[i : i + 1], case.k_cache, case.v_cache, None, seq_lens, case.block_tables[:1], 0.125,
            _prompts([0]),
        )  # fmt: skip
        assert torch.equal(decode, mixed[i : i + 1]), f"generated row {i}"


def test_prompt_queries_must_match_the_batch(native_lib):
    case = make_paged_case([10, 20], [10, 5], 2, 2, 64, dtype=torch.bfloat16)
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, 0.125)
    with pytest.raises(ValueError, match=r"prompt_queries \(3,\) must be \[num_seqs\]"):
        paged_attention_native(native_lib, *args, _prompts([10, 5, 1]))
    # Counts past a sequence's queries (or negative) are clamped: every query a prompt row, or none.
    assert torch.equal(
        paged_attention_native(native_lib, *args, _prompts([99, 5])),
        paged_attention_native(native_lib, *args, _prompts([10, 5])),
    )
    assert torch.equal(
        paged_attention_native(native_lib, *args, _prompts([-4, 0])), paged_attention_native(native_lib, *args)
    )
