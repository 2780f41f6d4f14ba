"""How many OpenMP threads a CPU engine's next step runs with: as many as there are cores nobody else is using.

Every kernel of a step is an OpenMP parallel region whose end waits for all its threads. When another process keeps
one of the cores busy, the engine's thread on that core runs only in the time slices the scheduler gives it (a few
milliseconds in turn with the neighbour), and each of a step's hundreds of regions waits for that thread's next slice:
measured on a 2-core Xeon (AMX), a wave of 4 chats went from 1.7 s to 60 s beside one busy Python loop, while one
thread on the free core would have run it at about half speed. So before each step the engine asks this governor,
which reads how much CPU time everything else on the engine's cores took over the last window (/proc/stat's busy time
on those cores less this process's own CPU time), and gives the step as many threads as whole cores are left, with
hysteresis so a short burst of the router or the store does not flap the count. Where /proc/stat cannot be read
(not Linux) the count stays what it was.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from ucm_kernels.cpu.host import CpuClock, busy_cpu_s

logger = logging.getLogger(__name__)

WINDOW_S = 0.25  # the shortest window a decision reads: several of the scheduler's slices, a few decode steps
# Hysteresis in cores: drop a thread once the free cores fall DROP_BELOW under the threads running, take it back
# once they rise RAISE_ABOVE over (a 2-core host: a busy neighbour leaves 1.0-1.3 free cores, 2 threads drop; the
# router's and the store's bursts leave 1.6-1.9, 2 threads stay; 1 thread goes back to 2 only above 1.7).
DROP_BELOW, RAISE_ABOVE = 0.4, 0.7
# A burst's first decision (`burst`): a window this short, from the burst's start, that may only give threads back.
# A window reaching back into the idle stretch held the sender's work up to the burst (vLLM's benchmark client on the
# same 2 cores, starting a run of 8 requests): the burst's first step ran 3-5 of Llama-1B's 16 layers on one thread
# (512 tokens: 0.91-0.97 s against 0.72 for such steps later); from the burst on, one layer (0.65-0.71 s; 2-core Xeon
# with AMX). A drop still waits for a whole window: the router's own work on the burst may fall into its first moments.
BURST_WINDOW_S = 0.1


def engine_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity), else all of them."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


class ThreadGovernor:
    """Before each step `threads()` says how many threads it runs with: between 1 and `max_threads`."""

    def __init__(
        self,
        max_threads: int,
        cpus: frozenset[int] | None = None,
        read_busy: Callable[[frozenset[int]], float | None] = busy_cpu_s,
        clock: Callable[[], float] = time.monotonic,
        own_cpu: Callable[[], float] = time.process_time,
    ) -> None:
        assert max_threads >= 1, f"max_threads {max_threads}"
        self.max_threads = max_threads
        self.cpus = cpus if cpus is not None else engine_cpus()
        self._read_busy, self._clock, self._own_cpu = read_busy, clock, own_cpu
        self.current = max_threads
        self.others_cores = 0.0  # what the last window measured everything else taking, in cores
        self.changes = 0
        self._last = self._sample()
        self._burst = False  # the next decision is a burst's first (`burst`)

    def restart(self) -> None:
        """Start a new window now (after a stretch the engine's own use should not be judged by, e.g. its warm-up)."""
        self._last = self._sample()
        self._burst = False

    def reset(self) -> None:
        """Back to all max_threads, judged from a new window starting now: as a freshly started engine (a benchmark's
        runs, each compared with the others, start from the same state)."""
        self.current = self.max_threads
        self.restart()

    def burst(self) -> None:
        """Work arrives after the engine idled: the next decision judges only the time from now, after BURST_WINDOW_S,
        and only gives threads back (the window's constant's note)."""
        self._last = self._sample()
        self._burst = True

    def _sample(self) -> CpuClock | None:
        busy = self._read_busy(self.cpus)
        return None if busy is None else CpuClock(self._clock(), self._own_cpu(), busy)

    def threads(self) -> int:
        """The thread count for the next step, re-decided once at least WINDOW_S has passed since the last decision."""
        if self._last is None or self.max_threads == 1:
            return self.current
        burst = self._burst
        if self._clock() - self._last.wall_s < (BURST_WINDOW_S if burst else WINDOW_S):
            return self.current
        now = self._sample()
        if now is None:
            return self.current
        last, self._last, self._burst = self._last, now, False
        wall = now.wall_s - last.wall_s
        others = now.others_cores_since(last, min_judged_s=0.0)
        assert others is not None, "both samples read the busy time"
        self.others_cores = others
        free = len(self.cpus) - others
        if self.current > 1 and free < self.current - DROP_BELOW and not burst:
            chosen = max(1, int(free + 1 - DROP_BELOW))
        elif self.current < self.max_threads and free > self.current + RAISE_ABOVE:
            chosen = min(self.max_threads, int(free + 1 - RAISE_ABOVE))
        else:
            return self.current
        if chosen != self.current:
            logger.info(
                "engine threads %d -> %d: other processes took %.2f of this engine's %d cores over the last %.2f s",
                self.current, chosen, others, len(self.cpus), wall,
            )  # fmt: skip
            self.current = chosen
            self.changes += 1
        return self.current
