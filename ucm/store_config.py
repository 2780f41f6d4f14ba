"""`StoreConfig`: everything that shapes one store, built by the CLI or by the embedding process."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ucm.eviction import PolicyName

_MiB = 1 << 20
# What the daemon, `up` and the vLLM plugin's daemon run unless told otherwise: the policy that did best on the traces
# held out from tuning (benchmarks.hit_rate_suite; docs/benchmarks.md has the table), at ~1 KB of metadata per
# resident block and up to 8 ghosts per block (ucm/eviction/density.py).
DEFAULT_POLICY = PolicyName.DENSITY


class DiskWrites(str, enum.Enum):  # noqa: UP042 (the CLI's values)
    """When a committed block is written to the disk tier."""

    # Every commit, asynchronously (ucm/write_behind.py): the disk holds what DRAM holds, across restarts.
    BEHIND = "behind"
    # Only when DRAM evicts it: a victim tier that extends DRAM's capacity. A block still in DRAM at close is not
    # written, so nothing survives a restart that DRAM held. `ucm-serve up` runs this on its temporary folder
    # (removed at stop anyway): on its 2-core EPYC writing every block behind cost ~10% of served throughput.
    EVICTED = "evicted"
    # As EVICTED while evicted blocks come back (1 in 20 or more); otherwise only blocks that showed reuse: read while
    # in DRAM, or evicted once before (ucm/reuse_admission.py). Spares a workload of new prompts its disk writes.
    REUSED = "reused"


@dataclass(frozen=True)
class StoreConfig:
    dram_bytes: int
    disk_path: str | None = None  # None: no disk tier
    disk_bytes: int = 0
    disk_writes: DiskWrites = DiskWrites.BEHIND
    lmdb_map_size: int | None = None  # None: twice the disk capacity plus slack (the map is sparse, not allocated)
    policy: PolicyName = DEFAULT_POLICY  # DRAM tier
    disk_policy: PolicyName = DEFAULT_POLICY
    promote_on_disk_hit: bool = True
    # Disk reads and promotions always verify every payload's checksum. A DRAM entry's checksums were computed
    # from (commit) or verified against (promotion) its very bytes, which are immutable Python buffers, so
    # re-hashing on each DRAM read only guards against memory corruption; it costs ~1/3 of load bandwidth.
    verify_dram_reads: bool = False
    write_queue_blocks: int = 4096  # write-behind back-pressure: commit waits only when this many are queued
    load_threads: int = 2
    pending_timeout_s: float = 600.0  # dumped-but-never-committed blocks are dropped after this long

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"dram_bytes must be positive, got {self.dram_bytes}")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be positive when disk_path is set, got {self.disk_bytes}")
        if self.lmdb_map_size is not None and self.lmdb_map_size < self.disk_bytes:
            raise ValueError(f"lmdb_map_size {self.lmdb_map_size} is smaller than disk_bytes {self.disk_bytes}")
        if not isinstance(self.disk_writes, DiskWrites):
            raise ValueError(f"disk_writes must be a DiskWrites, got {self.disk_writes!r}")
        for name in ("policy", "disk_policy"):
            if not isinstance(getattr(self, name), PolicyName):
                raise ValueError(f"{name} must be a PolicyName, got {getattr(self, name)!r}")
        if self.write_queue_blocks <= 0 or self.load_threads <= 0 or self.pending_timeout_s <= 0:
            raise ValueError("write_queue_blocks, load_threads and pending_timeout_s must be positive")

    @property
    def map_size(self) -> int:
        return self.lmdb_map_size if self.lmdb_map_size is not None else 2 * self.disk_bytes + 64 * _MiB
