"""Fixed caps on every size or count a store client can name, checked before anything is allocated from it.

A length field is only trusted once it is under these caps (and, for dumps, equal to the namespace's declared
layout): one request naming `num_layers=10**8` must cost an error reply, not gigabytes. The list caps are
also declared on the wire structs (`msgspec.Meta(max_length=...)`), so a decode stops at them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ucm.record import MAX_LAYERS

__all__ = ["MAX_BLOCK_TOKENS", "MAX_KEYS_PER_REQUEST", "MAX_LAYERS", "MAX_LOAD_FRAMES", "MAX_NAME_CHARS", "LayoutCaps"]

MAX_KEYS_PER_REQUEST = 1 << 16  # keys or blocks in one request (a dump also needs one frame per block)
MAX_BLOCK_TOKENS = 1 << 16  # token ids in one block; the engine's block size is 16..256
MAX_NAME_CHARS = 256  # a namespace name
MAX_LOAD_FRAMES = 1 << 20  # blocks x layers in one load reply (a repeated block would be copied each time)


@dataclass(frozen=True)
class LayoutCaps:
    """Bounds on what a client may declare as its namespace's layout (the daemon's config sets them)."""

    max_layer_nbytes: int = 64 << 20
    max_block_nbytes: int = 512 << 20  # all layers of one block
    max_namespaces_per_client: int = 256
    max_pending_blocks: int = 1 << 17  # dumped, not yet committed, across all clients

    def __post_init__(self) -> None:
        if (
            min(self.max_layer_nbytes, self.max_block_nbytes, self.max_namespaces_per_client, self.max_pending_blocks)
            <= 0
        ):
            raise ValueError("layout caps must be positive")
