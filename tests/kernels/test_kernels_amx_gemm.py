"""The row-invariant bf16 GEMM on AMX (ucm_kernels/cpu/amx_gemm.c): results within bf16 rounding of an fp32 product of
the same bf16 operands, every row's bits independent of the call's size and of where the row sits in it, and the
engine's bf16 linear layers routed through it where oneDNN's rows are not invariant. Needs a CPU with AMX (the
others skip, except the checks of what the library says without it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.attention import set_forward_context
from engine.generated_rows import GeneratedRows
from engine.models import dense as dense_mod
from ucm_kernels import api
from ucm_kernels.cpu import amx_gemm, q4_bf16
from ucm_kernels.cpu.calibration import bf16_linear_rows_invariant
from ucm_kernels.cpu.q4_panels import random_q4_weight


@pytest.fixture
def amx_lib(native_lib):
    if not native_lib.has_amx:
        pytest.skip("this CPU (or compiler) has no AMX: the library has no AMX kernel")
    return native_lib


# amx_gemm.c's orders past MID_ROWS + SLACK_ROWS rows: (960, 576) and (3072, 576) in row groups, k in passes;
# (128, 896) one group (ONE_GROUP_K), one pass over k (ONE_PASS_K); (576, 1536) and (256, 4160) a K of ONE_PASS_K or
# more that fits L2: one pass over k; (64, 6592) a K past that: k in chunks (KCB_PAST_L2, the last one short) from
# MID_ROWS_PAST_L2 + SLACK_ROWS rows on, one row block up to WHOLE_PAST_L2 rows, blocks of MC_PAST_L2 past it, the
# sums kept between chunks, the last rows padded once a call.
SHAPES = [(960, 576), (3072, 576), (128, 896), (576, 1536), (256, 4160), (64, 6592), (64, 32)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_within_bf16_rounding_of_the_fp32_product(amx_lib, n, k):
    gen = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(77, k, generator=gen).bfloat16()
    got = amx_gemm.linear(amx_lib, x, amx_gemm.pack(w)).float()
    want = x.float() @ w.float().t()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2**-7)  # the output rounded to bf16 (8 bits)


@pytest.mark.parametrize("n,k", SHAPES[:6])
def test_a_rows_bits_do_not_depend_on_the_call(amx_lib, n, k):
    gen = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(1100, k, generator=gen).bfloat16()
    packed = amx_gemm.pack(w)
    whole = amx_gemm.linear(amx_lib, x, packed)
    # few rows, MID_ROWS and SLACK_ROWS (one group or two), groups of equal size (1100 rows: three of 11, 12, 12 slices)
    for m in (1, 5, 8, 16, 17, 31, 32, 33, 40, 48, 64, 100, 128, 129, 256, 512, 513, 519, 576, 577, 600, 1024):
        assert torch.equal(amx_gemm.linear(amx_lib, x[:m], packed), whole[:m]), f"{m} rows"
    for start in (1, 7, 33, 500):
        part = slice(start, start + 200)
        assert torch.equal(amx_gemm.linear(amx_lib, x[part], packed), whole[part]), f"rows from {start}"
    torch.set_num_threads(1)
    try:
        assert torch.equal(amx_gemm.linear(amx_lib, x, packed), whole), "one thread"
    finally:
        torch.set_num_threads(2)


_SMALL_TEAM = """
import sys, torch
from ucm_kernels.cpu import amx_gemm, native
torch.set_num_threads(3)
gen = torch.Generator().manual_seed(5)
w, x = torch.randn(1120, 896, generator=gen).bfloat16(), torch.randn(8, 896, generator=gen).bfloat16()
torch.save(amx_gemm.linear(native.load(), x, amx_gemm.pack(w)), sys.argv[1])
"""


def test_a_few_rows_call_computes_every_output_in_a_team_smaller_than_asked(amx_lib, tmp_path):
    # A call of at most 16 rows gives each of the threads asked for a share of its 64-output units, and a thread done
    # with its own takes the others' (claim_unit): asked for 3 threads under OMP_THREAD_LIMIT=1, one thread must
    # take all three shares. 1120 outputs: 17 units and a last one of 32.
    out = tmp_path / "y.pt"
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _SMALL_TEAM, str(out)], env=env, cwd=root, check=True, timeout=300)
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(1120, 896, generator=gen).bfloat16(), torch.randn(8, 896, generator=gen).bfloat16()
    want = amx_gemm.linear(amx_lib, x, amx_gemm.pack(w))
    assert torch.equal(torch.load(out), want)


def test_the_engines_bf16_layers_take_it_where_onednn_rows_vary(amx_lib):
    w = torch.randn(960, 576).bfloat16()
    packed = dense_mod.pack_weight(w)
    assert isinstance(packed, dense_mod.BF16Packed)
    if bf16_linear_rows_invariant():
        assert packed.amx is None, "oneDNN is row-invariant here: no second copy"
        return
    assert packed.amx is not None and packed.onednn is None, "the AMX copy replaces oneDNN's, not beside it"
    x = torch.randn(40, 576).bfloat16()
    want = amx_gemm.linear(amx_lib, x, packed.amx.packed)
    assert torch.equal(dense_mod.dense(x, w, None, packed), want)
    # A bias (Qwen's qkv) is added to the kernel's rows, so a row's bits still stand alone.
    bias = torch.randn(960).bfloat16()
    with_bias = dense_mod.dense(x, w, bias, packed)
    assert torch.equal(with_bias, want + bias)
    assert torch.equal(dense_mod.dense(x[7:9], w, bias, packed), with_bias[7:9])


@pytest.mark.parametrize("n,k", [(3072, 576), (64, 32)])
def test_a_paired_gate_up_gives_the_plain_product_and_its_silu(amx_lib, n, k):
    """Packed with its gate and up panels alternating, the weight gives the plain product (PAIRS), and the SiLU
    epilogue gives ucm_kernels.api.silu_and_mul of that product bit for bit, each row alone."""
    gen = torch.Generator().manual_seed(n + k)
    w, x = (torch.randn(n, k, generator=gen) * 0.1).bfloat16(), torch.randn(300, k, generator=gen).bfloat16()
    plain = amx_gemm.linear(amx_lib, x, amx_gemm.pack(w))
    paired = amx_gemm.AmxWeight(amx_lib, amx_gemm.pack(w, paired=True), paired=True)
    assert torch.equal(paired.linear(x), plain)
    fused = paired.silu_and_mul(x)
    assert fused.shape == (300, n // 2)
    assert torch.equal(fused, api.silu_and_mul(plain))
    for m in (1, 17, 33, 130):
        assert torch.equal(paired.silu_and_mul(x[:m]), fused[:m]), f"{m} rows"
    with pytest.raises(AssertionError, match="paired"):
        amx_gemm.AmxWeight(amx_lib, amx_gemm.pack(w)).silu_and_mul(x)


def test_the_silu_epilogue_gives_every_gate_what_silu_and_mul_computes(amx_lib):
    """The epilogue looks SiLU up in a table of every bf16 gate (amx_gemm.c); silu_and_mul computes it. A weight of
    two identities (gate rows, then up rows) passes x through as gate and up, so every finite bf16 value reaches the
    epilogue as a gate (the tiles flush denormals to zero and a -0 to +0: those arrive as +0)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16)
    x = values[torch.isfinite(values)]
    x = torch.cat((x, x[: -x.numel() % 32])).reshape(-1, 32)
    eye = torch.eye(32, dtype=torch.bfloat16)
    w = torch.cat((eye, eye))
    plain = amx_gemm.linear(amx_lib, x, amx_gemm.pack(w))
    normal = x.float().abs() >= torch.finfo(torch.bfloat16).tiny
    assert torch.equal(plain[:, :32][normal], x[normal]), "the identity passes every normal gate through"
    fused = amx_gemm.AmxWeight(amx_lib, amx_gemm.pack(w, paired=True), paired=True).silu_and_mul(x)
    assert torch.equal(fused.view(torch.int16), api.silu_and_mul(plain).view(torch.int16))


