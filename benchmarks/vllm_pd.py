"""Prefill/decode disaggregation with vLLM through the UCM store, against one vLLM instance, on this host: TTFT and
throughput under `vllm bench serve` (vLLM's own client), same model, same dtype, one setup at a time.

    single   `vllm serve` alone (prefix caching on, no KV connector), every core
    pd       what `ucm-serve up --engine vllm` starts: store daemon, a vLLM prefill instance (UCMConnector
             kv_producer), a vLLM decode instance (kv_consumer), the router in front; the cores split between them

Workloads (benchmarks/vs_vllm_workloads.py's client arguments): `random` (512 in / 64 out, 32 prompts, 8 at a time)
and `prefix-rep` (4 prefixes x 1024 + 128, 64 out, 32 prompts at once).

    .venv/bin/python -m benchmarks.vllm_pd --json bench_out/vllm_pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vllm_harness import DEFAULT_VENV, VllmServer
from benchmarks.vs_vllm_workloads import vllm_bench_serve
from engine.model_source import resolve_model_dir
from launch.cluster import ClusterSpec
from launch.vllm_cluster import VllmCluster
from protocol import defaults

WORKLOADS = ("random", "prefix-rep")
SETUPS = ("single", "pd")


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
        results[setup] = run_single(model_dir, args.dtype, out_dir, args.seed) if setup == "single" else None
        if setup == "pd":
            results[setup] = run_pd(args.dtype, out_dir, args.seed)
    print(f"\nlogs in {out_dir}\n")
    print("| setup | workload | completed | output tok/s | mean TTFT ms | p99 TTFT ms | mean TPOT ms |")
    print("|---|---|---|---|---|---|---|")
    for setup in args.setups:
        for workload in WORKLOADS:
            r = results[setup][workload]
            if "error" in r:
                print(f"| {setup} | {workload} | error: {r['error'][-120:]!r} |")
                continue
            print(
                f"| {setup} | {workload} | {r['completed']} | {r['output_tok_per_s']} | {r['ttft_mean_ms']} | "
                f"{r['ttft_p99_ms']} | {r['tpot_mean_ms']} |"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
