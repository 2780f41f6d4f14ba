"""Our own typed view of an HF `config.json` for the Llama family (Llama / SmolLM2 / Mistral / Qwen2).

Reads both transformers 4 (`rope_theta` + `rope_scaling`) and transformers 5 (`rope_parameters`) layouts.
Torch is only needed for `kv_bytes_per_block`'s dtype argument, so the import stays lazy.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelArch(enum.Enum):
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"


class RopeType(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class RopeScaling:
    rope_type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    # llama3 only: wavelengths between the two bounds are interpolated smoothly
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type is RopeType.LLAMA3 and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    arch: ModelArch
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama with attention_bias)
    mlp_bias: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None  # recorded only: attention here is always full
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def max_model_len(self) -> int:
        """Longest sequence this model computes exactly as its reference does: attention here is always full,
        so a sliding-window model (Mistral) is only exact up to its window."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_block(self, block_size: int, dtype: Any) -> int:
        """Bytes of K plus V, all layers, for one block of `block_size` tokens in `dtype` (a torch dtype)."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize

    def arch_dict(self) -> dict[str, Any]:
        """Everything that shapes the computation, JSON-able and ordered (part of the model fingerprint)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("eos_token_ids", "bos_token_id")}
        d["arch"] = self.arch.value
        d["rope_scaling"] = {**self.rope_scaling.__dict__, "rope_type": self.rope_scaling.rope_type.value}
        return d

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        model_type = cfg.get("model_type", "")
        try:
            arch = ModelArch(model_type)
        except ValueError:
            supported = ", ".join(a.value for a in ModelArch)
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}") from None
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only SwiGLU (silu) MLPs are implemented")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_theta, scaling = _rope_from_hf(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch is ModelArch.MISTRAL) else None
        bos = cfg.get("bos_token_id")
        return cls(
            arch=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=rope_theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch is ModelArch.QWEN2 or attention_bias,
            o_bias=arch is not ModelArch.QWEN2 and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_token_ids,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        try:
            cfg = json.loads((folder / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{folder / 'config.json'} is not valid JSON: {exc}") from None
        eos = set(_as_ids(cfg.get("eos_token_id")))
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            eos |= set(_as_ids(json.loads(gen_path.read_text()).get("eos_token_id")))
        return cls.from_hf_dict(cfg, tuple(sorted(eos)))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling"):
        params = {**params, **cfg["rope_scaling"]}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    try:
        rope_type = RopeType(kind)
    except ValueError:
        raise ValueError(f"unsupported rope type {kind!r}; supported: default, linear, llama3") from None
    if rope_type is RopeType.DEFAULT:
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )
