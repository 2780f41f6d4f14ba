"""What serving costs over the engine: the same requests through `ucm-serve up` and through `LLM.generate` in
this process (issue 10's target: served at most 10% slower).

Both sides get the same prompts (token ids, greedy, ignore_eos, so every request makes exactly `--output-len`
tokens), the same dtype, the same cores and the same scheduler limits; all requests are submitted at once, so
the figure is the whole batch's wall time. The served side's greedy texts are compared with the offline ones too.

    .venv/bin/python -m benchmarks.served_overhead --json bench_out/served_overhead.json
    .venv/bin/python -m benchmarks.served_overhead --topology disagg     # 1 prefill + 1 decode node
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serve import Req, run_workload, summarize
from benchmarks.session_cpu import client_cpu_s, cpu_line, cpu_used, session_cpu
from benchmarks.vs_vllm import Server, cpu_description

TOKEN_LO, TOKEN_HI = 1000, 40000


def offline(reqs: list[Req], args: argparse.Namespace) -> tuple[float, list[str]]:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    llm = LLM(
        model="smollm2-135m", dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": r.prompt} for r in reqs[:2]], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt} for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.close()
    return wall, [o.outputs[0].text for o in outs]


def served(reqs: list[Req], args: argparse.Namespace, out_dir: Path) -> tuple[float, list[str], dict]:
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        "up",
        "--port",
        str(args.port),
        "--topology",
        args.topology,
        "--dtype",
        args.dtype,
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-num-seqs",
        str(args.max_num_seqs),
        *args.up_args.split(),
    ]
    srv = Server("ucm-up", argv, "smollm2-135m")
    url = f"http://127.0.0.1:{args.port}"
    srv.start(url, out_dir, 600)
    try:
        asyncio.run(run_workload(url, reqs[:2], 2, float("inf"), 0))  # warm-up, as offline
        assert srv.proc is not None, "the server was started"
        server_before, client_before = session_cpu(srv.proc.pid), client_cpu_s(external=False)
        results, wall = asyncio.run(run_workload(url, reqs, len(reqs), float("inf"), 0))
        # Where the host's cores went: each server process, and this process (the client).
        cpu_s = {
            "server": cpu_used(server_before, session_cpu(srv.proc.pid)),
            "client": client_cpu_s(external=False) - client_before,
        }
    finally:
        srv.stop()
    return wall, [r.text for r in results], {**summarize(results, wall), "cpu_s": cpu_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--topology", default="auto", choices=["auto", "disagg", "colocated"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="2GiB")  # `ucm-serve up`'s default
    ap.add_argument("--max-num-seqs", type=int, default=64)  # the node's default
    ap.add_argument("--up-args", default="", help="more `ucm-serve up` flags, e.g. '--no-store'")
    ap.add_argument("--skip-offline", action="store_true", help="served side only (offline figure from --json)")
    ap.add_argument("--port", type=int, default=8023)
    ap.add_argument("--out-dir", default="bench_out/served_overhead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(0)
    reqs = [
        Req([rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(args.input_len)], args.output_len)
        for _ in range(args.num_prompts)
    ]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Served first: the offline engine's threads would otherwise still hold the cores' caches warm for it.
    served_wall, served_texts, summary = served(reqs, args, out_dir)
    if args.skip_offline and args.json and Path(args.json).exists():
        earlier = json.loads(Path(args.json).read_text())
        offline_wall, offline_texts = earlier["offline_wall_s"], None
    else:
        offline_wall, offline_texts = offline(reqs, args)
    # Results arrive in completion order on the served side: compare as multisets (not compared when skipped).
    same = None if offline_texts is None else sorted(served_texts) == sorted(offline_texts)
    cpu = cpu_description()
    ratio = served_wall / offline_wall
    print(f"CPU: {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['isa'])})")
    print(f"{args.num_prompts} x {args.input_len} in / {args.output_len} out, all at once, dtype {args.dtype}")
    print(f"{'path':<34}{'wall s':>8}{'out tok/s':>11}")
    n_out = args.num_prompts * args.output_len
    print(f"{'LLM.generate (in process)':<34}{offline_wall:>8.2f}{n_out / offline_wall:>11.1f}")
    print(f"{'ucm-serve up --topology ' + args.topology:<34}{served_wall:>8.2f}{n_out / served_wall:>11.1f}")
    print(f"CPU s while served: {cpu_line(**summary['cpu_s'])}")
    print(
        f"served / offline = {ratio:.3f} (target <= 1.10); {summary['completed']}/{args.num_prompts} completed; "
        f"greedy texts identical: {same}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpu": cpu,
                    "args": vars(args),
                    "offline_wall_s": offline_wall,
                    "served_wall_s": served_wall,
                    "ratio": ratio,
                    "identical": same,
                    "served_summary": summary,
                },
                indent=2,
            )
        )
    return 0 if summary["completed"] == args.num_prompts else 1


if __name__ == "__main__":
    sys.exit(main())
