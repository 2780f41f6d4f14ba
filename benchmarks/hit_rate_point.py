"""One measured point of the hit-rate sweeps (benchmarks/hit_rate.py), as the report prints and plots it
(benchmarks/hit_rate_report.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.store_config import DiskWrites


@dataclass(frozen=True)
class Point:
    workload: str
    sweep: str  # "dram" or "tiered"
    policy: str
    capacity_frac: float  # of the working set: the DRAM tier (dram sweep) or the disk tier (tiered sweep)
    dram_blocks: int
    disk_blocks: int
    accesses: int
    dram_hits: int
    disk_hits: int
    belady_hits: int  # MIN with one cache of dram_blocks + disk_blocks
    infinite_hits: int
    seconds: float
    disk_writes: str = DiskWrites.BEHIND.value  # the tiered sweep's StoreConfig.disk_writes
    disk_blocks_written: int = 0

    @property
    def hit_rate(self) -> float:
        return (self.dram_hits + self.disk_hits) / self.accesses
