"""`ReuseAdmission`: which blocks DRAM evicts are worth a disk write (`DiskWrites.REUSED`).

On a small host each disk write is CPU taken from the engine (docs/history/benchmarks.json, "Where the served rounds'
time goes": LMDB took ~1 CPU s a round of 32 × 512-token prompts beside two engine threads, ~1 ms a 368 KiB block),
and in a workload of new prompts no written block is ever read. Where evicted blocks do come back (15–24% of them on
the Mooncake trace, with DRAM at 1% of its working set and the disk at 5–20%: the same file, "Saves only while
evicted blocks come back"), each one found on disk saves a recompute worth ~10 writes, so there the
disk should take everything. So this watches whether evicted blocks come back, and:

- while at least `write_all_returns` of the evicted blocks come back (and for the first `min_evictions`, before the
  rate means anything), admits every evicted block, as `DiskWrites.EVICTED` does;
- below it, admits only blocks that showed reuse: read while in DRAM, or evicted once before (CacheLib's "reject
  first" admission for flash caches: a first eviction leaves only a ghost key).

"Come back" means a lookup asked for an evicted block's key again (served from disk, or recomputed if it was
declined). Ghosts of evicted blocks are kept for as many bytes as the disk holds (an older one's block could not
have stayed on disk anyway), and the rate is a decayed average over the last `window` evictions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from common.keys import BlockKey

# On a 2-core Zen 5 EPYC a block's disk write takes ~1 CPU ms (1.1 s for 1120 LMDB writes of 368 KiB), ~1.5 ms of the
# engine's time beside it; computing the block again ~15 CPU ms (a cold 2048-token prompt: 960 ms on both cores).
# So writing every evicted block pays once 1 in 10 comes back.
WRITE_ALL_RETURNS = 0.1
WINDOW_EVICTIONS = 4096
# Evictions before the rate is trusted; until then every block is written, as EVICTED does. Returns lag their
# evictions by the reuse distance, so an early rate reads low: on the Mooncake trace (DRAM 1% of the working set,
# disk 5% / 20%), starting on reuse only lost 0.4 / 0.9 points of hit rate, writing the first 1024 all 0.10 / 0.55.
MIN_EVICTIONS = 1024


@dataclass
class _Ghost:
    nbytes: int
    returned: bool = False


class ReuseAdmission:
    def __init__(
        self,
        ghost_bytes: int,
        write_all_returns: float = WRITE_ALL_RETURNS,
        window: int = WINDOW_EVICTIONS,
        min_evictions: int = MIN_EVICTIONS,
    ) -> None:
        if ghost_bytes <= 0:
            raise ValueError(f"ghost_bytes must be positive, got {ghost_bytes}")
        if not 0 < write_all_returns <= 1 or window <= 0 or min_evictions < 0:
            raise ValueError("write_all_returns must be in (0, 1], window positive, min_evictions >= 0")
        self.ghost_bytes = ghost_bytes
        self.write_all_returns = write_all_returns
        self.min_evictions = min_evictions
        self._decay = 1.0 - 1.0 / window
        self._ghosts: OrderedDict[BlockKey, _Ghost] = OrderedDict()  # evicted blocks, oldest first
        self._ghosted = 0
        self._evicted_avg = 0.0  # decayed counts over the last `window` evictions
        self._returned_avg = 0.0
        self.evictions = 0
        self.admitted = 0
        self.declined = 0
        self.returns = 0

    @property
    def return_rate(self) -> float:
        """The decayed share of evicted blocks asked for again."""
        return self._returned_avg / self._evicted_avg if self._evicted_avg else 0.0

    @property
    def writes_all(self) -> bool:
        return self.evictions < self.min_evictions or self.return_rate >= self.write_all_returns

    def evicted(self, key: BlockKey, nbytes: int, was_read: bool) -> bool:
        """DRAM evicts this block now (`was_read`: a load read it while there); whether it goes to disk."""
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:
            self._ghosted -= ghost.nbytes
        admit = was_read or ghost is not None or self.writes_all
        if admit:
            self.admitted += 1
        else:
            self.declined += 1
        self.evictions += 1
        self._evicted_avg = self._evicted_avg * self._decay + 1.0
        self._returned_avg *= self._decay
        self._ghosts[key] = _Ghost(nbytes)
        self._ghosted += nbytes
        while self._ghosted > self.ghost_bytes:
            _, old = self._ghosts.popitem(last=False)
            self._ghosted -= old.nbytes
        return admit

    def looked_up(self, keys: Sequence[BlockKey]) -> None:
        """A lookup asked for `keys`: an evicted block among them came back (counted once per eviction)."""
        if not self._ghosts:
            return
        for key in keys:
            ghost = self._ghosts.get(key)
            if ghost is not None and not ghost.returned:
                ghost.returned = True
                self.returns += 1
                self._returned_avg += 1.0

    def __len__(self) -> int:
        return len(self._ghosts)
