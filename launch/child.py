"""One child process of `ucm-serve up` (and of the tests and benchmark clusters): output prefixed with its
name, a way to wait for a line it prints, and a clean stop. Linux children also get SIGTERM if we die."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import TextIO

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A launcher killed with SIGKILL cannot clean up; the kernel then signals its children for it.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _prepare_child(nice: int) -> None:
    # Before exec, so every thread of the child inherits the niceness (renice on a pid reaches one thread only).
    if nice:
        os.nice(nice)
    if sys.platform.startswith("linux"):
        _die_with_parent()


class Child:
    def __init__(
        self,
        name: str,
        argv: list[str],
        sink: TextIO | None = None,
        env: dict[str, str] | None = None,
        nice: int = 0,
        group: bool = False,
    ):
        """`group`: the child leads a process group of its own and stop/kill signal the whole group: for programs
        that start workers of their own which outlive them (vLLM's EngineCore keeps running, holding its KV cache,
        when its API server is killed)."""
        self.name = name
        self.group = group
        self.argv = argv
        self.nice = nice
        self.env = env  # the extra environment, kept so a restart gets the same
        self.started_at = time.monotonic()
        self._sink = sink if sink is not None else sys.stdout
        self._lines: deque[str] = deque(maxlen=2000)
        self._cond = threading.Condition()
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=child_env,
            preexec_fn=functools.partial(_prepare_child, nice),
            process_group=0 if group else None,
        )
        self._pump = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None, "stdout is piped"
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
            with contextlib.suppress(Exception):
                print(f"[{self.name}] {line}", file=self._sink, flush=True)
        with self._cond:
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching `pattern`; RuntimeError if the child exits or time runs out."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                lines = list(self._lines)
                for line in lines[seen:]:
                    if m := regex.search(line):
                        return m
                seen = len(lines)
                if not self.alive and not self._pump.is_alive():
                    tail = "\n".join(lines[-20:])
                    raise RuntimeError(
                        f"{self.name} exited ({self.proc.returncode}) before printing {pattern!r}:\n{tail}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name}: no line matching {pattern!r} within {timeout:.0f}s")
                self._cond.wait(min(left, 0.5))

    def respawn(self) -> Child:
        """A new process with the same command, environment and output sink (this one must have exited)."""
        assert not self.alive, f"{self.name} is still running"
        return Child(self.name, self.argv, sink=self._sink, env=self.env, nice=self.nice, group=self.group)

    def output(self) -> str:
        with self._cond:
            return "\n".join(self._lines)

    def _signal(self, sig: signal.Signals) -> None:
        if self.group:
            with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
                os.killpg(self.proc.pid, sig)
        elif self.alive:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (fault tests); to its whole group with `group`."""
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        if self.group:
            self._signal(signal.SIGKILL)  # workers the leader left behind
        self._pump.join(timeout=2)
