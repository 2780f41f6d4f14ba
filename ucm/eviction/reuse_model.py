"""`ReuseModel`: when blocks of each class are used again, learned online; the estimator of `DensityPolicy`.

A *start* is one use of a block (its insert or a hit), tagged with the block's class at that moment. A start
is followed for `horizon` accesses, also after its block has left the tier (the key stays as a ghost), and
ends in a reuse at some age (accesses since the start) or runs past the horizon. From these outcomes the
model estimates, per class and age bin, the hazard h(x) = P(used again at age x | not used again before x).
Starts still open count as at risk (Kaplan-Meier), so a young history does not read as "never used again";
a class with little data is pulled toward the hazard of all classes pooled by `PRIOR_STARTS` pseudo-starts.

The value of keeping a block of class c at age a is its Gittins index: the best ratio, over how much longer
one might keep it, of expected hits to expected space-time (Aven, Coffman & Kogan, 1987). LHD's "hit density"
(Beckmann et al., NSDI'18) ranks by the same ratio at one fixed horizon. Values are recomputed every
`period` accesses; counts decay with a half-life of max(`HALF_LIFE_MIN`, 2 horizons) so the model follows
a workload that changes. O(1) per access; O(bins² × classes) per recompute.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable
from typing import NamedTuple

AGE_BINS_PER_OCTAVE = 2  # log-spaced ages: fine where reuse is quick, coarse where data are thin
# A start is followed for this many capacity-fulls of accesses: long enough to see that some class is worth
# keeping several times longer than the cache turns over (Mooncake at 1% of its working set turns over in
# ~700 accesses; conversations come back after a median ~2,500). It bounds the ghosts kept: at most one per
# distinct key used within the horizon, and the policy caps them (`left`).
HORIZON_CAPACITIES = 16
PRIOR_STARTS = 16.0
HALF_LIFE_MIN = 1 << 15  # accesses; small caches still average over many outcomes
OPEN_EPOCHS_PER_PERIOD = 16  # open starts are counted per epoch (period / 16 accesses), not one by one
MIN_PERIOD = 256


class _Start(NamedTuple):
    ts: int
    cls: int
    hits: int


def age_edges(horizon: int) -> list[int]:
    """Bin i holds ages in [edges[i], edges[i+1]); every age below 4 has its own bin, then log-spaced."""
    edges, x = [0], 1.0
    while edges[-1] < horizon:
        edges.append(max(edges[-1] + 1, round(x)))
        x *= 2 ** (1 / AGE_BINS_PER_OCTAVE)
    return edges


class ReuseModel:
    def __init__(self, num_classes: int, entries: int) -> None:
        if num_classes <= 0 or entries <= 0:
            raise ValueError(f"need positive num_classes and entries, got {num_classes}, {entries}")
        self.num_classes = num_classes
        self.entries = entries
        self.horizon = HORIZON_CAPACITIES * entries
        self._edges = age_edges(self.horizon)
        bins = len(self._edges) - 1
        self._widths = [self._edges[i + 1] - self._edges[i] for i in range(bins)]
        self.period = max(MIN_PERIOD, entries)
        self._epoch_len = max(1, self.period // OPEN_EPOCHS_PER_PERIOD)
        self._decay = 0.5 ** (self.period / max(HALF_LIFE_MIN, 2 * self.horizon))
        self._open: OrderedDict[Hashable, _Start] = OrderedDict()  # oldest start first
        # Open starts whose block left the cache (key -> start time), and a heap of them by start time, oldest
        # first: the ones a cap drops (see `left`). Heap entries of ghosts that came back are skipped lazily.
        self._ghosts: dict[Hashable, int] = {}
        self._ghost_heap: list[tuple[int, int, Hashable]] = []
        self._ghost_seq = itertools.count()
        self._open_counts: dict[int, list[int]] = {}  # epoch -> open starts per class
        self._reused = [[0.0] * bins for _ in range(num_classes)]
        self._expired = [0.0] * num_classes
        self._censored = [[0.0] * bins for _ in range(num_classes)]  # ghosts dropped by the cap, by age
        self._values = [[0.0] * bins for _ in range(num_classes)]
        self._next_update = self.period

    def __len__(self) -> int:
        """Starts followed now: the resident blocks plus the ghosts."""
        return len(self._open)

    @property
    def ghosts(self) -> int:
        """Starts followed whose block has left the cache."""
        return len(self._ghosts)

    def start(self, key: Hashable, cls: int, hits: int, now: int) -> None:
        """`key` was used at time `now` while in class `cls`, after `hits` earlier uses; follow it from here."""
        assert 0 <= cls < self.num_classes, f"class {cls} outside 0..{self.num_classes - 1}"
        self.forget(key)
        self._open[key] = _Start(now, cls, hits)
        counts = self._open_counts.get(now // self._epoch_len)
        if counts is None:
            counts = self._open_counts[now // self._epoch_len] = [0] * self.num_classes
        counts[cls] += 1

    def reclass(self, key: Hashable, cls: int) -> None:
        """The open start of `key` belongs to class `cls` after all (what decided its class arrived after its use)."""
        assert 0 <= cls < self.num_classes, f"class {cls} outside 0..{self.num_classes - 1}"
        start = self._open.get(key)
        if start is None or start.cls == cls:
            return
        counts = self._open_counts[start.ts // self._epoch_len]
        counts[start.cls] -= 1
        counts[cls] += 1
        self._open[key] = start._replace(cls=cls)

    def end(self, key: Hashable, now: int) -> int | None:
        """`key` is used again at `now`: record the reuse; the hits its start carried (None: not followed)."""
        start = self._close(key)
        if start is None:
            return None
        self._reused[start.cls][self._bin(now - start.ts)] += 1
        return start.hits

    def left(self, key: Hashable, now: int, max_ghosts: int) -> None:
        """`key` was evicted: keep following it as a ghost, but keep at most `max_ghosts` ghosts. The ones
        over the cap, least recently used first, are censored: counted at risk up to their age, as a start that is
        still open, so the hazard stays unbiased; only their class is lost if they come back."""
        if max_ghosts < 0:
            raise ValueError(f"max_ghosts must be >= 0, got {max_ghosts}")
        start = self._open.get(key)
        if start is not None:
            self._ghosts[key] = start.ts
            heapq.heappush(self._ghost_heap, (start.ts, next(self._ghost_seq), key))
        heap = self._ghost_heap
        while len(self._ghosts) > max_ghosts:
            ts, _, oldest = heapq.heappop(heap)
            if self._ghosts.get(oldest) != ts:
                continue
            start = self._close(oldest)
            assert start is not None, "a ghost is an open start"
            self._censored[start.cls][self._bin(now - start.ts)] += 1
        if len(heap) > 2 * len(self._ghosts) + 1024:
            self._ghost_heap = [(ts, seq, k) for ts, seq, k in heap if self._ghosts.get(k) == ts]
            heapq.heapify(self._ghost_heap)

    def forget(self, key: Hashable) -> None:
        """Stop following `key` without an outcome (it was removed on purpose, not evicted)."""
        self._close(key)

    def advance(self, now: int) -> None:
        """Starts older than the horizon end unused; recompute the values when a period has passed."""
        opened = self._open
        while opened:
            key, start = next(iter(opened.items()))
            if now - start.ts < self.horizon:
                break
            self._close(key)
            self._expired[start.cls] += 1
        if now >= self._next_update:
            self._next_update = now + self.period
            self._update(now)

    def value(self, cls: int, age: int) -> float:
        """Expected hits per access of space-time of keeping a block of class `cls` that is `age` accesses old."""
        return self._values[cls][self._bin(age)]

    def _bin(self, age: int) -> int:
        return min(bisect.bisect_right(self._edges, age), len(self._widths)) - 1

    def _close(self, key: Hashable) -> _Start | None:
        start = self._open.pop(key, None)
        if start is not None:
            self._ghosts.pop(key, None)
            epoch = start.ts // self._epoch_len
            counts = self._open_counts[epoch]
            counts[start.cls] -= 1
            if not any(counts):
                del self._open_counts[epoch]
        return start

    def _update(self, now: int) -> None:
        bins, classes = len(self._widths), range(self.num_classes)
        still_open = [[0.0] * bins for _ in classes]
        for epoch, counts in self._open_counts.items():
            age_bin = self._bin(max(0, now - epoch * self._epoch_len - self._epoch_len // 2))
            for c in classes:
                still_open[c][age_bin] += counts[c]
        for c in classes:  # a censored start was at risk up to its age, like an open one
            for x in range(bins):
                still_open[c][x] += self._censored[c][x]
        at_risk = []  # starts that reached each age: reused at that age or later, expired, or open and older
        for c in classes:
            row, total = [0.0] * bins, self._expired[c]
            for x in range(bins - 1, -1, -1):
                total += self._reused[c][x] + still_open[c][x]
                row[x] = total
            at_risk.append(row)
        pooled = []
        for x in range(bins):
            risk = sum(at_risk[c][x] for c in classes)
            pooled.append(sum(self._reused[c][x] for c in classes) / risk if risk > 0 else 0.0)
        for c in classes:
            hazard = [
                (self._reused[c][x] + PRIOR_STARTS * pooled[x]) / (at_risk[c][x] + PRIOR_STARTS) for x in range(bins)
            ]
            self._values[c] = self._gittins(hazard)
            self._reused[c] = [r * self._decay for r in self._reused[c]]
            self._expired[c] *= self._decay
            self._censored[c] = [n * self._decay for n in self._censored[c]]

    def _gittins(self, hazard: list[float]) -> list[float]:
        widths, bins = self._widths, len(hazard)
        out = [0.0] * bins
        for a in range(bins):
            best = hits = space_time = 0.0
            alive = 1.0  # P(not used again yet | reached age bin a)
            for x in range(a, bins):
                h = hazard[x]
                space_time += alive * (1.0 - h / 2) * widths[x]  # one used again within bin x stays half of it
                hits += alive * h
                alive *= 1.0 - h
                if hits > best * space_time:
                    best = hits / space_time
                if alive < 1e-9:
                    break
            out[a] = best
        return out
