"""The model part of the vLLM key namespace: the same weights give the same identity on every host.

A local folder is identified by its contents (config.json and every safetensors file, digests memoised by
`common.file_digest.cached_file_digest`), so two hosts with the folder at different paths share blocks. A hub
id is taken as given, with its revision: vLLM resolved it, and we must not download anything to hash it.
"""

from __future__ import annotations

from pathlib import Path

import xxhash


def model_identity(model: str, revision: str | None = None) -> str:
    folder = Path(model)
    weights = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not weights or not (folder / "config.json").is_file():
        return f"hub:{model}@{revision or 'default'}"
    from common.file_digest import cached_file_digest  # imported late to keep this module light
    from ucm_kernels.cache_dir import cache_dir

    h = xxhash.xxh3_128()
    h.update((folder / "config.json").read_bytes())
    for path in weights:
        h.update(path.name.encode())
        h.update(cached_file_digest(path, cache_dir()).encode())
    return f"folder:{h.hexdigest()}"
