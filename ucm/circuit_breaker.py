"""`CircuitBreaker`: after one call to the store daemon times out, skip the store until it answers a probe.

Without it a dead store costs every request a full timeout (the lookup blocks the engine step). With it the
first call pays one short timeout, trips the breaker, and from then on `StoreClient` refuses calls at once
(`CircuitOpen`: lookups read as misses, saves are dropped, the node recomputes); calls already waiting give up
too. A probe thread pings the store with exponential backoff and closes the breaker on the first answer.

    CLOSED ──timeout──▶ OPEN ──probe answered──▶ CLOSED
                         └──probe unanswered: wait backoff (×2, capped), probe again
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ucm.api import StoreUnavailable

log = logging.getLogger("ucm.client")


class BreakerState(enum.Enum):
    CLOSED = "closed"  # the store answers: calls go through
    OPEN = "open"  # the store did not answer: calls are skipped until a probe succeeds


class CircuitOpen(StoreUnavailable):
    """A call skipped because the breaker is open (no time was spent on it)."""


@dataclass(frozen=True)
class BreakerConfig:
    probe_initial_s: float = 0.25  # first probe this long after the trip
    probe_max_s: float = 4.0  # backoff cap between probes
    probe_timeout_s: float = 1.0  # how long one probe waits for the answer

    def __post_init__(self) -> None:
        if not 0 < self.probe_initial_s <= self.probe_max_s:
            raise ValueError(f"need 0 < probe_initial_s <= probe_max_s, got {self.probe_initial_s}, {self.probe_max_s}")
        if self.probe_timeout_s <= 0:
            raise ValueError(f"probe_timeout_s must be positive, got {self.probe_timeout_s}")


@dataclass
class BreakerStats:
    """Counters for heartbeats and tests: `timeouts` is what callers paid, `skipped` what the breaker saved."""

    reachable: int = 1  # 1 while CLOSED
    trips: int = 0  # CLOSED -> OPEN
    timeouts: int = 0  # calls that waited out their whole timeout (probes not included)
    skipped: int = 0  # calls refused at once, or cut short, while OPEN
    probes: int = 0
    probe_failures: int = 0


class CircuitBreaker:
    def __init__(
        self,
        probe: Callable[[float], None],
        config: BreakerConfig | None = None,
        on_change: Callable[[BreakerStats], None] | None = None,
    ) -> None:
        """`probe(timeout_s)` returns once the store answered (any answer), raises otherwise. `on_change`
        gets a copy of the counters after every change (called under the breaker's lock: keep it trivial)."""
        self._probe = probe
        self.config = config or BreakerConfig()
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._stats = BreakerStats()
        self._halt = threading.Event()
        self._prober: threading.Thread | None = None

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def is_open(self) -> bool:
        return self.state is BreakerState.OPEN

    def stats(self) -> BreakerStats:
        with self._lock:
            return BreakerStats(**vars(self._stats))

    def check(self, what: str) -> None:
        """Raise CircuitOpen (counted) unless the store is believed reachable."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return
            self._stats.skipped += 1
            self._changed()
        raise CircuitOpen(f"{what} skipped: the store did not answer; probing it in the background")

    def cut_short(self) -> None:
        """A call in flight gave up because the breaker opened meanwhile."""
        with self._lock:
            self._stats.skipped += 1
            self._changed()

    def timed_out(self) -> None:
        """A call waited out its timeout: open (once) and start probing."""
        with self._lock:
            self._stats.timeouts += 1
            if self._state is BreakerState.OPEN or self._halt.is_set():
                self._changed()
                return
            self._state = BreakerState.OPEN
            self._stats.trips += 1
            self._stats.reachable = 0
            self._changed()
            self._prober = threading.Thread(target=self._probe_loop, name="ucm-store-probe", daemon=True)
            self._prober.start()
        log.warning("KV store unreachable: skipping it (lookups miss, saves dropped) until it answers a probe")

    def stop(self) -> None:
        self._halt.set()
        with self._lock:
            prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=self.config.probe_timeout_s + 1)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(BreakerStats(**vars(self._stats)))

    def _probe_loop(self) -> None:
        delay = self.config.probe_initial_s
        while not self._halt.wait(delay):
            try:
                self._probe(self.config.probe_timeout_s)
            except Exception as exc:
                if not isinstance(exc, StoreUnavailable):
                    log.warning("store probe failed: %s: %s", type(exc).__name__, exc)
                with self._lock:
                    self._stats.probes += 1
                    self._stats.probe_failures += 1
                    self._changed()
                delay = min(delay * 2, self.config.probe_max_s)
                continue
            with self._lock:
                self._stats.probes += 1
                self._state = BreakerState.CLOSED
                self._stats.reachable = 1
                self._prober = None
                self._changed()
            log.warning("KV store answers again: using it")
            return
