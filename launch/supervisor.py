"""Restarts the children of a `Cluster` that exit: a monitor thread with exponential backoff per child.

A child that dies is started again with the same command line, so on the same address (the cluster picks fixed
ports once): nodes reconnect to a restarted store or router by themselves, and a restarted node registers as a
new incarnation (the router fails its old requests over). A child that keeps dying soon after it starts is given
up on after `max_fast_failures` attempts in a row, loudly; one that ran for `healthy_after_s` starts afresh.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from launch.child import Child


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 5.0
    healthy_after_s: float = 20.0  # a child that ran this long before it died did not fail "fast"
    max_fast_failures: int = 5  # in a row; then the child is left dead
    poll_s: float = 0.2  # how often the monitor looks at the children

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 < first_delay_s <= max_delay_s, got {self.first_delay_s}, {self.max_delay_s}")
        if self.max_fast_failures < 1 or self.healthy_after_s <= 0 or self.poll_s <= 0:
            raise ValueError("max_fast_failures >= 1, healthy_after_s > 0 and poll_s > 0 are required")

    def delay_s(self, fast_failures: int) -> float:
        """Seconds to wait before restart number `fast_failures` (1, 2, ...) of a run of fast failures."""
        assert fast_failures >= 1, f"fast_failures={fast_failures}"
        return min(self.max_delay_s, self.first_delay_s * 2 ** (fast_failures - 1))


@dataclass
class _Backoff:
    fast_failures: int = 0
    due: float | None = None  # when the pending restart may run
    given_up: bool = False


class Supervisor(threading.Thread):
    """Watches `children()` (name -> Child) and calls `restart(name, dead_child)` when one has exited."""

    def __init__(
        self,
        children: Callable[[], dict[str, Child]],
        restart: Callable[[str, Child], None],
        policy: RestartPolicy,
        log: Callable[[str], None],
    ) -> None:
        super().__init__(name="ucm-supervisor", daemon=True)
        self._children = children
        self._restart = restart
        self._policy = policy
        self._log = log
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._state: dict[str, _Backoff] = {}
        self.restarts: dict[str, int] = {}  # name -> restarts done (tests and logs)

    def halt(self) -> None:
        """No more restarts from now on; safe in a signal handler (does not wait for the thread)."""
        self._halt.set()

    def stop(self) -> None:
        self.halt()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    def given_up(self) -> set[str]:
        with self._lock:
            return {name for name, state in self._state.items() if state.given_up}

    def run(self) -> None:
        while not self._halt.wait(self._policy.poll_s):
            for name, child in self._children().items():
                if self._halt.is_set():
                    return
                self._check(name, child, time.monotonic())

    def _check(self, name: str, child: Child, now: float) -> None:
        with self._lock:
            state = self._state.setdefault(name, _Backoff())
            if child.alive or state.given_up:
                return
            if state.due is None:
                ran = now - child.started_at
                state.fast_failures = 1 if ran >= self._policy.healthy_after_s else state.fast_failures + 1
                if state.fast_failures > self._policy.max_fast_failures:
                    state.given_up = True
                    self._log(
                        f"[up] !!! {name} exited ({child.proc.returncode}) {state.fast_failures - 1} times in a "
                        f"row, each within {self._policy.healthy_after_s:.0f}s of starting: NOT restarting it "
                        f"again. Last output:\n{child.output()[-2000:]}"
                    )
                    return
                delay = self._policy.delay_s(state.fast_failures)
                state.due = now + delay
                self._log(
                    f"[up] {name} exited ({child.proc.returncode}) after {ran:.1f}s; restarting in "
                    f"{delay:.1f}s (attempt {state.fast_failures}/{self._policy.max_fast_failures})"
                )
                return
            if now < state.due or self._halt.is_set():
                return
            state.due = None
            self.restarts[name] = self.restarts.get(name, 0) + 1
        try:
            self._restart(name, child)
        except Exception as e:
            self._log(f"[up] restarting {name} failed: {e}")
            return
        self._log(f"[up] {name} restarted")
