"""Build our model from an HF folder's safetensors, fusing q/k/v and gate/up rows as they are read."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.gguf_convert import SOURCE_FILE
from engine.model_config import ModelConfig
from engine.models.dense import decode_kernel_available
from engine.models.llama import LlamaForCausalLM
from engine.models.rope import inverse_frequencies

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# HF sub-module -> (our sub-module prefix, fused row block index or None)
_LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "input_layernorm": ("input_norm.", None),
    "post_attention_layernorm": ("post_attn_norm.", None),
    "self_attn.q_proj": ("attn.qkv_", 0),
    "self_attn.k_proj": ("attn.qkv_", 1),
    "self_attn.v_proj": ("attn.qkv_", 2),
    "self_attn.o_proj": ("attn.o_", None),
    "mlp.gate_proj": ("mlp.gate_up_", 0),
    "mlp.up_proj": ("mlp.gate_up_", 1),
    "mlp.down_proj": ("mlp.down_", None),
}
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|^lm_head\.weight$)")


def _row_ranges(config: ModelConfig, prefix: str) -> list[tuple[int, int]]:
    if prefix == "attn.qkv_":
        q, kv = config.q_size, config.kv_size
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    inter = config.intermediate_size
    return [(0, inter), (inter, 2 * inter)]


def _target(model: LlamaForCausalLM, config: ModelConfig, hf_name: str) -> torch.Tensor | None:
    """Our parameter (or row slice of a fused one) that `hf_name` fills; None for names we skip."""
    if hf_name == "model.embed_tokens.weight":
        return model.embed_tokens
    if hf_name == "model.norm.weight":
        return model.norm.weight
    if hf_name == "lm_head.weight" and model.lm_head is not None:
        return model.lm_head
    m = _LAYER.match(hf_name)
    if m and int(m.group(1)) >= config.num_layers:
        raise ValueError(f"checkpoint has {hf_name!r} but the config has only {config.num_layers} layers")
    if m and m.group(2) in _LAYER_MAP:
        prefix, block = _LAYER_MAP[m.group(2)]
        kind = m.group(3)
        try:
            param = model.layers[int(m.group(1))].get_parameter(f"{prefix}{kind}")
        except AttributeError:
            raise ValueError(f"checkpoint has {hf_name!r} but the config declares no such parameter") from None
        if block is None:
            return param
        lo, hi = _row_ranges(config, prefix)[block]
        return param[lo:hi]
    if _IGNORED.search(hf_name):
        return None
    raise ValueError(f"unexpected weight {hf_name!r} in checkpoint for {config.arch.value}")


def build_model(config: ModelConfig, folder: Path, dtype: torch.dtype, device: str | torch.device) -> LlamaForCausalLM:
    """Allocate the model uninitialised on `device` in `dtype` and fill every parameter from `folder`."""
    # A bf16 model converted from a GGUF, on a CPU with the 4-bit decode kernel, is filled in fp32 first: its Q4_1
    # weights are found exactly there (engine/models/dense.py), then it is cast. Other folders (a Hugging Face
    # checkpoint cannot be exactly 4-bit) load straight in bf16: no fp32 copy, no search.
    four_bit = (
        dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and (folder / SOURCE_FILE).is_file()
        and decode_kernel_available()
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32 if four_bit else dtype).to_empty(device=device)
    # RoPE frequencies are a non-persistent fp32 buffer: recompute after allocation.
    model.rotary.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    filled = {id(p): 0 for p in model.parameters()}
    # A fused parameter's row slices share its storage: map storage back to the parameter to count coverage.
    owner = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    target = _target(model, config, name)
                    if target is None:
                        continue
                    tensor = f.get_tensor(name)
                    if tensor.shape != target.shape:
                        raise ValueError(
                            f"{path.name}:{name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    param = owner[target.untyped_storage().data_ptr()]
                    filled[id(param)] += target.numel()
    missing = [n for n, p in model.named_parameters() if filled[id(p)] != p.numel()]
    if missing:
        raise ValueError(f"checkpoint in {folder} does not fill parameters {missing[:6]} (config/weights mismatch?)")
    model = model.eval().requires_grad_(False)
    if four_bit:
        model.derive_decode_panels()
        model = model.to(dtype)
        model.rotary.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    elif dtype == torch.bfloat16 and torch.device(device).type == "cpu" and decode_kernel_available():
        model.derive_decode_panels()  # bf16 panels for generated rows, where they beat oneDNN here (dense.py)
    model.pack_weights()
    return model