def test_rows_4k_apart_are_padded_and_taken_with_any_stride(amx_lib):
    """A SiLU output whose rows would be a multiple of 4 KB apart comes with its rows 64 bytes further apart
    (`padded_rows`), and x of any row stride gives the bits of its contiguous copy: the down projection takes the
    gate_up's output as it is."""
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(4096, 64, generator=gen) * 0.1).bfloat16()  # SiLU output: 2048 wide, 4 KB a row
    down = (torch.randn(96, 2048, generator=gen) * 0.1).bfloat16()
    x = torch.randn(300, 64, generator=gen).bfloat16()
    h = amx_gemm.AmxWeight(amx_lib, amx_gemm.pack(gate_up, paired=True), paired=True).silu_and_mul(x)
    assert h.shape == (300, 2048) and h.stride() == (2048 + 32, 1), "rows 64 bytes apart past 4 KB"
    assert torch.equal(h, api.silu_and_mul(amx_gemm.linear(amx_lib, x, amx_gemm.pack(gate_up))))
    packed = amx_gemm.pack(down)
    want = amx_gemm.linear(amx_lib, h.contiguous(), packed)
    for rows in (slice(None), slice(0, 16), slice(3, 40), slice(5, 205)):  # few, mid and padded-slice paths
        assert torch.equal(amx_gemm.linear(amx_lib, h[rows], packed), want[rows]), f"rows {rows}"
    assert amx_gemm.padded_rows(8, 2048).is_contiguous(), "a decode's few rows are not padded"
    assert amx_gemm.padded_rows(300, 576).is_contiguous(), "nor rows that are not 4 KB apart"


