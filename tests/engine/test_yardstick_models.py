"""The yardstick models (benchmarks/yardstick_models.py: Llama-3.2-1B and Qwen2.5-0.5B shapes, seeded random bf16
weights, our tokenizer) through the engine against HF transformers, greedy.

Shallow variants (2 layers at full width) keep it to seconds. HF's greedy choice at step k is argmax HF(prompt +
ours_<k): one HF forward over prompt + our tokens gives every step's choice at once, and if each equals ours then,
by induction, HF's greedy run is ours (tests/engine/test_model_hf.py argues the same).

fp32: every token equal, the logits within test_model_hf's ATOL. The linear layers run through F.linear here
(UCM_CPU_LINEAR=torch): which fp32 kernel serves each shape is measured per host on first use (minutes on a busy
2-core box) and tested in tests/kernels; the subject here is the shapes (GQA 32/8 and 14/2, q/k/v bias, Llama 3's
RoPE scaling, theta 1e6, tied embeddings).

The serving dtype (`dtype auto`, chosen as the engine chooses it; kernels as served): fp32 as above. bf16 promises
no bits against HF (its kernels round in another order), so the bound comes from the dtype: every logit within
eps * max|logit| * (1 + sqrt(layers)) of HF's (eps = 2^-7, bf16's spacing at 1: one rounding of the logits on each
side, and the residual stream's roundings adding up like a random walk over the layers), and greedy equal except
where HF's top two lie within twice that (a near-tie the rounding can flip). Measured on the Xeon with AMX: 1.0-1.4x
eps * max at 2 layers, 2.4-3.1x at 16; RoPE frequencies off by 5% give 3.4-21x, and often the same greedy tokens:
random weights give flat logits, whose top two are often a bf16 step apart, so the logits carry the test.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from benchmarks.yardstick_models import SHAPES, ensure_model
from engine import LLM, SamplingParams
from engine.config import resolve_dtype_name
from engine.loader import LoadedModel, load_model
from engine.model_config import ModelConfig
from engine.models import dense
from tests.engine.test_model_hf import PagedCache, assert_close, hf_logits
from tests.engine_helpers import PROMPTS
from ucm_kernels.cpu import linear_mode

SHALLOW = 2
MAX_TOKENS = 10
GREEDY_PROMPTS = PROMPTS[:4]
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7


@pytest.fixture(scope="module")
def shallow(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("yardstick")
    return {shape: ensure_model(shape, SHALLOW, root=root) for shape in SHAPES}


def serving_dtype() -> torch.dtype:
    return getattr(torch, resolve_dtype_name("auto", "cpu"))


def embedded_vocab() -> int:
    from engine.model_source import resolve_model_dir

    return ModelConfig.from_folder(resolve_model_dir("smollm2-135m")).vocab_size


def bf16_logit_tol(ref: torch.Tensor, layers: int) -> float:
    return BF16_EPS * ref.abs().max().item() * (1 + math.sqrt(layers))


def check_greedy_against_hf(lm: LoadedModel) -> None:
    """The engine's greedy tokens for GREEDY_PROMPTS (batched) against HF's in the same dtype (module docstring)."""
    from transformers import AutoModelForCausalLM

    prompts = [lm.tokenizer.encode(p) for p in GREEDY_PROMPTS]
    llm = LLM(dtype=str(lm.dtype).removeprefix("torch."), loaded_model=lm, kv_cache_memory="64MiB")
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.close()
    assert len({tuple(o) for o in outs}) == len(outs), f"every prompt continued alike (degenerate weights?): {outs}"
    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=lm.dtype).eval()
    cache = PagedCache(lm, num_blocks=32)
    for i, (ids, ours) in enumerate(zip(prompts, outs, strict=True)):
        seq = ids + ours[:-1]
        ref = hf_logits(hf, seq)[len(ids) - 1 :]
        mine = cache.step([(i, seq)])[len(ids) - 1 :]
        what = f"{lm.path.name} {lm.dtype} prompt {i}"
        if lm.dtype == torch.float32:
            assert ours == ref.argmax(-1).tolist(), f"{what}: ours {ours} vs HF greedy {ref.argmax(-1).tolist()}"
            assert_close(mine, ref, what)
            continue
        tol = bf16_logit_tol(ref, lm.config.num_layers)
        diff = (mine - ref).abs().max().item()
        assert diff <= tol, f"{what}: max |logit diff| {diff:.4f} > {tol:.4f}"
        gap = ref.max(-1).values - ref.gather(1, torch.tensor(ours)[:, None])[:, 0]
        assert gap.max().item() <= 2 * tol, f"{what}: HF ranks our tokens {gap.tolist()} below its own (tol {tol:.4f})"


def test_shapes_are_the_real_models_at_our_vocabulary(shallow):
    vocab = embedded_vocab()
    for shape, folder in shallow.items():
        cfg, want = ModelConfig.from_folder(folder), SHAPES[shape]
        assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
            want.hidden_size, want.num_heads, want.num_kv_heads, 64, want.intermediate_size,
        )  # fmt: skip
        assert cfg.num_layers == SHALLOW and cfg.tie_word_embeddings and cfg.vocab_size == vocab
        assert cfg.qkv_bias == (shape == "qwen-0.5b") and cfg.rope_theta == want.rope_theta
        assert (cfg.rope_scaling.rope_type.value == "llama3") == (shape == "llama-1b")
        assert (folder / "tokenizer.json").is_file() and not (folder / "ucm_source.json").exists(), "not a GGUF's"


def test_same_seed_same_bytes_and_a_shallow_variant_is_the_full_models_first_layers(shallow, tmp_path):
    a, b = ensure_model("qwen-0.5b", 1, root=tmp_path / "a"), ensure_model("qwen-0.5b", 1, root=tmp_path / "b")

    def digest(folder: Path) -> str:
        return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()

    assert digest(a) == digest(b)
    assert ensure_model("qwen-0.5b", 1, root=tmp_path / "a") == a, "an existing folder is reused"
    from safetensors.torch import load_file

    name = "model.layers.0.self_attn.q_proj.bias"
    one, two = load_file(a / "model.safetensors")[name], load_file(shallow["qwen-0.5b"] / "model.safetensors")[name]
    assert torch.equal(one, two) and one.dtype == torch.bfloat16 and 0.015 < one.float().std() < 0.025


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_hf_in_fp32(shape, shallow, monkeypatch):
    monkeypatch.setenv(linear_mode.ENV, "torch")
    check_greedy_against_hf(load_model(shallow[shape], dtype=torch.float32))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_hf_in_the_serving_dtype(shape, shallow):
    check_greedy_against_hf(load_model(shallow[shape], dtype=serving_dtype()))


def test_the_serving_dtype_frees_every_weight_its_packed_copies_replace(shallow):
    """A layer weight whose packed copies take every call is freed at load (the parameter becomes None; the
    greedy tests above run on such models); the tied embedding, which the token lookup reads, stays. A bf16 model on
    a host that packs bf16 keeps no plain layer weight at all."""
    model = load_model(shallow["llama-1b"], dtype=serving_dtype()).model
    assert model.lm_head is None and model.embed_tokens.is_cpu
    packs_bf16 = dense.packing_supported(torch.empty(1, 1, dtype=serving_dtype()))
    for layer in model.decoder_layers():
        for module, name in [(layer.attn, "qkv"), (layer.attn, "o"), (layer.mlp, "gate_up"), (layer.mlp, "down")]:
            weight, packed = getattr(module, f"{name}_weight"), getattr(module, f"{name}_packed")
            assert (weight is None) == dense.takes_every_call(packed), f"{name}: freed only where nothing reads it"
            assert weight is None or not packs_bf16, f"{name}: a bf16 weight's packed copies take every call"


@pytest.mark.slow
def test_full_depth_llama_1b_greedy_equals_hf_in_the_serving_dtype():
    """All 16 layers, written once into the cache (about 20 s) and reused; about 10 s a run on the Xeon with AMX."""
    check_greedy_against_hf(load_model(ensure_model("llama-1b"), dtype=serving_dtype()))


def test_bf16_decode_panels_keep_greedy_near_hf_and_a_prefix_hit_exact(shallow, bf16_panels_forced):
    """Llama-1B's shape in bf16 with its generated rows through the bf16 panels (q4_bf16.c, forced on: the
    calibration picks them where they beat oneDNN, as on a 2-core Zen 4): HF's bound as above, and a prompt continued
    after a prefix-cache hit gives the cold run's tokens (the panels give a row its bits whatever its step holds)."""
    from ucm_kernels.cpu import q4_bf16

    lm = load_model(shallow["llama-1b"], dtype=torch.bfloat16)
    layer = lm.model.decoder_layers()[0]
    for packed in (layer.attn.qkv_packed, layer.attn.o_packed, layer.mlp.gate_up_packed, layer.mlp.down_packed):
        assert isinstance(packed, dense.BF16Packed) and packed.decode is not None
        assert isinstance(packed.decode.panels, q4_bf16.BF16Panels)
    check_greedy_against_hf(lm)
    prompts = [[1000 + 37 * i + 11 * j for j in range(100)] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cold_llm = LLM(dtype="bfloat16", loaded_model=lm, kv_cache_memory="64MiB", enable_prefix_caching=False)
    try:
        cold = [o.outputs[0].token_ids for o in cold_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    finally:
        cold_llm.close()
    warm_llm = LLM(dtype="bfloat16", loaded_model=lm, kv_cache_memory="64MiB")
    try:
        warm_llm.generate([{"prompt_token_ids": p[:96]} for p in prompts], SamplingParams(max_tokens=1))
        outs = warm_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    finally:
        warm_llm.close()
    assert all(o.num_cached_tokens == 96 for o in outs), [o.num_cached_tokens for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == cold
