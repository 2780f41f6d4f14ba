"""`LogLimiter`: at most `burst` log lines per `interval_s`, then one line saying how many were suppressed.

A peer sending garbage in a loop must not turn the daemon's log into the bottleneck (or fill the disk).
"""

from __future__ import annotations

import logging
import threading
import time


class LogLimiter:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, burst: int = 5) -> None:
        if interval_s <= 0 or burst <= 0:
            raise ValueError("interval_s and burst must be positive")
        self._log = logger
        self._interval = interval_s
        self._burst = burst
        self._lock = threading.Lock()
        self._window_start = -float("inf")
        self._count = 0
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self._interval:
                suppressed, self._suppressed = self._suppressed, 0
                self._window_start, self._count = now, 0
                if suppressed:
                    self._log.warning("%d similar messages suppressed in the last %.0f s", suppressed, self._interval)
            if self._count >= self._burst:
                self._suppressed += 1
                return
            self._count += 1
        self._log.warning(msg, *args)