def test_the_engines_gate_up_takes_the_silu_epilogue_by_row_class(amx_lib):
    """An MLP's gate_up: prompt rows through the AMX kernel with SiLU in its epilogue, generated rows through the
    4-bit panels and then silu_and_mul; each row's bits are what the unfused path gives it, however a step mixes
    the two classes."""
    gen = torch.Generator().manual_seed(9)
    w32 = random_q4_weight(128, 64, gen)
    w, x = w32.bfloat16(), torch.randn(9, 64, generator=gen).bfloat16()
    panels = q4_bf16.pack(w32)
    assert panels is not None
    packed = dense_mod.pack_weight(w, dense_mod.DecodePanels(amx_lib, panels), gate_up=True)
    assert isinstance(packed, dense_mod.BF16Packed)
    if bf16_linear_rows_invariant():
        assert packed.amx is None
    else:
        assert packed.amx is not None and packed.amx.paired
        from_panels = api.silu_and_mul(q4_bf16.linear(amx_lib, x, panels))
        assert (packed.amx.silu_and_mul(x) != from_panels).any(), "the two classes must differ for routing to show"
    meta = object()  # the matmul reads only the generated rows from the context
    for mask in (np.ones(9, bool), np.zeros(9, bool), np.array([0, 1, 1, 0, 0, 1, 0, 0, 1], bool)):
        with set_forward_context(meta, None, GeneratedRows.from_mask(mask, torch.device("cpu"))):  # type: ignore[arg-type]
            got = dense_mod.dense_silu_and_mul(x, w, None, packed)
            want = api.silu_and_mul(dense_mod.dense(x, w, None, packed))
        assert torch.equal(got, want), f"rows {mask.astype(int).tolist()}"


def test_bad_operands_are_refused(native_lib):
    with pytest.raises(ValueError, match="multiples of 32"):
        amx_gemm.pack(torch.randn(48, 64).bfloat16())
    with pytest.raises(ValueError, match="multiples of 32"):
        amx_gemm.pack(torch.randn(64, 64))
    if not native_lib.has_amx:  # the layout is the kernel's (layout_chunk): no kernel, nothing to pack for
        with pytest.raises(RuntimeError, match="not available here: no AMX"):
            amx_gemm.pack(torch.randn(64, 64).bfloat16())
        return
    packed = amx_gemm.pack(torch.randn(64, 64).bfloat16())
    with pytest.raises(ValueError, match=r"\[M, 64\] bf16"):
        amx_gemm.linear(native_lib, torch.randn(3, 32).bfloat16(), packed)
