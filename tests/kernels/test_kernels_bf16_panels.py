"""bf16 panels (ucm_kernels/cpu/bf16_panels.py, skinny_gemm.c's bf16 kernel): an fp32 weight is taken as bf16 only when
every value is exactly a bf16, the kernel's output is then bit-identical to the fp32 panel kernel's (the -march=native
build, the AVX2 one and the scalar one; few-row tiles and the blocked loop), and `pack` picks it after 4- and 8-bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ucm_kernels.cpu import skinny_gemm
from ucm_kernels.cpu.bf16_panels import BF16Panels, pack_bf16, random_bf16_weight, skinny_linear_bf16
from ucm_kernels.cpu.q4_panels import Q4Panels, random_q4_weight
from ucm_kernels.cpu.q8_panels import Q8Panels, random_q8_weight
from ucm_kernels.cpu.skinny_gemm import PanelFormat, pack_panels, skinny_linear

# (rows, k, n, bias): one row; a partial tile with k off the 32-wide blocks; a decode step's 8; the blocked loop from
# 12 rows with a partial last panel; and k over several of the blocked loop's chunks.
CASES = [(1, 64, 40, False), (5, 100, 16, True), (8, 576, 96, False), (12, 64, 17, True), (30, 600, 37, True)]


@pytest.fixture(params=["each", "scalar"])
def some_build(request, each_build):
    return request.getfixturevalue("scalar_lib") if request.param == "scalar" else each_build


@pytest.mark.parametrize(("m", "k", "n", "bias"), CASES)
def test_bf16_kernel_is_bit_identical_to_the_fp32_panels(some_build, m, k, n, bias) -> None:
    lib = some_build
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = random_bf16_weight(n, k, gen)
    panels = pack_bf16(lib, w)
    assert panels is not None, "a weight of bf16 values must pack as bf16"
    assert panels.bp.numel() == -(-n // 16) * k * 16 and panels.bp.dtype == torch.int16, "half the fp32 panels' bytes"
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = skinny_linear_bf16(lib, x, panels, n, b)
    assert torch.equal(got, skinny_linear(lib, x, pack_panels(lib, w), n, b))
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert (got.double() - want).abs().max() <= 4 * k * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T).max()
    alone = torch.cat([skinny_linear_bf16(lib, x[i : i + 1], panels, n, b) for i in range(m)])
    assert torch.equal(got, alone), "each row the bits of a call of that row alone"
    out = torch.full((m, n), float("nan"))
    assert skinny_linear_bf16(lib, x, panels, n, b, out) is out and torch.equal(out, got)


def test_weights_that_are_not_exactly_bf16_are_not_packed_so(native_lib) -> None:
    gen = torch.Generator().manual_seed(1)
    assert pack_bf16(native_lib, torch.randn(16, 64, generator=gen)) is None, "random fp32 weights"
    w = random_bf16_weight(40, 64, gen)
    for row, col in ((0, 0), (39, 63), (33, 7)):  # the first, the last (in the partial last panel), one between
        nudged = w.clone()
        nudged.view(torch.int32)[row, col] += 1  # one weight one fp32 ulp off its bf16 value
        assert pack_bf16(native_lib, nudged) is None, (row, col)
    assert pack_bf16(native_lib, w) is not None


def test_bad_arguments(native_lib) -> None:
    panels = pack_bf16(native_lib, random_bf16_weight(32, 64, torch.Generator().manual_seed(2)))
    assert panels is not None
    with pytest.raises(ValueError, match="2-D fp32 CPU weight"):
        pack_bf16(native_lib, torch.randn(32, 64).bfloat16())
    with pytest.raises(ValueError, match="fp32"):
        skinny_linear_bf16(native_lib, torch.randn(2, 64).bfloat16(), panels, 32, None)
    with pytest.raises(ValueError, match="not 33 x 64"):
        skinny_linear_bf16(native_lib, torch.randn(2, 64), panels, 33, None)
    with pytest.raises(ValueError, match=r"contiguous fp32 \[2, 32\]"):
        skinny_linear_bf16(native_lib, torch.randn(2, 64), panels, 32, None, torch.empty(2, 31))


def test_pack_picks_the_fewest_bytes_the_weight_is_exactly(native_lib) -> None:
    gen = torch.Generator().manual_seed(3)
    cases = [
        (random_q4_weight(32, 64, gen), PanelFormat.Q4, Q4Panels),
        (random_q8_weight(32, 64, gen), PanelFormat.Q8, Q8Panels),
        (random_bf16_weight(32, 64, gen), PanelFormat.BF16, BF16Panels),
        (torch.randn(32, 64, generator=gen), PanelFormat.FP32, torch.Tensor),
    ]
    for w, fmt, kind in cases:
        found, panels = skinny_gemm.pack(native_lib, w)
        assert found is fmt and isinstance(panels, kind), (fmt, found)
