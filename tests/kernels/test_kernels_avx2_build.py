"""The library an AVX2-only x86 host builds (`UCM_CFLAGS=-march=x86-64-v3`), built and run here too: its elementwise
ops equal the -march=native build's within a bf16 ulp (1e-5 in fp32), and its rotary embedding bit for bit. The
attention and skinny-GEMM oracle tests run on both builds (`each_build`), so an AVX-512 host's CI covers the AVX2
paths a CPU without AVX-512 takes."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernels_elementwise import _norm_inputs, _qkv_case, assert_bf16_close
from ucm_kernels.cpu import elementwise as ew
from ucm_kernels.cpu import native

FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def assert_builds_agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two builds of one kernel: within a bf16 ulp, or FP32_TOL (their sum orders may differ)."""
    if got.dtype == torch.bfloat16:
        assert_bf16_close(got, want)
    else:
        torch.testing.assert_close(got, want, **FP32_TOL)


def test_the_avx2_build_is_its_own_library(avx2_lib, native_lib):
    assert avx2_lib.path != native_lib.path, "another flag set must name another library"
    assert not avx2_lib.has_q4_bf16, "the 4-bit decode kernel needs AVX-512 BF16: absent, so dispatch skips it"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (3, 7), (4, 4096 + 5)])
def test_norms_and_silu_equal_the_native_build(avx2_lib, native_lib, dtype, rows, hidden):
    x, weight, residual = (t.to(dtype) for t in _norm_inputs(rows, hidden, seed=rows + hidden))
    assert_builds_agree(ew.rms_norm_native(avx2_lib, x, weight, 1e-5), ew.rms_norm_native(native_lib, x, weight, 1e-5))
    res_a, res_n = residual.clone(), residual.clone()
    got = ew.fused_add_rms_norm_native(avx2_lib, x, res_a, weight, 1e-5)
    assert_builds_agree(got, ew.fused_add_rms_norm_native(native_lib, x, res_n, weight, 1e-5))
    assert torch.equal(res_a, res_n), "the residual sum is one add per element"
    gate_up = torch.cat([x, residual.to(dtype)], dim=-1)
    assert_builds_agree(ew.silu_and_mul_native(avx2_lib, gate_up), ew.silu_and_mul_native(native_lib, gate_up))


@pytest.mark.parametrize("tokens,hq,hkv,d", [(33, 9, 3, 64), (5, 4, 2, 40), (3, 2, 1, 8)])
def test_rotary_embedding_equals_the_native_build(avx2_lib, native_lib, tokens, hq, hkv, d):
    _, qk, cos, sin = _qkv_case(tokens, hq, hkv, d, seed=tokens + d)
    a, n = qk.clone(), qk.clone()
    ew.rotary_embedding_native(avx2_lib, a, cos, sin)
    ew.rotary_embedding_native(native_lib, n, cos, sin)
    assert torch.equal(a, n)


def test_extra_flags_name_another_library(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_compiler_version", lambda cc: "gcc 12.2.0")
    monkeypatch.setenv(native.EXTRA_FLAGS_ENV, "-march=x86-64-v3  -O2")
    assert native.extra_flags() == ("-march=x86-64-v3", "-O2")
    assert native.library_path("gcc", tmp_path, native.extra_flags()) != native.library_path("gcc", tmp_path)
