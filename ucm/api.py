"""The store's interface (UCM V1 shape), shared by the in-process store and the daemon client.

The connector codes against `KVStore`; `ucm.store.Store` (embedded) and `ucm.client.StoreClient`
(daemon) both implement it. Payloads are opaque bytes to the store: one buffer per (block, layer),
holding that layer's K then V for the block's tokens, laid out by the caller.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.keys import BlockKey


class StoreUnavailable(ConnectionError):
    """The store (daemon) did not answer in time: down, unreachable or overloaded. Callers recompute."""


class Tier(enum.Enum):
    DRAM = "dram"
    DISK = "disk"


@dataclass(frozen=True)
class BlockRef:
    """What the caller knows about a block: a hit is served only if parent and token ids match too."""

    key: BlockKey
    parent: BlockKey
    token_ids: tuple[int, ...]


class TaskStatus(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class StoreTask(Protocol):
    """An asynchronous dump or load."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished; True only if every block succeeded."""
        ...

    def check(self) -> TaskStatus:
        """Non-blocking status."""
        ...

    @property
    def failed_blocks(self) -> list[int]:
        """Indices (into the task's block list) that failed: missing, corrupt, mismatched or I/O error."""
        ...

    @property
    def disk_blocks(self) -> list[int]:
        """Of a load's blocks that did not fail, those served from the disk tier (the others: from DRAM)."""
        ...


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    blocks: int = 0
    # Blocks that left, per reason: to make room (the policy's choice), asked (`remove`), found corrupt by a read.
    evictions: int = 0
    removed: int = 0
    corrupt_dropped: int = 0
    # Blocks not written here for want of reuse (the disk with DiskWrites.REUSED: DRAM evicted them unread, first seen).
    declined: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


@dataclass
class StoreStats:
    tiers: dict[Tier, TierStats] = field(default_factory=dict)
    lookups: int = 0
    lookup_hit_blocks: int = 0
    lookup_blocks: int = 0
    corrupt_dropped: int = 0
    pending_blocks: int = 0
    # Bytes held outside the tiers: dumped and not yet committed, or committed and waiting for their disk write; and
    # their most at once since start. DRAM's capacity plus the peak bounds the payload bytes the store held at once.
    transit_bytes: int = 0
    transit_bytes_peak: int = 0
    # The daemon's own counters (always 0 in process): frames it could not decode or answer (malformed,
    # unknown type, over a limit, wrong frame count, or any error while receiving), and well-formed requests
    # it refused (sizes not matching the namespace's layout, forged keys, another client's keys...).
    bad_frames: int = 0
    refused_requests: int = 0
    shared_memory_loads: int = 0  # loads the daemon wrote into a same-host client's shared memory (no frames)
    shared_memory_dumps: int = 0  # dumps the daemon read from a same-host client's shared memory (no frames)


class KVStore(Protocol):
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Length of the prefix of `keys` that is committed in some tier."""
        ...

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]: ...

    def dump(
        self, blocks: Sequence[BlockRef], layer: int, num_layers: int, data: Sequence[memoryview | bytes]
    ) -> StoreTask:
        """Write one layer's payload for each block; invisible to lookups until `commit`.

        `data` must stay unchanged until the task finishes (the in-process store copies before returning;
        the daemon client sends from an I/O thread). A block already committed is skipped (same key = same
        bytes); one being dumped with a different parent/token ids (a key collision) fails.
        """
        ...

    def dump_layers(
        self,
        blocks: Sequence[BlockRef],
        layers: Sequence[int],
        num_layers: int,
        data: Sequence[Sequence[memoryview | bytes]],
    ) -> StoreTask:
        """`dump` of several layers at once (one round trip to a daemon): `data[i][j]` is block i's `layers[j]`."""
        ...

    def commit(self, keys: Sequence[BlockKey], ok: bool) -> None:
        """Publish blocks whose every layer was dumped (ok=True), or discard them (ok=False)."""
        ...

    def load(self, blocks: Sequence[BlockRef], layers: Sequence[int], dst: Sequence[Sequence[memoryview]]) -> StoreTask:
        """Copy the payload of `layers[j]` of `blocks[i]` into `dst[i][j]`; pins blocks until done."""
        ...

    def staging_buffer(self, nbytes: int) -> memoryview:
        """Writable host memory that loads reach fastest (a daemon on this host writes it directly)."""
        ...

    def prefetch(self, keys: Sequence[BlockKey]) -> None:
        """Hint: promote these blocks from disk to DRAM."""
        ...

    def remove(self, keys: Sequence[BlockKey]) -> None: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


class DumpsByLayers:
    """`KVStore.dump` as `dump_layers` of one layer, for a store whose work is per request, not per layer."""

    def dump(
        self: KVStore, blocks: Sequence[BlockRef], layer: int, num_layers: int, data: Sequence[memoryview | bytes]
    ) -> StoreTask:
        return self.dump_layers(blocks, [layer], num_layers, [[buf] for buf in data])


def check_dump_layers(
    blocks: Sequence[BlockRef], layers: Sequence[int], num_layers: int, data: Sequence[Sequence[object]]
) -> None:
    """`KVStore.dump_layers`' arguments, or ValueError: one row of len(layers) payloads per block, and distinct
    layers of 0..num_layers-1."""
    if len(blocks) != len(data) or any(len(row) != len(layers) for row in data):
        raise ValueError(f"dump: {len(blocks)} blocks need {len(blocks)} rows of {len(layers)} payloads")
    if not layers or not all(0 <= layer < num_layers for layer in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"dump: layers {list(layers)[:8]} are not distinct layers of 0..{num_layers - 1}")
