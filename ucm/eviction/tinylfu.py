"""W-TinyLFU: TinyLFU admission over a segmented LRU, meant for the disk tier (Einziger et al., TOS'17).

Every sighting (admit, touch) is recorded in a frequency sketch. New blocks enter a small LRU window
(`window_fraction` of the bytes) so that a burst of fresh reuse still hits; when the window overflows,
its LRU block duels the main area's next victim and only the one seen more often stays — cold one-off
blocks therefore never displace a hot working set. With `window_fraction=0` the duel happens at the
door instead: `admit` rejects a newcomer that is colder than the block(s) it would push out.
The main area is a segmented LRU: probation (~20% of main) and protected (read again, ~80%).

The window's size adapts by hill climbing (as Caffeine does): after every sample of accesses, if the hit
rate fell since the previous sample the climber reverses direction, and the window moves by a step that
decays. Recency-heavy workloads (most reuse within one conversation turn) thus drift towards LRU, while
frequency-heavy ones keep a small window.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from ucm.eviction.base import PolicyName, check_capacity, check_size
from ucm.eviction.sketch import FrequencySketch

PROTECTED_FRACTION = 0.8  # of the main area
MAX_DUEL_VICTIMS = 8  # a big newcomer is compared against at most this many would-be victims
DEFAULT_WINDOW_FRACTION = 0.01  # Caffeine's default
CLIMB_STEP = 0.0625  # first hill-climbing step, as a fraction of the capacity
CLIMB_DECAY = 0.99
MAX_WINDOW_FRACTION = 0.99


class TinyLFUPolicy:
    name = PolicyName.TINYLFU

    def __init__(
        self, capacity_bytes: int, window_fraction: float = DEFAULT_WINDOW_FRACTION, adaptive: bool = True
    ) -> None:
        self.capacity_bytes = check_capacity(capacity_bytes)
        if not 0.0 <= window_fraction <= MAX_WINDOW_FRACTION:
            raise ValueError(f"window_fraction must be in [0, {MAX_WINDOW_FRACTION}], got {window_fraction}")
        if adaptive and window_fraction == 0.0:
            raise ValueError("an adaptive window needs window_fraction > 0 (0 = pure admission filter)")
        self.window_target = int(capacity_bytes * window_fraction)
        self.adaptive = adaptive
        self._climb_step = CLIMB_STEP * capacity_bytes
        self._climb_sign = 1
        self._sample_hits = self._sample_misses = 0
        self._sample_size = 0  # set with the sketch, from the first block's size
        self._previous_rate: float | None = None
        # key -> size, LRU first
        self._window: OrderedDict[Hashable, int] = OrderedDict()
        self._probation: OrderedDict[Hashable, int] = OrderedDict()
        self._protected: OrderedDict[Hashable, int] = OrderedDict()
        self.window_bytes = 0
        self.probation_bytes = 0
        self.protected_bytes = 0
        self._sketch: FrequencySketch | None = None  # sized from the first block seen
        self._last_admitted: Hashable | None = None
        # Blocks that overflowed the window into probation and have not yet dueled a main victim.
        self._candidates: OrderedDict[Hashable, None] = OrderedDict()

    @property
    def protected_target(self) -> int:
        return int((self.capacity_bytes - self.window_target) * PROTECTED_FRACTION)

    @property
    def used_bytes(self) -> int:
        return self.window_bytes + self.probation_bytes + self.protected_bytes

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def frequency(self, key: Hashable) -> int:
        return self._sketch.estimate(key) if self._sketch is not None else 0

    def admit(self, key: Hashable, size: int) -> bool:
        check_size(size)
        self._record(key, size)
        self._last_admitted = key
        self._sampled(hit=False)
        need = self.used_bytes + size - self.capacity_bytes
        if self.window_target > 0 or need <= 0 or key in self:
            return True  # with a window, the duel happens when the window overflows (in evict)
        return self.frequency(key) > self._victims_frequency(need)

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        # Chains are not tracked: only the tier's deepest-first order keeps a request's new tail ahead of its root.
        check_size(size)
        if key != self._last_admitted:
            self._record(key, size)  # the tier skipped admit(): still count the sighting
            self._sampled(hit=False)
        self._last_admitted = None
        if key in self:
            self.remove(key)
            self._protect(key, size)
        elif self.window_target > 0:
            self._window[key] = size
            self.window_bytes += size
        else:
            self._probation[key] = size
            self.probation_bytes += size

    def touch(self, key: Hashable) -> None:
        if self._sketch is not None:
            self._sketch.increment(key)
        self._sampled(hit=True)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._probation:
            self._candidates.pop(key, None)  # read again: it earned its place
            size = self._probation.pop(key)
            self.probation_bytes -= size
            self._protect(key, size)
        elif key in self._protected:
            self._protected.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._candidates.pop(key, None)
        if key in self._window:
            self.window_bytes -= self._window.pop(key)
        elif key in self._probation:
            self.probation_bytes -= self._probation.pop(key)
        elif key in self._protected:
            self.protected_bytes -= self._protected.pop(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        # Window overflow moves to probation as candidates; each eviction is then a duel between the
        # oldest candidate and main's next victim, and the one seen less often goes.
        main_target = self.capacity_bytes - self.window_target
        while self.window_bytes > self.window_target and self._window:
            key, size = self._window.popitem(last=False)
            self.window_bytes -= size
            if self.probation_bytes + self.protected_bytes + size > main_target:
                self._candidates[key] = None  # main is full: it must win a duel to stay
            self._probation[key] = size
            self.probation_bytes += size
        candidate = next((k for k in self._candidates if can_evict(k)), None)
        if candidate is not None:
            del self._candidates[candidate]
            victim = next(
                (k for k, _ in self._main_order() if k not in self._candidates and k != candidate and can_evict(k)),
                None,
            )
            loser = candidate if victim is None or self.frequency(candidate) < self.frequency(victim) else victim
            self.remove(loser)
            return loser
        for key in self._all_order():
            if can_evict(key):
                self.remove(key)
                return key
        return None

    def segments(self) -> tuple[list[Hashable], list[Hashable], list[Hashable]]:
        """(window, probation, protected) keys, LRU first — for tests and debugging."""
        return list(self._window), list(self._probation), list(self._protected)

    # -- internals -----------------------------------------------------------------------------------

    def _record(self, key: Hashable, size: int) -> None:
        if self._sketch is None:
            entries = max(1, self.capacity_bytes // max(size, 1))
            self._sketch = FrequencySketch(entries)
            self._sample_size = max(64, entries // 16)  # short samples: the climber must move within one run
        self._sketch.increment(key)

    def _sampled(self, hit: bool) -> None:
        """Hill climbing on the window size: keep moving while the hit rate does not drop."""
        if not self.adaptive or not self._sample_size:
            return
        if hit:
            self._sample_hits += 1
        else:
            self._sample_misses += 1
        if self._sample_hits + self._sample_misses < self._sample_size:
            return
        rate = self._sample_hits / self._sample_size
        if self._previous_rate is not None and rate < self._previous_rate:
            self._climb_sign = -self._climb_sign
        self._previous_rate = rate
        low, high = 1.0, MAX_WINDOW_FRACTION * self.capacity_bytes
        self.window_target = int(min(high, max(low, self.window_target + self._climb_sign * self._climb_step)))
        self._climb_step *= CLIMB_DECAY
        self._sample_hits = self._sample_misses = 0

    def _victims_frequency(self, need: int) -> int:
        freq = 0
        for i, (victim, victim_size) in enumerate(self._main_order()):
            freq = max(freq, self.frequency(victim))
            need -= victim_size
            if need <= 0 or i + 1 >= MAX_DUEL_VICTIMS:
                break
        return freq

    def _main_order(self) -> Iterator[tuple[Hashable, int]]:
        yield from self._probation.items()
        yield from self._protected.items()

    def _all_order(self) -> Iterator[Hashable]:
        yield from self._probation
        yield from self._protected
        yield from self._window

    def _protect(self, key: Hashable, size: int) -> None:
        self._protected[key] = size
        self.protected_bytes += size
        # Overflow from protected is demoted, not dropped: it gets one more chance in probation.
        while self.protected_bytes > self.protected_target and len(self._protected) > 1:
            old, old_size = self._protected.popitem(last=False)
            self.protected_bytes -= old_size
            self._probation[old] = old_size
            self.probation_bytes += old_size
