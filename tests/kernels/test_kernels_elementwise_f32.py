"""The fp32 elementwise kernels (ucm_kernels/cpu/elementwise_f32.c) against their torch references and their dispatch.

RoPE and the residual add are the same IEEE operations as torch's: bit-identical. RMSNorm sums its squares in
another order and SiLU's exp is the kernel's own: a few fp32 ulps (measured at most 5 on random inputs)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.native_spy import spy
from ucm_kernels import api
from ucm_kernels.cpu import native
from ucm_kernels.reference import fused_add_rms_norm_torch, rms_norm_torch, rotary_embedding_torch, silu_and_mul_torch

EPS = 1e-5
MAX_ULPS = 16
# Scalar tails past the 8-lane vectors and the 32-wide unrolled sum, SmolLM2's hidden size, a multi-thread size.
NORM_SHAPES = [(1, 576), (37, 576), (5, 100), (3, 7), (2, 17), (129, 1024)]


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns mapped to integers in value order, so a difference counts ulps (across zero too)."""
    bits = t.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(2**31) - bits, bits)


def assert_f32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    assert torch.equal(got.isnan(), want.isnan()), "NaNs in different places"
    finite = ~want.isnan()
    ulps = (_ordered(got[finite]) - _ordered(want[finite])).abs()
    assert int(ulps.max()) <= MAX_ULPS, f"max {int(ulps.max())} ulps apart"


def _threads(n: int):
    class _Set:
        def __enter__(self) -> None:
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc: object) -> None:
            torch.set_num_threads(self.before)

    return _Set()


@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm_and_fused_add_match_torch(native_lib, native_mode, monkeypatch, rows, hidden):
    g = torch.Generator().manual_seed(rows * 7919 + hidden)
    x = torch.randn(rows, hidden, generator=g) * 3
    weight = torch.rand(hidden, generator=g) + 0.5
    residual = torch.randn(rows, hidden, generator=g)
    calls = spy(monkeypatch, native_lib, "rms_norm_f32")
    with _threads(2):
        assert_f32_close(api.rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    assert calls == [1], "a contiguous fp32 CPU norm must take the native kernel"
    want_residual = residual.clone()
    want = fused_add_rms_norm_torch(x, want_residual, weight, EPS)
    calls = spy(monkeypatch, native_lib, "fused_add_rms_norm_f32")
    with _threads(2):
        got = api.fused_add_rms_norm(x, residual, weight, EPS)
    assert calls == [1]
    assert torch.equal(residual, want_residual), "the residual add is one IEEE add, as torch's add_"
    assert_f32_close(got, want)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 1536), (7, 40), (3, 5)])
def test_silu_and_mul_matches_torch(native_lib, native_mode, monkeypatch, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    calls = spy(monkeypatch, native_lib, "silu_and_mul_f32")
    with _threads(2):
        got = api.silu_and_mul(gate_up)
    assert calls == [1]
    assert_f32_close(got, silu_and_mul_torch(gate_up))


def test_silu_edge_values(native_lib, native_mode):
    """Far into exp's under- and overflow, signed zeros, infinities and NaN, in the vector body (first 8 lanes
    ... 16) and the scalar tail (the rest)."""
    edge = [-200.0, -104.0, -88.5, -87.0, -20.0, -1e-30, 0.0, -0.0, 1e-30, 5.0, 88.0, 89.0, 100.0, 200.0]
    special = [float("inf"), float("-inf"), float("nan")]
    gates = torch.tensor(edge + special + edge[:3])
    gate_up = torch.cat((gates, torch.linspace(-2, 2, gates.numel()))).reshape(1, -1)
    assert_f32_close(api.silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


def _qkv_case(tokens: int, hq: int, hkv: int, d: int, seed: int):
    from engine.model_config import RopeScaling
    from engine.models.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)
    positions = torch.randint(0, 8192, (tokens,), generator=g)
    cos, sin = RotaryEmbedding(d, 10000.0, RopeScaling()).cos_sin(positions, torch.float32)
    return qkv, qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d), cos, sin


@pytest.mark.parametrize("tokens,hq,hkv,d", [(33, 9, 3, 64), (1, 9, 3, 64), (5, 4, 2, 40), (3, 2, 1, 8)])
def test_rotary_embedding_is_bit_identical_on_a_qkv_view(native_lib, native_mode, monkeypatch, tokens, hq, hkv, d):
    qkv, qk, cos, sin = _qkv_case(tokens, hq, hkv, d, seed=tokens * 31 + d)
    want = rotary_embedding_torch(qk, cos, sin)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    calls = spy(monkeypatch, native_lib, "rotary_embedding_f32")
    api.rotary_embedding_(qk, cos, sin)
    assert calls == [1]
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before), "v must not be touched"


def test_fp32_keeps_torch_math_when_native_is_off(native_lib, monkeypatch):
    monkeypatch.setenv("UCM_CPU_ATTENTION", "torch")
    monkeypatch.setattr(native, "load", lambda: pytest.fail("UCM_CPU_ATTENTION=torch must keep the library out"))
    g = torch.Generator().manual_seed(8)
    x, weight = torch.randn(7, 96, generator=g), torch.rand(96, generator=g) + 0.5
    assert torch.equal(api.rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    gate_up = torch.randn(7, 96, generator=g)
    assert torch.equal(api.silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


def test_mixed_dtypes_and_strided_rows_take_the_torch_path(native_lib, native_mode, monkeypatch):
    monkeypatch.setattr(native, "load", lambda: pytest.fail("these inputs must not reach the row kernels"))
    x = torch.randn(5, 100)
    assert torch.equal(
        api.rms_norm(x, torch.ones(100).bfloat16(), EPS), rms_norm_torch(x, torch.ones(100).bfloat16(), EPS)
    )
    wide = torch.randn(5, 200)
    assert torch.equal(api.silu_and_mul(wide[:, :64]), silu_and_mul_torch(wide[:, :64]))
