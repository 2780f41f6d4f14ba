"""A file's content hash: the same on every host for the same bytes, memoised on disk so that multi-GB checkpoints
hash once. The engine's model fingerprint and the vLLM plugin's model identity both name weights by it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

_HASH_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """128-bit xxh3 of a file's bytes, hex; identical on every host for identical content."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cached_file_digest(path: Path, cache_root: Path) -> str:
    """`file_digest`, memoised under `cache_root`/digests by (absolute path, size, mtime).

    `cache_root` is the project's cache folder (`ucm_kernels.cache_dir.cache_dir()`), passed in so this module
    imports nothing of ours."""
    st = path.stat()
    stamp = f"{path.resolve()}\x1f{st.st_size}\x1f{st.st_mtime_ns}"
    memo = cache_root / "digests" / f"{xxhash.xxh3_64_hexdigest(stamp.encode())}.txt"
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = file_digest(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError as exc:  # a read-only cache dir only costs a re-hash next time
        log.debug("could not memoise digest of %s: %s", path, exc)
    return digest
