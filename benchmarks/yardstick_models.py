"""Yardstick models (issue 49): the shapes people serve, in bf16, with seeded random weights and our tokenizer.

    python -m benchmarks.yardstick_models                        # both shapes, full depth, into the cache
    python -m benchmarks.yardstick_models --shape llama-1b --layers 2   # a shallow variant (tests)

The embedded SmolLM2-135M is a Q4_1 GGUF: the engine notices its weights are exactly 4-bit and decodes through a
4-bit kernel, so it says little about a bf16 checkpoint. These folders are Hugging Face checkpoints of real shapes:

    llama-1b    Llama-3.2-1B: hidden 2048, 16 layers, 32 heads / 8 KV heads (head dim 64), MLP 8192, tied
                embeddings, RoPE theta 500000 with Llama 3's scaling (factor 32, original 8192 positions)
    qwen-0.5b   Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads / 2 KV heads (head dim 64), MLP 4864, q/k/v bias,
                tied embeddings, RoPE theta 1e6

The vocabulary is the embedded model's tokenizer (SmolLM2's, 49152 ids), not Llama 3's 128256 or Qwen's 151936: no
tokenizer is fetched from a hub, and the servers and clients under benchmark tokenize with it. So the embedding and
tied lm_head are 49152 rows (Llama-1B: 1.07 B parameters, 2.15 GB in bf16, instead of 1.24 B).

Weights: every matrix and bias normal(0, 0.02) (transformers' initializer_range), RMSNorm weights 1. Each tensor
has its own generator, seeded from (--seed, the tensor's name) through numpy's PCG64 (integer arithmetic, the same
on every host), so the same seed gives the same bytes anywhere and a shallow variant's layers are the full model's
first layers. Folders go to `<cache>/models/yardstick-<shape>[-L<layers>][-s<seed>]` (`UCM_CACHE_DIR` moves the
cache), written in a temporary sibling and renamed into place; an existing folder made by the same recipe is reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_config import ModelConfig
from ucm_kernels.cache_dir import cache_dir

RECIPE = 1  # bump when the weights a (shape, layers, seed) gives change: cached folders are then rebuilt
RECIPE_FILE = "yardstick.json"
INIT_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Shape:
    model_type: str  # "llama" or "qwen2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    qkv_bias: bool = False
    llama3_rope: bool = False  # Llama 3.x's rope scaling (factor 32, 1 / 4, 8192 original positions)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES: dict[str, Shape] = {
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 8192, 500000.0, 1e-5, 131072, llama3_rope=True),
    "qwen-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 1000000.0, 1e-6, 32768, qkv_bias=True),
}


def folder_name(shape: str, layers: int | None = None, seed: int = 0) -> str:
    full = SHAPES[shape].num_layers
    return f"yardstick-{shape}" + (f"-L{layers}" if layers not in (None, full) else "") + (f"-s{seed}" if seed else "")


def model_dir(shape: str, layers: int | None = None, seed: int = 0, root: Path | None = None) -> Path:
    """Where `ensure_model` puts (or finds) the folder."""
    return (root if root is not None else cache_dir() / "models") / folder_name(shape, layers, seed)


def _tokenizer_source() -> Path:
    from engine.model_source import resolve_model_dir

    return resolve_model_dir("smollm2-135m")  # the embedded model's folder: converted once, cached


def hf_config(shape: Shape, layers: int, vocab_size: int, bos: int | None, eos: int | None) -> dict[str, Any]:
    """config.json for `shape` with `layers` layers, in transformers' own layout (its config class writes it)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=shape.max_positions,
        initializer_range=INIT_STD,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=True,
        rope_parameters=rope,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="bfloat16",
    )
    from transformers import LlamaConfig, Qwen2Config

    if shape.model_type == "llama":
        config: Any = LlamaConfig(**common, head_dim=shape.head_dim, attention_bias=False, mlp_bias=False)
        config.architectures = ["LlamaForCausalLM"]
    else:
        config = Qwen2Config(**common, use_sliding_window=False)
        config.architectures = ["Qwen2ForCausalLM"]
    return dict(config.to_diff_dict())  # what save_pretrained writes


