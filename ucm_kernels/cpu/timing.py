"""How the CPU calibrations time a choice: best-of calls, the alternatives taking turns so that load which comes and
goes slows all of them rather than the one measured at the time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

ROUNDS = 2  # independent rounds per choice; a winner they disagree on is stored as provisional (calibration_store)
REPS = 3  # timed calls of each path per round, the paths alternating so a burst of other load hits all of them


def best_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """Fastest of `reps` calls after a warm-up (first-touch of the output, torch's lazy initialisation), in ms."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def alternating_best_ms(runs: Sequence[Callable[[], object]], reps: int, seconds: float = float("inf")) -> list[float]:
    """The fastest milliseconds of each of `runs` over `reps` passes that call them in turn, so load that comes
    and goes slows all of them rather than the one measured at the time; stops early after `seconds`. The
    caller warms them up."""
    best, t_end = [float("inf")] * len(runs), time.perf_counter() + seconds
    for _ in range(reps):
        for i, fn in enumerate(runs):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1000)
        if time.perf_counter() > t_end:
            break
    return best


def two_way_rounds(runs: Sequence[Callable[[], object]], reps: int) -> list[tuple[float, float]]:
    """The two `runs` (a kernel and what it stands in for) warmed up, then ROUNDS rounds of `alternating_best_ms`:
    (first's ms, second's ms) per round, what `measured_win` decides on."""
    assert len(runs) == 2, "a two-way choice"
    for fn in runs:
        fn()
    rounds = []
    for _ in range(ROUNDS):
        first, second = alternating_best_ms(runs, reps)
        rounds.append((first, second))
    return rounds
