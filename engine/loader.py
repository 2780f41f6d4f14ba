"""`load_model(spec)`: resolve the spec to a local HF folder, build our model from it, fingerprint it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from common.file_digest import cached_file_digest
from engine.model_config import ModelConfig
from engine.model_source import resolve_model_dir
from engine.models.llama import LlamaForCausalLM
from engine.tokenizer import Tokenizer
from engine.weights import build_model
from protocol import defaults
from ucm_kernels.cache_dir import cache_dir

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: str  # same on every host loading the same weights + architecture (block-key namespace)
    path: Path
    dtype: torch.dtype


def model_fingerprint(folder: Path, config: ModelConfig) -> str:
    """Content hash of every weight file plus the architecture; independent of path, host and process."""
    h = xxhash.xxh3_128()
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.name.encode())
        h.update(cached_file_digest(path, cache_dir()).encode())
    h.update(json.dumps(config.arch_dict(), sort_keys=True).encode())
    return f"{config.arch.value}-{h.hexdigest()}"


def load_model(
    spec: str | os.PathLike[str] = defaults.MODEL,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {SUPPORTED_DTYPES}")
    start = time.perf_counter()
    folder = resolve_model_dir(spec)
    config = ModelConfig.from_folder(folder)
    tokenizer = Tokenizer(folder)
    if tokenizer.eos_token_ids - set(config.eos_token_ids):
        eos = tuple(sorted(set(config.eos_token_ids) | tokenizer.eos_token_ids))
        config = dataclasses.replace(config, eos_token_ids=eos)
    if config.sliding_window is not None and config.sliding_window < config.max_position_embeddings:
        log.warning(
            "%s uses a %d-token sliding window; attention here is full, so sequences are capped at %d tokens",
            spec,
            config.sliding_window,
            config.max_model_len,
        )
    model = build_model(config, folder, dtype, device)
    fingerprint = model_fingerprint(folder, config)
    log.info(
        "loaded %s (%s, %d layers, %s on %s) in %.2f s",
        spec,
        config.arch.value,
        config.num_layers,
        str(dtype).removeprefix("torch."),
        device,
        time.perf_counter() - start,
    )
    return LoadedModel(model, config, tokenizer, fingerprint, folder, dtype)
