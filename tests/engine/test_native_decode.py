"""engine/models/native_decode.py: a decode step's forward through the native kernels directly gives every row the
generic forward's bits, and only the steps it can keep that for take it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from benchmarks.yardstick_models import ensure_model
from engine import LLM, SamplingParams
from engine.attention import set_forward_context
from engine.generated_rows import GeneratedRows
from engine.models.dense import F32Packed, dense, pack_weight
from engine.models.native_decode import DecodeStep, decode_linear
from ucm_kernels.attention_metadata import AttentionMetadata
from ucm_kernels.backend import CPU_ENV_VAR
from ucm_kernels.cpu import amx_gemm, decode_layers, linear_mode, skinny_gemm
from ucm_kernels.cpu.q4_panels import Q4Panels, random_q4_weight


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch) -> None:
    """The native kernels for every op, whatever this host's calibration picked for decode attention (torch there
    would send every decode step to the generic forward, and these tests would test nothing)."""
    monkeypatch.setenv(CPU_ENV_VAR, "native")


def _greedy_with_logprobs(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(("dtype", "linear"), [("float32", "auto"), ("float32", "native"), ("bfloat16", "auto")])
def test_decode_steps_through_the_native_path_give_the_generic_bits(dtype, linear, native_lib, monkeypatch) -> None:
    # linear "native": every fp32 layer matmul on the skinny kernel's 4-bit panels, whatever this host measured.
    monkeypatch.setenv(linear_mode.ENV, linear)
    skinny_gemm.forget()
    rng = random.Random(3)
    # Different lengths, so the batch's sequences end their blocks at different places.
    prompts = [[rng.randrange(1000, 40000) for _ in range(40 + 23 * i)] for i in range(5)]
    # No prefix cache: the second run must compute its prompts as the first did.
    llm = LLM(model="smollm2-135m", dtype=dtype, enable_prefix_caching=False, kv_cache_memory="64MiB")
    model = llm.engine.runner.model
    native = model.native_decode
    assert native is not None, "a CPU model with the native library takes the native decode path"
    fast = _greedy_with_logprobs(llm, prompts)
    # Whether the layers run in C follows this host's calibration: every matmul on a kernel of ours (not oneDNN)
    # up to the batch's rows. Where one is not, every step keeps the Python loop.
    in_c = native.native_layers is not None and native.native_rows >= len(prompts)
    assert linear == "auto" or in_c, "UCM_CPU_LINEAR=native puts every matmul on the skinny kernel's panels"
    want = f"{'all' if in_c else 'none'} of the 23 decode steps in one native call"
    assert (native.native_steps >= 23) if in_c else native.native_steps == 0, f"{want}: {native.native_steps} were"
    _python_loop_and_generic_agree(llm, prompts, fast)
    skinny_gemm.forget()


def _python_loop_and_generic_agree(llm: LLM, prompts: list[list[int]], fast: list[tuple]) -> None:
    """`fast` (the prompts' greedy tokens and logprobs as the engine ran them) equals the same kernels called one by
    one from Python (as a step whose matmuls are not all ours runs them) and the generic forward, bit for bit."""
    model = llm.engine.runner.model
    native = model.native_decode
    layers, native.native_layers = native.native_layers, None
    before = native.steps
    python_loop = _greedy_with_logprobs(llm, prompts)
    assert native.steps - before >= 23, "the Python loop ran"
    native.native_layers = layers
    model.native_decode = None
    generic = _greedy_with_logprobs(llm, prompts)
    model.native_decode = native
    llm.close()
    for name, got in (("native layers", fast), ("Python loop", python_loop)):
        assert [t for t, _ in got] == [t for t, _ in generic], name
        assert [lp for _, lp in got] == [lp for _, lp in generic], f"{name}: logprobs differ: some row's bits changed"


BF16_PATHS = {  # how a bf16 model's decode matmuls run natively, by host: the formats its layers take
    "amx": {decode_layers.LinearFormat.AMX_BF16, decode_layers.LinearFormat.AMX_BF16_PAIRS},
    "bf16 panels": {decode_layers.LinearFormat.BF16_BF16},
}


@pytest.mark.parametrize("path", list(BF16_PATHS))
@pytest.mark.parametrize("shape", ["llama-1b", "qwen-0.5b"])
def test_a_bf16_model_runs_its_layers_in_c(shape, path, native_lib, request, tmp_path) -> None:
    """A bf16 model without quantized weights (a Llama-3.2-1B shape, and a Qwen2.5-0.5B shape whose qkv has a bias;
    2 layers, random weights) runs its decode steps' layers in one native call, the qkv bias added in C as the Python
    loop adds it, with the bits of the Python loop and of the generic forward: on AMX, where the AMX kernel stands in
    for oneDNN (whose bf16 rows vary with the call there); without AMX on the bf16 panels (forced on here; chosen by
    measurement, as on a 2-core Zen 4)."""
    if path == "amx" and amx_gemm.needed_and_available() is None:
        pytest.skip("this host's bf16 matmuls do not take the AMX kernel (oneDNN's rows are invariant, or no AMX)")
    if path == "bf16 panels":
        request.getfixturevalue("bf16_panels_forced")
    rng = random.Random(5)
    prompts = [[rng.randrange(1000, 40000) for _ in range(30 + 17 * i)] for i in range(3)]
    folder = ensure_model(shape, 2, root=tmp_path)
    llm = LLM(model=str(folder), dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="128MiB")
    native = llm.engine.runner.model.native_decode
    assert native is not None and native.native_layers is not None, f"every layer matmul on {path}"
    assert {lin.format for layer in native.native_layers for lin in layer.linears} == BF16_PATHS[path]
    biased = [layer.linears[0].bias is not None for layer in native.native_layers]
    assert all(biased) if shape == "qwen-0.5b" else not any(biased), "Qwen2's qkv bias, added in C"
    fast = _greedy_with_logprobs(llm, prompts)
    assert native.native_steps >= 23, f"the decode steps' layers in one native call: {native.native_steps} were"
    _python_loop_and_generic_agree(llm, prompts, fast)


def test_an_fp32_model_of_bf16_weights_decodes_on_bf16_panels_with_the_fp32_panels_bits(
    native_lib, monkeypatch, tmp_path
) -> None:
    """A bf16 checkpoint served in fp32 (an AVX2-only host's dtype; a Llama-3.2-1B shape, 2 layers): every layer
    weight packs as bf16 panels, the decode steps' layers run in one native call on them, and the greedy tokens and
    logprobs equal those of the same model on fp32 panels bit for bit (the kernel widens the very floats the fp32
    panels hold)."""
    monkeypatch.setenv(linear_mode.ENV, "native")  # every matmul on the skinny kernel, whatever this host measured
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 40000) for _ in range(30 + 17 * i)] for i in range(3)]
    folder = ensure_model("llama-1b", 2, root=tmp_path)

    def run() -> tuple[set[decode_layers.LinearFormat], list[tuple]]:
        skinny_gemm.forget()
        llm = LLM(model=str(folder), dtype="float32", enable_prefix_caching=False, kv_cache_memory="128MiB")
        native = llm.engine.runner.model.native_decode
        assert native is not None and native.native_layers is not None, "every layer matmul on the skinny kernel"
        formats = {lin.format for layer in native.native_layers for lin in layer.linears}
        got = _greedy_with_logprobs(llm, prompts)
        assert native.native_steps >= 23, f"the decode steps' layers in one native call: {native.native_steps} were"
        llm.close()
        return formats, got

    bf16_formats, bf16 = run()
    monkeypatch.setattr(skinny_gemm, "pack_bf16", lambda lib, weight: None)  # the same weights as fp32 panels
    fp32_formats, fp32 = run()
    skinny_gemm.forget()
    assert bf16_formats == {decode_layers.LinearFormat.BF16_F32}, bf16_formats
    assert fp32_formats == {decode_layers.LinearFormat.F32_PANELS}, fp32_formats
    assert [t for t, _ in bf16] == [t for t, _ in fp32]
    assert [lp for _, lp in bf16] == [lp for _, lp in fp32], "logprobs differ: some row's bits changed"


@pytest.mark.parametrize("layers_in_c", [True, False])
def test_a_bad_slot_fails_the_step_with_write_kvs_error_either_way(layers_in_c, native_lib, monkeypatch) -> None:
    """A failure inside the native layer loop is the error the kernel's own wrapper raises from the Python loop."""
    # Every matmul on the 4-bit kernel whatever this host measured: a noisy calibration may give one to oneDNN.
    monkeypatch.setenv(linear_mode.ENV, "native")
    llm = LLM(model="smollm2-135m", dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="64MiB")
    native = llm.engine.runner.model.native_decode
    assert native is not None and native.native_layers is not None, "UCM_CPU_LINEAR=native: every matmul on ours"
    if not layers_in_c:
        native.native_layers = None
    plan = native.plan

    def bad_slots(num_tokens, kv_caches):  # a slot past the cache's end: only a fault injection can make one
        step = plan(num_tokens, kv_caches)
        return None if step is None else DecodeStep(step.attention, torch.full_like(step.slot_mapping, 1 << 40))

    monkeypatch.setattr(native, "plan", bad_slots)
    with pytest.raises(ValueError, match=r"write_kv: token 0 has slot 1099511627776, outside the cache's \d+ slots"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    llm.close()


@pytest.mark.parametrize("quantized", [False, True])
def test_decode_linear_writes_the_skinny_kernels_bits_into_the_step_buffer(quantized, native_lib, monkeypatch) -> None:
    monkeypatch.setenv(linear_mode.ENV, "native")
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 64
    weight = random_q4_weight(n, k, gen) if quantized else torch.randn(n, k, generator=gen)
    packed = pack_weight(weight)
    assert isinstance(packed, F32Packed) and packed.panels is not None, "UCM_CPU_LINEAR=native packs every weight"
    assert isinstance(packed.panels.panels, Q4Panels) == quantized
    for rows in (1, 5, packed.panels.max_rows + 1):
        x = torch.randn(rows, k, generator=gen)
        out = torch.full((rows, n), float("nan"))
        got = decode_linear(x, weight, None, packed, out, torch.get_num_threads())
        assert (got is out) == (rows <= packed.panels.max_rows), "the step buffer up to the kernel's rows, no further"
        assert torch.equal(got, dense(x, weight, None, packed)), f"{rows} rows: not dense's bits"
    bias = torch.randn(n, generator=gen)
    x = torch.randn(3, k, generator=gen)
    out = torch.empty(3, n)
    got = decode_linear(x, weight, bias, packed, out, torch.get_num_threads())
    assert got is not out and torch.equal(got, dense(x, weight, bias, packed)), "a bias goes through dense"


def _metadata(num_seqs: int, query_len: int) -> AttentionMetadata:
    seq_lens = torch.full((num_seqs,), 20, dtype=torch.int32)
    starts = torch.arange(0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32)
    tables = torch.arange(num_seqs * 2, dtype=torch.int32).view(num_seqs, 2)
    slots = (tables[:, 1] * 16 + 3).repeat_interleave(query_len).to(torch.int64)
    return AttentionMetadata(slots, starts, seq_lens, tables, query_len, 20)


class _Hooks:
    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer, k_cache, v_cache, attn_metadata) -> None: ...


def test_only_plain_decode_steps_take_the_native_path(smollm2_fp32, native_lib, monkeypatch) -> None:
    model = smollm2_fp32.model
    native = model.native_decode
    assert native is not None
    c = model.config
    caches = [
        (torch.zeros(8, 16, c.num_kv_heads, c.head_dim), torch.zeros(8, 16, c.num_kv_heads, c.head_dim))
        for _ in range(c.num_layers)
    ]
    generated = GeneratedRows.from_mask(np.ones(3, dtype=bool), torch.device("cpu"))
    with set_forward_context(_metadata(3, 1), None, generated):
        assert native.plan(3, caches) is not None
        monkeypatch.setenv(CPU_ENV_VAR, "torch")  # every op forced to torch: the generic path runs them
        assert native.plan(3, caches) is None
        monkeypatch.setenv(CPU_ENV_VAR, "native")
    # A one-token prompt chunk (the rest of its prompt came from the cache) is a prompt row: its matmuls are oneDNN's.
    prompt_rows = GeneratedRows.from_mask(np.array([True, False, True]), torch.device("cpu"))
    with set_forward_context(_metadata(3, 1), None, prompt_rows):
        assert native.plan(3, caches) is None
    with set_forward_context(_metadata(3, 1), None, None):  # rows of unknown class (outside the model runner)
        assert native.plan(3, caches) is None
    with set_forward_context(_metadata(3, 1), _Hooks(), generated):  # the connector loads or saves this step
        assert native.plan(3, caches) is None
    rows = GeneratedRows.from_mask(np.ones(6, dtype=bool), torch.device("cpu"))
    with set_forward_context(_metadata(3, 2), None, rows):  # two new tokens a sequence: not a decode
        assert native.plan(6, caches) is None
    assert native.plan(3, caches) is None, "outside a step"


def test_with_a_store_the_saving_steps_keep_their_hooks_and_the_idle_decodes_go_native(smollm2_fp32, tmp_path) -> None:
    """The connector's worker says when a step has per-layer work (`needs_layer_hooks`); the steps without any
    (decodes with no full block to save) run natively, and the prompt's blocks are still saved layer by layer."""
    rng = random.Random(9)
    prompt = [rng.randrange(1000, 40000) for _ in range(200)]  # 12 full blocks
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = dict(dtype="float32", kv_cache_memory="32MiB")
    plain = LLM(loaded_model=smollm2_fp32, **engine)
    cold = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    plain.close()
    native = smollm2_fp32.model.native_decode
    assert native is not None
    before = native.steps
    llm = LLM(loaded_model=smollm2_fp32, kv_store=f"embedded?disk_path={tmp_path}", kv_save_policy="computed", **engine)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    _, worker = llm.engine.kv_connector
    saved = worker.stats.blocks_saved
    llm.close()
    assert out == cold
    assert saved >= 12, f"the prompt's 12 full blocks were saved through the layer hooks, got {saved}"
    assert native.steps - before >= 15, f"most of the 19 decode steps ran natively, got {native.steps - before}"


def test_a_llama_shapes_padded_activations_keep_its_bits(native_lib, tmp_path, monkeypatch) -> None:
    """Llama-1B's 2048- and 8192-wide activations (norm outputs, the SiLU's) come with rows off 4 KB strides where
    the AMX kernel takes them (amx_gemm.padded_rows): prompts long enough to be padded give the greedy tokens and
    logprobs of the same engine with every activation contiguous, and a prompt continued after a prefix-cache hit
    (its tail too short to pad) those of its cold run."""
    if amx_gemm.needed_and_available() is None:
        pytest.skip("this host's bf16 matmuls do not take the AMX kernel: nothing is padded")
    rng = random.Random(6)
    prompts = [[rng.randrange(1000, 40000) for _ in range(100 + 37 * i)] for i in range(3)]
    llm = LLM(model=str(ensure_model("llama-1b", 2, root=tmp_path)), dtype="bfloat16", kv_cache_memory="128MiB")
    strides = []
    monkeypatch.setattr(amx_gemm, "padded_rows", _recording(amx_gemm.padded_rows, strides))
    padded = _greedy_with_logprobs(llm, prompts)
    assert any(s[0] > s[1] for s in strides), f"some activation padded: {strides}"
    hit = _greedy_with_logprobs(llm, prompts)  # the prefix cache holds their whole blocks: only a tail is computed
    llm.engine.kv_manager.pool.reset_prefix_cache()
    monkeypatch.setattr(amx_gemm, "PAD_MIN_ROWS", 10**9)
    contiguous = _greedy_with_logprobs(llm, prompts)
    llm.close()
    assert padded == contiguous, "padding an activation changed some row's bits"
    assert hit == padded, "after a prefix-cache hit"


def _recording(fn, seen: list):
    def padded_rows(m: int, width: int) -> torch.Tensor:
        out = fn(m, width)
        seen.append((out.stride(0), width))
        return out

    return padded_rows
