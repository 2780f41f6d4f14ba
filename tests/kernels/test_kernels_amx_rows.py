"""The generated bf16 rows' AMX body (ucm_kernels/cpu/paged_attention_amx_rows.h): against the float64 oracle, the
same bits for a row whatever the batch, the thread count or the call form (a decode, or a recomputed sequence's
generated rows), nothing read past a sequence's last key, and the switch that sends the rows back to the VDPBF16PS
bodies. Needs a CPU with AMX (the others skip)."""

from __future__ import annotations

import pytest
import torch

from ucm_kernels.cpu import native
from ucm_kernels.cpu.paged_attention import paged_attention_native, shared_prefix_groups
from ucm_kernels.testing import make_paged_case, naive_attention

TOL = dict(atol=2e-2, rtol=2e-2)  # the output is rounded to bf16, and P to bf16 for its product with V
# Qwen2.5's GQA 7, Llama-1B's 4, SmolLM2's 3; group 16 (a tile's columns) and 1; head_dim 128 (4 heads a pass over
# 8 kv heads: two passes) and 96 (the generic path: 3 tiles of 32); 16 kv heads (two passes of 8)
HEADS = [(14, 2, 64), (32, 8, 64), (9, 3, 64), (32, 2, 64), (16, 16, 64), (16, 8, 128), (12, 4, 96)]
# one key; a chunk's last key without its pair; whole chunks; many chunks; and an empty (padding) sequence
LENS = [1, 17, 63, 64, 65, 300, 1000, 0]


@pytest.fixture
def rows_lib(native_lib) -> native.NativeLib:
    if native_lib.amx_rows(-1) != 1:
        pytest.skip("no AMX here (or the OS refused it): generated rows take the VDPBF16PS bodies")
    return native_lib


def _decode(lib: native.NativeLib, case, seqs: list[int], scale: float, threads: int) -> torch.Tensor:
    """Sequences `seqs` as one decode call (a query each, row i of q for sequence i), on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return paged_attention_native(
            lib, case.q[seqs], case.k_cache, case.v_cache, None, case.seq_lens[seqs], case.block_tables[seqs], scale
        )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("hq", "hkv", "d"), HEADS)
@pytest.mark.parametrize("block_size", [16, 5])  # 5: every 16 keys cross a block's end (gathered, not loaded)
def test_decodes_match_the_oracle_and_keep_their_bits_in_any_batch(rows_lib, hq, hkv, d, block_size):
    case = make_paged_case(LENS, [1] * len(LENS), hq, hkv, d, block_size=block_size, dtype=torch.bfloat16, seed=hq)
    scale = d**-0.5
    every = list(range(len(LENS)))
    batch = _decode(rows_lib, case, every, scale, threads=2)
    live = [i for i, n in enumerate(LENS) if n > 0]
    dense = naive_attention(
        case.q[live], [case.keys[i] for i in live], [case.values[i] for i in live], [1] * len(live), scale
    )
    torch.testing.assert_close(batch[live].double(), dense, **TOL)
    assert not batch[LENS.index(0)].any(), "a padding sequence's rows are 0"
    assert torch.equal(_decode(rows_lib, case, every, scale, threads=1), batch), "the thread count changes nothing"
    shuffled = [5, 2, 7, 0, 6, 1, 4, 3]
    assert torch.equal(_decode(rows_lib, case, shuffled, scale, threads=2), batch[shuffled]), "the batch's order"
    for i in live:  # alone: one thread (one item of every kv head), two (the kv heads cut into parts)
        for threads in (1, 2):
            assert torch.equal(_decode(rows_lib, case, [i], scale, threads), batch[i : i + 1]), (i, threads)
    plain = paged_attention_native(
        rows_lib, case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, scale
    )
    assert torch.equal(plain, batch), "the same rows through query_start_loc"


def test_nothing_past_a_sequences_last_key_is_read(rows_lib):
    """NaN in every cache slot past each sequence's length (the rest of its last block, the unused blocks): the tile
    loads read a block's 16 rows whole and the last chunk's pairs run to 16, so those must drop out exactly."""
    hq, hkv, d = 14, 2, 64
    lens = [17, 63, 65, 300]
    case = make_paged_case(lens, [1] * len(lens), hq, hkv, d, dtype=torch.bfloat16, seed=5)
    scale = d**-0.5
    clean = _decode(rows_lib, case, list(range(len(lens))), scale, threads=2)
    used = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for i, n in enumerate(lens):
        for t in range(n):
            used[case.block_tables[i, t // 16], t % 16] = True
    case.k_cache[~used] = float("nan")
    case.v_cache[~used] = float("nan")
    dirty = _decode(rows_lib, case, list(range(len(lens))), scale, threads=2)
    assert torch.equal(dirty, clean)


def test_an_earlier_items_values_never_reach_a_later_one(rows_lib):
    """One thread runs the 64-key sequence (V of keys 2..63 inf: its output is not finite), then the 17-key one: the
    pairs past its 9 in its chunk's V scratch must be zeros, not the earlier item's inf (0 x inf is NaN)."""
    case = make_paged_case([64, 17], [1, 1], 7, 1, 64, dtype=torch.bfloat16, seed=6)
    alone = _decode(rows_lib, case, [1], 0.125, threads=1)
    for t in range(2, 64):
        case.v_cache[case.block_tables[0, t // 16], t % 16] = float("inf")
    both = _decode(rows_lib, case, [0, 1], 0.125, threads=1)  # one thread: sequence 0's item, then 1's
    assert not both[0].isfinite().all(), "the inf values were read"
    assert torch.equal(both[1:2], alone)


def test_a_recomputed_sequences_generated_rows_keep_the_decodes_bits(rows_lib):
    """After preemption a sequence's prompt and generated tokens are recomputed in one call, the prompt rows marked:
    each generated row must get the bits its decode got (one item a token), the prompt rows the AMX prompt body's."""
    prompt, generated = 90, 12
    ctx = [prompt + generated, 40]
    case = make_paged_case(ctx, ctx, 7, 1, 64, dtype=torch.bfloat16, seed=4)
    args = (case.q, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens, case.block_tables, 0.125)
    mixed = paged_attention_native(rows_lib, *args, torch.tensor([prompt, 40], dtype=torch.int32))
    for i in range(prompt, prompt + generated):
        decode = paged_attention_native(
            rows_lib, case.q[i : i + 1], case.k_cache, case.v_cache, None, torch.tensor([i + 1], dtype=torch.int32),
            case.block_tables[:1], 0.125,
        )  # fmt: skip
        assert torch.equal(decode, mixed[i : i + 1]), f"generated row {i}"
    dense = naive_attention(case.q, case.keys, case.values, ctx, 0.125)
    torch.testing.assert_close(mixed.double(), dense, **TOL)


