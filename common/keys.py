"""Content-addressed block keys, decided once for the whole project (DESIGN.md §3).

The engine's device prefix cache and the store both call these functions, so a block computed by any
node on any host has the same 16-byte key everywhere:

    root    = H(model fingerprint, dtype, block size, KV layout version, cache_salt)
    key_i   = H(key_{i-1} ‖ token ids of block i ‖ extra_i)

H is 128-bit xxh3 with its fixed default seed, so keys are deterministic across processes and hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

KEY_NBYTES = 16
# Bump when the byte layout of a stored block changes: old entries then simply stop matching.
KV_LAYOUT_VERSION = 1

BlockKey = bytes


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that must differ for two caches' blocks to be incompatible."""

    model_fingerprint: str
    dtype: str
    block_size: int
    layout_version: int = KV_LAYOUT_VERSION

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must be a non-empty string")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # Fixed-width little-endian so the bytes do not depend on the platform or on how ids were held.
    return np.asarray(token_ids, dtype="<u4").tobytes()


def root_key(namespace: KeyNamespace, cache_salt: str | None = None) -> BlockKey:
    """The parent of a sequence's first block; `cache_salt` isolates tenants from each other."""
    text = "\x1f".join(
        (
            "ucm-root",
            namespace.model_fingerprint,
            namespace.dtype,
            str(namespace.block_size),
            str(namespace.layout_version),
            cache_salt or "",
        )
    )
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


def chain_key(parent: BlockKey, token_ids: Sequence[int], extra: bytes = b"") -> BlockKey:
    """Key of one full block given its parent's key."""
    if len(parent) != KEY_NBYTES:
        raise ValueError(f"parent key must be {KEY_NBYTES} bytes, got {len(parent)}")
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(_token_bytes(token_ids))
    if extra:
        h.update(extra)
    return h.digest()


def block_keys(root: BlockKey, token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """Keys of every *full* block of `token_ids`; a trailing partial block has no key."""
    keys: list[BlockKey] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