def tensor_shapes(shape: Shape, layers: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint (Hugging Face names; the lm_head is tied to the embedding), in layer order."""
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            if shape.qkv_bias:
                out[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
    out["model.norm.weight"] = (h,)
    return out


def random_tensor(name: str, dims: tuple[int, ...], seed: int) -> Any:
    """bf16 torch tensor for `name`: RMSNorm weights 1, everything else normal(0, INIT_STD) from a PCG64 generator
    seeded with (seed, a hash of the name): the same bits on every host and whatever else the model holds."""
    import numpy as np
    import torch

    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return torch.ones(dims, dtype=torch.bfloat16)
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key])))
    values = rng.standard_normal(int(np.prod(dims)), dtype=np.float32)
    values *= np.float32(INIT_STD)
    return torch.from_numpy(values).reshape(dims).to(torch.bfloat16)  # round to nearest even: host-independent


def _recipe(shape: str, layers: int, seed: int, vocab_size: int) -> dict[str, Any]:
    return {"recipe": RECIPE, "shape": shape, "layers": layers, "seed": seed, "vocab_size": vocab_size,
            "init_std": INIT_STD, **{f"shape_{k}": v for k, v in asdict(SHAPES[shape]).items()}}  # fmt: skip


def _say(msg: str) -> None:
    print(f"[yardstick] {msg}", file=sys.stderr, flush=True)


def _write(out: Path, shape_name: str, layers: int, seed: int, tokenizer_dir: Path) -> None:
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    source_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    vocab = int(source_cfg["vocab_size"])
    bos, eos = source_cfg.get("bos_token_id"), source_cfg.get("eos_token_id")
    config = hf_config(shape, layers, vocab, bos, eos)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    shapes = tensor_shapes(shape, layers, vocab)
    total = sum(math.prod(d) for d in shapes.values())
    tensors, done, t0, last = {}, 0, time.perf_counter(), 0.0
    _say(f"{shape_name}: {layers} layers, {total / 1e9:.2f} B parameters ({2 * total / 1e9:.2f} GB bf16) -> {out}")
    for name, dims in shapes.items():
        tensors[name] = random_tensor(name, dims, seed)
        done += tensors[name].numel()
        if time.perf_counter() - last > 2.0 or done == total:
            last = time.perf_counter()
            _say(f"{shape_name}: {100 * done / total:5.1f}% of the weights drawn ({last - t0:.1f} s)")
    _say(f"{shape_name}: writing model.safetensors")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / RECIPE_FILE).write_text(json.dumps(_recipe(shape_name, layers, seed, vocab), indent=2) + "\n")


def model_config(shape: str) -> ModelConfig:
    """`shape`'s ModelConfig at its own depth, without writing its weights."""
    if shape not in SHAPES:
        raise ValueError(f"unknown yardstick shape {shape!r}; known: {', '.join(SHAPES)}")
    vocab = int(json.loads((_tokenizer_source() / "config.json").read_text())["vocab_size"])
    return ModelConfig.from_hf_dict(hf_config(SHAPES[shape], SHAPES[shape].num_layers, vocab, None, None))


def ensure_model(
    shape: str, layers: int | None = None, seed: int = 0, root: Path | None = None, force: bool = False
) -> Path:
    """The folder of `shape` (at `layers` layers, default its own depth), written first unless the same recipe
    already sits there. `root`: where the folder goes (default the cache's models/)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown yardstick shape {shape!r}; known: {', '.join(SHAPES)}")
    depth = SHAPES[shape].num_layers if layers is None else layers
    if depth <= 0:
        raise ValueError(f"layers must be positive, got {depth}")
    target = model_dir(shape, depth, seed, root)
    tokenizer_dir = _tokenizer_source()
    vocab = int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])
    recipe_path = target / RECIPE_FILE
    if (
        not force
        and recipe_path.is_file()
        and json.loads(recipe_path.read_text()) == _recipe(shape, depth, seed, vocab)
    ):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.perf_counter()
        _write(tmp, shape, depth, seed, tokenizer_dir)
        if target.exists():  # an older recipe (or --force): replaced
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / RECIPE_FILE).is_file():  # another process finished the same folder first: keep it
                raise
        _say(f"{shape}: done in {time.perf_counter() - start:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--layers", type=int, default=None, help="a shallow variant (default: the shape's own depth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", type=Path, default=None, help="write under this folder instead of <cache>/models")
    ap.add_argument("--force", action="store_true", help="write again even if the folder is there")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        print(ensure_model(shape, args.layers, args.seed, args.root, args.force), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
