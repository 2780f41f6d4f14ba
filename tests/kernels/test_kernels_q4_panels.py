"""4-bit panels (ucm_kernels/cpu/q4_panels.py, skinny_gemm.c's q4 kernel): a weight is taken as 4-bit only when every
weight comes back bit for bit, the q4 kernel's output is then bit-identical to the fp32 panel kernel's, and the
embedded model's layers are all exactly 4-bit (its GGUF is Q4_1)."""

from __future__ import annotations

import pytest
import torch

from ucm_kernels.cpu.q4_panels import find_q4, pack_q4, random_q4_weight, skinny_linear_q4
from ucm_kernels.cpu.skinny_gemm import pack_panels, skinny_linear


@pytest.mark.parametrize(("m", "k", "n", "bias"), [(1, 64, 40, False), (5, 96, 16, True), (8, 576, 960, False)])
def test_q4_kernel_is_bit_identical_to_the_fp32_panels(native_lib, m, k, n, bias) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = random_q4_weight(n, k, gen)
    q4 = pack_q4(w)
    assert q4 is not None, "a weight built as q * d + m must be found 4-bit"
    q, d, mins = find_q4(w)
    rebuilt = (torch.from_numpy(q).float().reshape(n, k // 32, 32) * torch.from_numpy(d)[..., None]) + torch.from_numpy(
        mins
    )[..., None]
    assert torch.equal(rebuilt.reshape(n, k).view(torch.int32), w.view(torch.int32))
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = skinny_linear_q4(native_lib, x, q4, n, b)
    assert torch.equal(got, skinny_linear(native_lib, x, pack_panels(native_lib, w), n, b))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_weights_that_are_not_exactly_4bit_stay_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    assert find_q4(torch.randn(16, 64, generator=gen)) is None, "random fp32 weights"
    w = random_q4_weight(16, 64, gen)
    assert find_q4(w) is not None
    nudged = w.clone()
    nudged.view(torch.int32)[3, 17] += 1  # one weight one ulp off
    assert find_q4(nudged) is None
    assert find_q4(w[:, :48].contiguous()) is None, "k not a multiple of the 32-wide blocks"
    with_nan = w.clone()
    with_nan[0, 0] = float("nan")
    assert find_q4(with_nan) is None
    assert find_q4(w.bfloat16()) is None
    zero_block = w.clone()
    zero_block[2, :32] = 0.5  # a constant block: d = 0
    assert find_q4(zero_block) is not None


def test_bad_arguments(native_lib) -> None:
    q4 = pack_q4(random_q4_weight(32, 64, torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="fp32"):
        skinny_linear_q4(native_lib, torch.randn(2, 64).bfloat16(), q4, 32, None)
    with pytest.raises(ValueError, match="not 33 x 64"):
        skinny_linear_q4(native_lib, torch.randn(2, 64), q4, 33, None)
    for out in (torch.empty(2, 31), torch.empty(2, 32).bfloat16(), torch.empty(32, 2).t()):
        with pytest.raises(ValueError, match=r"contiguous fp32 \[2, 32\]"):
            skinny_linear_q4(native_lib, torch.randn(2, 64), q4, 32, None, out)


def test_the_embedded_models_layers_are_exactly_4bit(smollm2_fp32) -> None:
    """As the loader reads them (the model itself keeps no plain weight its packed copies replace)."""
    from safetensors.torch import load_file

    weights = load_file(smollm2_fp32.path / "model.safetensors")
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj"):
        w = weights[f"model.layers.0.{name}.weight"]
        assert w.dtype == torch.float32 and find_q4(w) is not None, f"{name}: the GGUF's Q4_1 weights come back exactly"
    assert find_q4(weights["model.layers.0.mlp.down_proj.weight"]) is not None
