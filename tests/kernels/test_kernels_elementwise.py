"""The fused elementwise kernels (ucm_kernels/cpu/elementwise.c) against their torch references, their dispatch in
ucm_kernels.api, and the model's fused residual layout against the unfused order it replaced."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.native_spy import spy as _spy
from ucm_kernels import api
from ucm_kernels.cpu import native
from ucm_kernels.reference import (
    fused_add_rms_norm_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    silu_and_mul_torch,
)

# Odd row counts; hidden sizes with and without a scalar tail past the 16-lane vectors, one long enough for
# the cascaded sum's higher levels (more than 16 rows of 4 vectors).
NORM_SHAPES = [(1, 576), (37, 576), (5, 100), (3, 7), (2, 17), (4, 4096 + 5)]
EPS = 1e-5


@pytest.fixture(scope="module")
def lib(native_lib) -> native.NativeLib:
    return native_lib


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns mapped to integers in value order, so a difference counts ulps (across zero too)."""
    bits = t.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -32768 - bits, bits)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """At most 1 bf16 ulp apart (the fp32 sum order may differ) and at least 99% bit-identical."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    ulps = (_ordered(got) - _ordered(want)).abs()
    assert int(ulps.max()) <= 1, f"max {int(ulps.max())} ulps apart at {int(ulps.argmax())}"
    same = float((ulps == 0).float().mean())
    assert same >= 0.99, f"only {same:.4f} of elements bit-identical"


def _norm_inputs(rows: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).bfloat16()
    weight = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    residual = torch.randn(rows, hidden, generator=g).bfloat16()
    return x, weight, residual


@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm_matches_torch(lib, native_mode, monkeypatch, rows, hidden):
    x, weight, _ = _norm_inputs(rows, hidden, seed=rows * 7919 + hidden)
    calls = _spy(monkeypatch, lib, "rms_norm")
    got = api.rms_norm(x, weight, EPS)
    assert calls == [1], "a contiguous bf16 CPU norm must take the native kernel"
    assert_bf16_close(got, rms_norm_torch(x, weight, EPS))


@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_fused_add_rms_norm_matches_torch_and_updates_residual(lib, native_mode, monkeypatch, rows, hidden):
    x, weight, residual = _norm_inputs(rows, hidden, seed=rows * 104729 + hidden)
    want_residual = residual.clone()
    want = fused_add_rms_norm_torch(x, want_residual, weight, EPS)
    assert torch.equal(want_residual, residual + x), "the reference itself adds in place"
    calls = _spy(monkeypatch, lib, "fused_add_rms_norm")
    got = api.fused_add_rms_norm(x, residual, weight, EPS)
    assert calls == [1]
    assert torch.equal(residual, want_residual), "residual must be updated in place, rounded as torch rounds"
    assert_bf16_close(got, want)


def test_rms_norm_large_rows_across_threads(lib, native_mode):
    """Past the size where the kernel forks OpenMP threads, rows still see the same math."""
    x, weight, residual = _norm_inputs(129, 1024, seed=3)
    want_residual = residual.clone()
    want = fused_add_rms_norm_torch(x, want_residual, weight, EPS)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = api.fused_add_rms_norm(x, residual, weight, EPS)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(residual, want_residual)
    assert_bf16_close(got, want)


def _every_bf16() -> torch.Tensor:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16)
    return values[torch.isfinite(values)]


@pytest.mark.parametrize("width", [16 * 17, 15])
def test_silu_and_mul_matches_torch_for_every_bf16_gate(lib, native_mode, monkeypatch, width):
    """silu depends on the gate alone, so all 65280 finite bf16 gates cover it; width 15 runs the scalar path
    only (libm expf), the other the 16-lane one (the kernel's own exp)."""
    gates = _every_bf16()
    gates = gates[: gates.numel() // width * width].reshape(-1, width)
    up = torch.randn(gates.shape, generator=torch.Generator().manual_seed(width)).bfloat16()
    gate_up = torch.cat((gates, up), dim=-1)
    calls = _spy(monkeypatch, lib, "silu_and_mul")
    got = api.silu_and_mul(gate_up)
    assert calls == [1]
    want = silu_and_mul_torch(gate_up)
    assert got.shape == (gates.shape[0], width)
    # exp is the one non-IEEE step; on the dev box the rounding to bf16 after silu absorbed its last-bit error
    # for every gate (0 differences), but other libm/torch builds may round one differently.
    assert_bf16_close(got, want)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 1536), (7, 40), (3, 9)])
def test_silu_and_mul_shapes(lib, native_mode, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).bfloat16()
    assert_bf16_close(api.silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


def _qkv_case(tokens: int, hq: int, hkv: int, d: int, seed: int):
    from engine.model_config import RopeScaling
    from engine.models.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).bfloat16()
    positions = torch.randint(0, 8192, (tokens,), generator=g)
    cos, sin = RotaryEmbedding(d, 10000.0, RopeScaling()).cos_sin(positions, torch.bfloat16)
    qk = qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d)
    return qkv, qk, cos, sin


# SmolLM2's heads; head_dim 40 (half 20: a vector and a scalar tail) and 8 (scalar only).
@pytest.mark.parametrize("tokens,hq,hkv,d", [(33, 9, 3, 64), (1, 9, 3, 64), (5, 4, 2, 40), (3, 2, 1, 8)])
def test_rotary_embedding_in_place_on_a_qkv_view(lib, native_mode, monkeypatch, tokens, hq, hkv, d):
    qkv, qk, cos, sin = _qkv_case(tokens, hq, hkv, d, seed=tokens * 31 + d)
    assert tokens == 1 or qk.stride(0) == (hq + 2 * hkv) * d, "the case must exercise the token stride"
    want = rotary_embedding_torch(qk, cos, sin)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    calls = _spy(monkeypatch, lib, "rotary_embedding")
    api.rotary_embedding_(qk, cos, sin)
    assert calls == [1]
    # Products of two bf16 values are exact in fp32 and the sum is one IEEE add: no ulp to give.
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before), "v must not be touched"


