"""Helpers for tests that drive a running cluster: Prometheus counters from /metrics, waiting on a condition."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from benchmarks.prom_text import metric  # the one Prometheus-text reader; re-exported for the tests


def health_nodes(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=5).json().get("nodes", {})
    except (httpx.HTTPError, ValueError):
        return {}


def wait_until(what: str, condition: Callable[[], bool], timeout: float = 120.0, poll_s: float = 0.2) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` (a generous bound, not a
    timing assertion: only a condition that never comes true hits it)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


__all__ = ["health_nodes", "metric", "wait_until"]
