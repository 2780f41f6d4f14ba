"""`ucm-serve store` as a child process on a free port, for tests and benchmarks: the one way they start a daemon.

It runs the store's own entry point (ucm/daemon_cli.py) rather than `launch.cli`, so what it starts depends on the
store package alone, and reads the daemon's address from its ready line (`ucm-store ready ADDRESS`). `up` and the
Ray actors supervise their store as one of the cluster's children instead (launch/cluster.py).
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm.api import StoreStats

READY_PREFIX = "ucm-store ready "
ENTRY = "import sys; from ucm.daemon_cli import main; sys.exit(main(sys.argv[1:]))"
SECURITY_FLAGS = {"--curve-keys", "--server-key", "--insecure"}


class StoreProcess:
    """A daemon bound to tcp://127.0.0.1:0, DRAM `dram`, with an LMDB tier when `disk_path` is given; without
    CURVE options among `extra` it runs --insecure. `address` is where it listens; `stop()` (or leaving the `with`)
    sends SIGTERM, which flushes the write-behind queue into LMDB, and waits."""

    def __init__(
        self,
        dram: str = "64MiB",
        disk_path: Path | None = None,
        disk: str = "64MiB",
        extra: tuple[str, ...] = (),
        ready_timeout_s: float = 30.0,
    ) -> None:
        cmd = [sys.executable, "-c", ENTRY, "--bind", "tcp://127.0.0.1:0", "--dram", dram, "--log-level", "WARNING"]
        if disk_path is not None:
            cmd += ["--disk-path", str(disk_path), "--disk", disk]
        if not SECURITY_FLAGS & set(extra):
            cmd.append("--insecure")
        self.proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, text=True)
        try:
            self.address = self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None, "started with stdout=PIPE"
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.2)[0]:
                line = self.proc.stdout.readline()
                if line.startswith(READY_PREFIX):
                    return line.split()[-1]
                if not line and self.proc.poll() is not None:
                    break
        raise RuntimeError(f"the store daemon did not print its ready line (exit code {self.proc.poll()})")

    def stats(self) -> StoreStats:
        """The daemon's StoreStats, through an insecure client."""
        from ucm.client import StoreClient

        with StoreClient(self.address, timeout_s=5.0) as client:
            return client.stats()

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM, then its exit code; killed if it does not exit within `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
