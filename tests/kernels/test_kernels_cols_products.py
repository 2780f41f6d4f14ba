"""The bf16 decode body's two forms of its products (paged_attention_dpbf16.h: cols_products): VDPBF16PS, and its two
FMAs under DAZ and FTZ. Each is forced in turn, whichever this CPU's probe picked; a row's bits must not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm_kernels.cpu import native
from ucm_kernels.cpu.paged_attention import paged_attention_native, shared_prefix_groups
from ucm_kernels.testing import make_paged_case

VDPBF16PS, FMA = 1, 2
LENS = [1, 17, 63, 64, 65, 300, 551, 1000, 1537, 2048]  # odd key counts leave a chunk's last key without its pair


@pytest.fixture
def lib(vdpbf16_rows) -> native.NativeLib:
    native_lib = vdpbf16_rows
    form = native_lib.cols_products(-1)
    if form == -1:
        pytest.skip(f"this build ({native_lib.vector_path}) has no bf16 cols body")
    yield native_lib
    native_lib.cols_products(form)  # the probe's pick again, for the tests after this one


def _both_forms(lib: native.NativeLib, *args) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for form in (VDPBF16PS, FMA):
        assert lib.cols_products(form) == form
        outs.append(paged_attention_native(lib, *args))
    return outs[0], outs[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 64), (14, 2, 64), (9, 3, 80), (8, 1, 128)])
def test_the_two_forms_give_a_decode_the_bits_of_its_prompt_row(lib, threads, hq, hkv, d):
    """Decodes (one query a sequence, and two: still fewer than 8 rows a kv head) in both forms, against the same
    rows computed in their prompts by the rows-in-lanes body (no prompt_queries: not the AMX one)."""
    queries = [1] * len(LENS) if hq // hkv > 3 else [1, 2] * (len(LENS) // 2)
    case = make_paged_case(LENS, LENS, hq, hkv, d, dtype=torch.bfloat16, seed=3)
    lens = torch.tensor(LENS, dtype=torch.int32)
    whole = paged_attention_native(lib, case.q, case.k_cache, case.v_cache, case.query_start_loc, lens,
                                   case.block_tables, d**-0.5)  # fmt: skip
    ends = case.query_start_loc[1:].tolist()
    rows = [i for end, n in zip(ends, queries, strict=True) for i in range(end - n, end)]
    qsl = torch.tensor([0, *np.cumsum(queries)], dtype=torch.int32)
    dp, fma = _both_forms(lib, case.q[rows], case.k_cache, case.v_cache, qsl, lens, case.block_tables, d**-0.5)
    assert torch.equal(_bits(dp), _bits(fma)), "the FMA form changed a row's bits"
    assert torch.equal(_bits(dp), _bits(whole[rows])), "a decode row differs from its prompt row"


def test_vanishing_weights_and_denormals_keep_the_bits(lib, threads):
    """Scores ~1000 apart (weights at exp2's 2^-127 floor, bf16 denormals in P) and denormal q, K, V elements:
    what VDPBF16PS reads as zero and flushes, the FMA form must too."""
    hq, hkv, d = 12, 3, 64
    case = make_paged_case(LENS, LENS, hq, hkv, d, dtype=torch.bfloat16, seed=9)
    g = torch.Generator().manual_seed(2)
    tiny = torch.tensor(1e-39, dtype=torch.bfloat16)  # a bf16 denormal
    assert 0 < tiny.float().abs() < torch.finfo(torch.float32).tiny
    k_cache, v_cache, q = case.k_cache * 6, case.v_cache.clone(), case.q * 6
    for t in (k_cache, v_cache, q):
        t[torch.rand(t.shape, generator=g) < 0.05] = tiny
        t[torch.rand(t.shape, generator=g) < 0.05] = torch.tensor(1e-20, dtype=torch.bfloat16)  # products underflow
    lens = torch.tensor(LENS, dtype=torch.int32)
    whole = paged_attention_native(lib, q, k_cache, v_cache, case.query_start_loc, lens, case.block_tables, 1.0)
    last = [end - 1 for end in case.query_start_loc[1:].tolist()]
    dp, fma = _both_forms(lib, q[last], k_cache, v_cache, None, lens, case.block_tables, 1.0)
    assert torch.equal(_bits(dp), _bits(fma)), "the FMA form changed a row's bits"
    assert torch.equal(_bits(dp), _bits(whole[last])), "a decode row differs from its prompt row"


def test_decodes_sharing_a_prefix_keep_their_bits_in_both_forms(lib, threads):
    """Decodes whose tables begin with the same blocks run as one item (paged_attention_shared.h), in either form."""
    hq, hkv, d, bs = 16, 4, 64, 16
    lens = [700, 650, 801, 640, 90]
    case = make_paged_case(lens, [1] * len(lens), hq, hkv, d, dtype=torch.bfloat16, seed=4)
    tables = case.block_tables.clone()
    tables[1:4, :32] = tables[0, :32]  # 512 keys in common: 8 whole chunks
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    groups = shared_prefix_groups(lib, seq_lens, tables, hq, hkv, d, bs)
    assert groups is not None
    assert min(groups[:4]) >= 0 and groups[4] == -1, f"the sharers did not group: {groups}"
    dp, fma = _both_forms(lib, case.q, case.k_cache, case.v_cache, None, seq_lens, tables, d**-0.5)
    assert torch.equal(_bits(dp), _bits(fma)), "the FMA form changed a row's bits"
    alone = torch.cat([paged_attention_native(lib, case.q[i : i + 1], case.k_cache, case.v_cache, None,
                                              seq_lens[i : i + 1], tables[i : i + 1], d**-0.5) for i in range(5)])  # fmt: skip
    assert torch.equal(_bits(fma), _bits(alone)), "a grouped row differs from its own item's"


def test_the_callers_floating_point_mode_is_kept(lib):
    """The items run with DAZ and FTZ set; the calling thread gets its mode back (denormals stay denormals)."""
    case = make_paged_case([300, 40], [1, 1], 8, 2, 64, dtype=torch.bfloat16, seed=1)
    for form in (VDPBF16PS, FMA):
        lib.cols_products(form)
        paged_attention_native(lib, case.q, case.k_cache, case.v_cache, None, case.seq_lens, case.block_tables, 0.1)
        smallest = np.float32(np.finfo(np.float32).tiny)
        assert smallest / np.float32(4) > 0, "FTZ left set on the calling thread"


def test_the_probe_picks_a_form(lib):
    assert lib.cols_products(0) in (VDPBF16PS, FMA)
    assert lib.cols_products(-1) == lib.cols_products(-1), "the pick holds until set again"
