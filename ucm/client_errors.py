"""How `StoreClient` reports the store's answers and absences: the error reply as an exception, and the rate of
its warnings (a skipped call while the circuit breaker is open is the breaker working, not news)."""

from __future__ import annotations

import logging

from ucm import store_wire as p
from ucm.api import StoreUnavailable
from ucm.circuit_breaker import CircuitOpen

log = logging.getLogger("ucm.client")


class StoreRequestError(RuntimeError):
    """The daemon answered with an error reply."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


def task_failed(exc: Exception) -> str:
    """A store task's error for an exception its work raised; logged (quietly while the breaker is open)."""
    if isinstance(exc, (StoreUnavailable, StoreRequestError)):
        log_unavailable("store task failed: %s", exc)
        return str(exc)
    log.error("store task failed", exc_info=exc)
    return f"{type(exc).__name__}: {exc}"


def log_unavailable(msg: str, exc: Exception) -> None:
    # A skipped call is the breaker working as meant: one warning at the trip, not one per call.
    (log.debug if isinstance(exc, CircuitOpen) else log.warning)(msg, exc)
