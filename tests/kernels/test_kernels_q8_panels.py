"""8-bit panels (ucm_kernels/cpu/q8_panels.py, skinny_gemm.c's q8 kernel): a weight is taken as Q8_0 only when every
weight comes back bit for bit, the q8 kernel's output is then bit-identical to the fp32 panel kernel's (in the
-march=native build and in the AVX2 one), and an fp32 model's lm_head (the GGUF's Q8_0 tied embedding) is packed so."""

from __future__ import annotations

import pytest
import torch

from ucm_kernels.cpu import linear_mode, skinny_gemm
from ucm_kernels.cpu.q8_panels import Q8Panels, find_q8, pack_q8, random_q8_weight, skinny_linear_q8
from ucm_kernels.cpu.skinny_gemm import PanelFormat, pack_panels, skinny_linear


@pytest.mark.parametrize(
    ("m", "k", "n", "bias"), [(1, 64, 40, False), (5, 96, 16, True), (8, 576, 960, False), (16, 576, 72, True)]
)
def test_q8_kernel_is_bit_identical_to_the_fp32_panels(each_build, m, k, n, bias) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = random_q8_weight(n, k, gen)
    q8 = pack_q8(w)
    assert q8 is not None, "a weight built as q * d must be found 8-bit"
    q, d = find_q8(w)
    rebuilt = torch.from_numpy(q).float().reshape(n, k // 32, 32) * torch.from_numpy(d)[..., None]
    assert torch.equal(rebuilt.reshape(n, k).view(torch.int32), w.view(torch.int32))
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = skinny_linear_q8(each_build, x, q8, n, b)
    assert torch.equal(got, skinny_linear(each_build, x, pack_panels(each_build, w), n, b))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    out = torch.full((m, n), float("nan"))
    assert skinny_linear_q8(each_build, x, q8, n, b, out) is out and torch.equal(out, got)


def test_weights_that_are_not_exactly_q8_stay_as_they_are() -> None:
    gen = torch.Generator().manual_seed(1)
    assert find_q8(torch.randn(16, 64, generator=gen)) is None, "random fp32 weights"
    w = random_q8_weight(16, 64, gen)
    nudged = w.clone()
    nudged.view(torch.int32)[3, 17] += 1  # one weight one ulp off
    assert find_q8(nudged) is None
    assert find_q8(w[:, :48].contiguous()) is None, "k not a multiple of the 32-wide blocks"
    assert find_q8(w.bfloat16()) is None


def test_bad_arguments(native_lib) -> None:
    q8 = pack_q8(random_q8_weight(32, 64, torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="fp32"):
        skinny_linear_q8(native_lib, torch.randn(2, 64).bfloat16(), q8, 32, None)
    with pytest.raises(ValueError, match="not 33 x 64"):
        skinny_linear_q8(native_lib, torch.randn(2, 64), q8, 33, None)
    with pytest.raises(ValueError, match=r"contiguous fp32 \[2, 32\]"):
        skinny_linear_q8(native_lib, torch.randn(2, 64), q8, 32, None, torch.empty(2, 31))


def test_the_fp32_models_lm_head_is_packed_as_q8_panels(native_lib, smollm2_fp32, monkeypatch) -> None:
    """The embedded model's lm_head (the GGUF's Q8_0 tied embedding) takes the 8-bit panels in an fp32 model, and
    its decode rows through them equal the fp32 panels' bits."""
    monkeypatch.setenv(linear_mode.ENV, "native")  # the kernel at every row count, whatever this host measured
    w = smollm2_fp32.model.lm_head_weight.detach()
    packed = skinny_gemm.panel_weight(native_lib, w)
    assert packed is not None and isinstance(packed.panels, Q8Panels)
    x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(4))
    fp32 = skinny_linear(native_lib, x, pack_panels(native_lib, w), w.shape[0], None)
    assert torch.equal(packed.linear(x, None), fp32)


def test_a_quantized_packing_that_never_wins_falls_back_to_the_fp32_panels(native_lib, monkeypatch, tmp_path) -> None:
    """Where memory is fast, expanding 8-bit panels can cost more than reading fp32 ones: the calibration says so per
    format, and the weight then takes the fp32 panels up to their own row count."""
    monkeypatch.setenv(linear_mode.ENV, "auto")
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(skinny_gemm, "MIN_PACK_BYTES", 0)
    wins = {PanelFormat.Q8: 0, PanelFormat.FP32: 4}
    measured: list[PanelFormat] = []

    def fake_measure(lib, k, n, fmt=PanelFormat.FP32):
        measured.append(fmt)
        return [{r: (1.0, 2.0) if r <= wins[fmt] else (2.0, 1.0) for r in skinny_gemm.ROW_LADDER}] * 2

    monkeypatch.setattr(skinny_gemm, "measure", fake_measure)
    skinny_gemm.forget()
    try:
        w = random_q8_weight(64, 64, torch.Generator().manual_seed(5))
        packed = skinny_gemm.panel_weight(native_lib, w)
        assert measured == [PanelFormat.Q8, PanelFormat.FP32], measured
        assert packed is not None and isinstance(packed.panels, torch.Tensor) and packed.max_rows == 4
        wins[PanelFormat.Q8] = 8
        skinny_gemm.forget()
        for stored in tmp_path.glob("kernels/linear-*.json"):
            stored.unlink()
        packed = skinny_gemm.panel_weight(native_lib, w)
        assert packed is not None and isinstance(packed.panels, Q8Panels) and packed.max_rows == 8
    finally:
        skinny_gemm.forget()
