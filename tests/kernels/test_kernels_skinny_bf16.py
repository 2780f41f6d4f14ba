"""The bf16 decode matmul (kernels/cpu/skinny_bf16.c): results within bf16 rounding of a float64 reference, each
row's bits independent of the call around it, and its dispatch in `engine.models.dense` by row class (generated
rows through the kernel, prompt rows through oneDNN) where the calibration chose it. No timing asserts: `measure`
is replaced by fixed numbers wherever a choice is tested. Needs a CPU with AVX-512 BF16 (the others skip)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import set_forward_context
from engine.generated_rows import GeneratedRows
from engine.models import dense as dense_mod
from kernels.cpu import onednn_linear, skinny_bf16
from kernels.cpu.skinny_bf16 import kernel_wins, skinny_linear_bf16


@pytest.fixture
def bf16_lib(native_lib):
    if not native_lib.has_skinny_bf16:
        pytest.skip("this CPU has no AVX-512 BF16: the library has no decode kernel")
    if not onednn_linear.available():
        pytest.skip("this torch build has no oneDNN")
    return native_lib


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=gen).bfloat16(),
        torch.randn(n, k, generator=gen).bfloat16(),
        torch.randn(n, generator=gen).bfloat16(),
    )


# k: whole 32-blocks, a tail, shorter than one block; m, n: full 4 x 4 tiles and every tail
@pytest.mark.parametrize(("m", "n", "k"), [(8, 960, 576), (5, 9, 37), (1, 7, 5), (13, 33, 100), (4, 4, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float64_reference(bf16_lib, m, n, k, with_bias) -> None:
    x, w, b = _operands(m, n, k, seed=m * n + k)
    bias = b if with_bias else None
    got = skinny_linear_bf16(bf16_lib, x, w, bias)
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    # fp32 sums of exact products, then one bf16 rounding (2^-8 of the result)
    bound = want.abs() * 2**-8 + k * 2**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= bound).all()


def test_a_rows_bits_do_not_depend_on_the_call(bf16_lib) -> None:
    """Alone, in any position of a batch of any size, on 1 or 2 threads: the same bits (what the engine relies on)."""
    x, w, b = _operands(11, 70, 96, seed=3)
    whole = skinny_linear_bf16(bf16_lib, x, w, b)
    for i in range(x.shape[0]):
        assert torch.equal(skinny_linear_bf16(bf16_lib, x[i : i + 1], w, b), whole[i : i + 1])
    shuffled = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(skinny_linear_bf16(bf16_lib, x[shuffled], w, b), whole[shuffled])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(skinny_linear_bf16(bf16_lib, x[3:10], w, b), whole[3:10])
    finally:
        torch.set_num_threads(threads)


def test_bad_operands_are_value_errors(bf16_lib) -> None:
    x, w, b = _operands(2, 8, 32, seed=0)
    with pytest.raises(ValueError, match="bf16"):
        skinny_linear_bf16(bf16_lib, x.float(), w, None)
    with pytest.raises(ValueError, match="features"):
        skinny_linear_bf16(bf16_lib, x[:, :16], w, None)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear_bf16(bf16_lib, x, w, b[:4])


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """UCM_CPU_LINEAR=auto, a fresh cache dir, no size floor, and `measure` replaced by the (kernel ms, oneDNN ms)
    rounds in the returned list; the second item collects the (k, n) measured."""
    monkeypatch.setenv("UCM_CPU_LINEAR", "auto")
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    skinny_bf16.forget()
    monkeypatch.setattr(skinny_bf16, "MIN_PACK_BYTES", 0)
    rounds = [(1.0, 2.0), (1.0, 2.0)]
    measured: list[tuple[int, int]] = []
    monkeypatch.setattr(skinny_bf16, "measure", lambda lib, k, n: measured.append((k, n)) or list(rounds))
    yield rounds, measured
    skinny_bf16.forget()


def test_the_choice_follows_the_measurement_and_is_cached(bf16_lib, forced) -> None:
    rounds, measured = forced
    assert kernel_wins(bf16_lib, 64, 48) and measured == [(64, 48)]
    skinny_bf16.forget()
    assert kernel_wins(bf16_lib, 64, 48) and measured == [(64, 48)], "read back from this machine's cache file"
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]
    assert not kernel_wins(bf16_lib, 64, 40), "lost to oneDNN: not used"
    rounds[:] = [(1.0, 2.0), (2.0, 1.0)]
    assert not kernel_wins(bf16_lib, 64, 32), "rounds disagreed: oneDNN for now"
    skinny_bf16.forget()
    assert not kernel_wins(bf16_lib, 64, 32) and measured[-2:] == [(64, 32), (64, 32)], "... and measured again"


def test_the_environment_forces_either_way(bf16_lib, forced, monkeypatch) -> None:
    _, measured = forced
    monkeypatch.setenv("UCM_CPU_LINEAR", "torch")
    assert not kernel_wins(bf16_lib, 64, 48)
    monkeypatch.setenv("UCM_CPU_LINEAR", "native")
    assert kernel_wins(bf16_lib, 64, 48) and measured == []


def test_dense_routes_rows_by_class(bf16_lib, forced) -> None:
    """Generated rows get the kernel's bits, prompt rows oneDNN's, however the step mixes them; outside a forward
    (logits) and where the kernel lost, every row goes to oneDNN."""
    rounds, _ = forced
    # x = [u, u], w = [v, -v + e]: partial sums far larger than the result, so summation orders show in its bits
    gen = torch.Generator().manual_seed(5)
    u, v = torch.randn(9, 32, generator=gen), torch.randn(400, 32, generator=gen)
    x = torch.cat([u, u], 1).bfloat16()
    w = torch.cat([v, 1e-3 * torch.randn(400, 32, generator=gen) - v], 1).bfloat16()
    b = (1e-3 * torch.randn(400, generator=gen)).bfloat16()
    packed = dense_mod.pack_weight(w)
    assert isinstance(packed, dense_mod.BF16Packed) and packed.decode_lib is not None
    kernel = skinny_linear_bf16(bf16_lib, x, w, b)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, b, "none", [], "")
    assert (kernel != onednn).any(1).all(), "on these operands the two paths differ in every row's last bits"
    meta = object()  # the matmul reads only the generated rows from the context
    for mask in (np.ones(9, bool), np.zeros(9, bool), np.array([0, 1, 1, 0, 0, 1, 0, 0, 1], bool)):
        with set_forward_context(meta, None, GeneratedRows.from_mask(mask, torch.device("cpu"))):  # type: ignore[arg-type]
            got = dense_mod.dense(x, w, b, packed)
        want = torch.where(torch.from_numpy(mask)[:, None], kernel, onednn)
        assert torch.equal(got, want), f"rows {mask.astype(int).tolist()}"
    assert torch.equal(dense_mod.dense(x, w, b, packed), onednn), "outside a forward pass: oneDNN"
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]
    lost = dense_mod.pack_weight(torch.randn(24, 64).bfloat16())
    assert isinstance(lost, dense_mod.BF16Packed) and lost.decode_lib is None
    assert dense_mod.pack_weight(w, decode_rows=False).decode_lib is None, "lm_head: no kernel, nothing measured"