def test_rotary_embedding_keeps_denormals_as_torch_does(lib, native_mode):
    """Products below fp32's smallest normal (2^-126) stay denormal in torch; the AVX-512 BF16 rounding
    instruction would flush them, so a vector holding one must take the exact integer rounding."""
    qkv, qk, cos, sin = _qkv_case(17, 9, 3, 64, seed=11)
    # Tiny in both halves of a head at even i (x_i and x_{i + d/2} meet in one output), so that tiny and
    # ordinary lanes share vectors, in every other token.
    col = torch.arange(qkv.shape[1]) % 64 % 32
    tiny = (col % 2 == 0)[None, :] & (torch.arange(qkv.shape[0]) % 2 == 0)[:, None]
    qkv.copy_(torch.where(tiny, qkv * 2.0**-120, qkv))
    want = rotary_embedding_torch(qk, cos, sin)
    assert bool(((want != 0) & (want.abs() < 2.0**-126)).any()), "the case must produce denormal results"
    api.rotary_embedding_(qk, cos, sin)
    assert torch.equal(qk.view(torch.int16), want.view(torch.int16))


def test_torch_fallback_when_native_is_off(lib, monkeypatch):
    monkeypatch.setenv("UCM_CPU_ATTENTION", "torch")
    monkeypatch.setattr(native, "load", lambda: pytest.fail("UCM_CPU_ATTENTION=torch must keep the library out"))
    x, weight, residual = _norm_inputs(9, 100, seed=5)
    assert torch.equal(api.rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    want_residual = residual.clone()
    want = fused_add_rms_norm_torch(x, want_residual, weight, EPS)
    assert torch.equal(api.fused_add_rms_norm(x, residual, weight, EPS), want)
    assert torch.equal(residual, want_residual)
    gate_up = torch.randn(9, 64).bfloat16()
    assert torch.equal(api.silu_and_mul(gate_up), silu_and_mul_torch(gate_up))
    _, qk, cos, sin = _qkv_case(6, 9, 3, 64, seed=6)
    want_qk = rotary_embedding_torch(qk, cos, sin)
    api.rotary_embedding_(qk, cos, sin)
    assert torch.equal(qk, want_qk)


def test_non_contiguous_bf16_takes_the_torch_path(lib, native_mode, monkeypatch):
    monkeypatch.setattr(native, "load", lambda: pytest.fail("a strided x must not reach the row kernels"))
    wide = torch.randn(5, 200).bfloat16()
    x = wide[:, :100]
    weight = torch.rand(100).bfloat16()
    assert torch.equal(api.rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    assert torch.equal(api.silu_and_mul(wide[:, :64]), silu_and_mul_torch(wide[:, :64]))


def test_bad_shapes_raise_value_error():
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(ValueError, match="weight"):
        api.rms_norm(x, torch.ones(7).bfloat16(), EPS)
    with pytest.raises(ValueError, match="residual"):
        api.fused_add_rms_norm(x, torch.zeros(3, 9).bfloat16(), torch.ones(8).bfloat16(), EPS)
    with pytest.raises(ValueError, match="even last dimension"):
        api.silu_and_mul(torch.randn(3, 7).bfloat16())
    with pytest.raises(ValueError, match="cos"):
        api.rotary_embedding_(torch.randn(3, 2, 8).bfloat16(), torch.ones(3, 8).bfloat16(), torch.ones(3, 8).bfloat16())
    with pytest.raises(ValueError, match="even head_dim"):
        api.rotary_embedding_(torch.randn(3, 2, 7), torch.ones(3, 1, 7), torch.ones(3, 1, 7))


def _unfused_forward(model, input_ids, positions, kv_caches) -> torch.Tensor:
    """The layer loop as it was before the residual fusion: h = h + attn(norm(h)); h = h + mlp(norm(h))."""
    import torch.nn.functional as F

    h = F.embedding(input_ids, model.embed_tokens)
    cos, sin = model.rotary.cos_sin(positions, h.dtype)
    for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
        h = h + layer.attn(layer.input_norm(h), cos, sin, kv_cache)
        h = h + layer.mlp(layer.post_attn_norm(h))
    return model.norm(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_layout_matches_the_unfused_order(native_mode, dtype):
    """The vLLM-style loop is the same sums in the same order: bit-identical, in fp32 and in bf16 (where the
    norms use the same kernel either way)."""
    from engine.attention import set_forward_context
    from engine.model_config import ModelConfig
    from engine.models.llama import LlamaForCausalLM
    from ucm_kernels.attention_metadata import AttentionMetadata

    config = ModelConfig.from_hf_dict(
        {
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": True,
        }
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model = model.to(dtype).eval()
    num_blocks, block_size = 4, 16
    tokens = 11
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    input_ids = torch.randint(0, 100, (tokens,))
    positions = torch.arange(tokens)

    def run(forward) -> torch.Tensor:
        caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.layers]
        md = AttentionMetadata(
            slot_mapping=torch.arange(tokens, dtype=torch.int64),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=torch.tensor([tokens], dtype=torch.int32),
            block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
            max_query_len=tokens,
            max_seq_len=tokens,
        )
        with torch.inference_mode(), set_forward_context(md):
            return forward(input_ids, positions, caches)

    fused = run(model.forward)
    unfused = run(lambda *a: _unfused_forward(model, *a))
    assert torch.equal(fused, unfused)
