"""Stopping a server the benchmarks started in its own session: the whole process group, politely first."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen | None, grace_s: float = 60.0) -> None:
    """SIGTERM to `proc`'s process group (it was started with start_new_session=True), SIGKILL after grace_s."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