def test_the_switch_sends_generated_rows_back_to_the_vdpbf16_bodies(rows_lib, vdpbf16_rows_off_and_on):
    """ucm_amx_rows(0): the cols body's bits (what an AVX-512 BF16 host without AMX computes); (1): this body's again."""
    case = make_paged_case([300, 551], [1, 1], 14, 2, 64, dtype=torch.bfloat16, seed=8)
    on = _decode(rows_lib, case, [0, 1], 0.125, threads=2)
    off = vdpbf16_rows_off_and_on(lambda: _decode(rows_lib, case, [0, 1], 0.125, threads=2))
    assert not torch.equal(on, off), "tiles sum their pairs in another order than VDPBF16PS: some bits differ"
    torch.testing.assert_close(on.double(), off.double(), **TOL)
    assert torch.equal(_decode(rows_lib, case, [0, 1], 0.125, threads=2), on), "switched back on"


@pytest.fixture
def vdpbf16_rows_off_and_on(rows_lib):
    def run(fn):
        assert rows_lib.amx_rows(0) == 0
        try:
            return fn()
        finally:
            assert rows_lib.amx_rows(1) == 1

    return run


def test_decodes_sharing_a_prefix_are_not_grouped(rows_lib, vdpbf16_rows_off_and_on):
    """Groups are cols items: with generated rows on tiles a batch sharing its blocks gets none (each decode its own
    items), and shared_prefix_groups, which reports them, says so; on the VDPBF16PS bodies the same batch groups."""
    lens = torch.tensor([1100 + 10 * i for i in range(8)], dtype=torch.int32)
    tables = torch.arange(8 * 80, dtype=torch.int32).view(8, 80)
    tables[:, :64] = tables[0, :64]  # 1024 keys in common

    def groups() -> list[int] | None:
        return shared_prefix_groups(rows_lib, lens, tables, 9, 3, 64, 16)

    assert groups() == [-1] * 8
    assert any(g >= 0 for g in vdpbf16_rows_off_and_on(groups) or []), "the VDPBF16PS bodies group this batch"
