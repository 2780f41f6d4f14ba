"""What serving costs over the engine: the same requests through `ucm-serve up` and through `LLM.generate` in this
process (issue 10's target: served at most 10% slower).

Both sides get the same prompts (token ids, greedy, ignore_eos, so every request makes exactly `--output-len`
tokens), the same dtype, the same cores and the same scheduler limits; all requests are submitted at once, so
the figure is the whole batch's wall time, and the mean time to each request's first token beside it (in process
from `RequestOutput.metrics`, which the engine fills as vLLM's does).
`--workload prefix-rep` sends vs_vllm's prefix_repetition shape instead of random prompts (4 prompt prefixes of
1024 tokens, 128 own tokens each), where the mean TTFT is the figure vLLM is compared on. The served side's greedy
texts are compared with the offline ones too.
The server and the offline engine are each started once; their runs alternate `--rounds` times and the median
round's ratio is the figure, since these hosts' speed drifts by ~20% within minutes (one pair of runs moved
between 1.08 and 1.23 on a Zen 5 EPYC).

    .venv/bin/python -m benchmarks.served_overhead --json bench_out/served_overhead.json
    .venv/bin/python -m benchmarks.served_overhead --topology disagg     # 1 prefill + 1 decode node
    .venv/bin/python -m benchmarks.served_overhead --workload prefix-rep
    .venv/bin/python -m benchmarks.served_overhead --model llama-1b      # a yardstick model (yardstick_models.py)
    .venv/bin/python -m benchmarks.served_overhead --model llama-1b --as-avx2   # both sides as an AVX2-only host
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_server import Server
from benchmarks.serve import Req, run_workload, summarize
from benchmarks.session_cpu import client_cpu_s, cpu_line, cpu_used, session_cpu
from benchmarks.vs_vllm import AVX2_CAPS, EMBEDDED, MODELS, cpu_description, model_folder, ucm_model
from benchmarks.vs_vllm_workloads import prefix_rep_reqs, random_reqs


@dataclass
class OfflineRound:
    wall_s: float
    texts: list[str]
    cpu_s: float  # this process's, every thread's
    ttft_mean_s: float


class Offline:
    """The engine `LLM.generate` drives, in this process, built once and warmed up, so that every round times the
    same engine."""

    def __init__(self, warm_up: list[Req], args: argparse.Namespace, model: str) -> None:
        import torch

        from engine import LLM, SamplingParams

        torch.set_num_threads(os.cpu_count() or 1)
        self.llm = LLM(
            model=model,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
        )
        self.params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        self.round(warm_up)

    def round(self, reqs: list[Req]) -> OfflineRound:
        """Every request at once through `LLM.generate`; each one's first token timed by the engine
        (`RequestOutput.metrics`, as vLLM's)."""
        prompts: list[list[int]] = []
        for r in reqs:
            assert isinstance(r.prompt, list), "token-id prompts: the served side sends the same ids"
            assert r.max_tokens == self.params.max_tokens, "every request makes --output-len tokens"
            prompts.append(r.prompt)
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttfts = [o.metrics.first_token_latency for o in outs if o.metrics is not None and o.metrics.first_token_ts]
        assert len(ttfts) == len(outs), "every request made a token"
        return OfflineRound(wall, [o.outputs[0].text for o in outs], time.process_time() - cpu0, statistics.mean(ttfts))

    def close(self) -> None:
        self.llm.close()


class Served:
    """`ucm-serve up` with the same limits, started once and warmed up; each round sends every request at once."""

    def __init__(self, warm_up: list[Req], args: argparse.Namespace, out_dir: Path, model: str) -> None:
        argv = [
            sys.executable,
            "-m",
            "launch.cli",
            "up",
            "--model",
            model,
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
        self.model = model
        self.srv = Server("ucm-up", argv, model)
        self.url = f"http://127.0.0.1:{args.port}"
        self.srv.start(self.url, out_dir, 600)
        self.round(warm_up)

    def round(self, reqs: list[Req]) -> tuple[float, list[str], dict]:
        assert self.srv.proc is not None, "the server was started"
        server_before, client_before = session_cpu(self.srv.proc.pid), client_cpu_s(external=False)
        results, wall = asyncio.run(run_workload(self.url, reqs, len(reqs), float("inf"), 0, self.model))
        # Where the host's cores went: each server process, and this process (the client).
        cpu_s = {
            "server": cpu_used(server_before, session_cpu(self.srv.proc.pid)),
            "client": client_cpu_s(external=False) - client_before,
        }
        return wall, [r.text for r in results], {**summarize(results, wall), "cpu_s": cpu_s}

    def close(self) -> None:
        self.srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["random", "prefix-rep"], default="random")
    ap.add_argument("--model", choices=MODELS, default=EMBEDDED, help="the embedded model, or a yardstick model")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512, help="random: prompt tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--topology", default="auto", choices=["auto", "disagg", "colocated"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="2GiB")  # `ucm-serve up`'s default
    ap.add_argument("--max-num-seqs", type=int, default=64)  # the node's default
    ap.add_argument("--up-args", default="", help="more `ucm-serve up` flags, e.g. '--no-store'")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="served and in-process runs, alternated (the host's speed drifts between minutes; the median "
        "round's ratio is the figure)",
    )
    ap.add_argument("--as-avx2", action="store_true", help="both sides as an AVX2-only host runs them (vs_vllm's caps)")
    ap.add_argument("--port", type=int, default=8023)
    ap.add_argument("--out-dir", default="bench_out/served_overhead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.as_avx2 and any(os.environ.get(k) != v for k, v in AVX2_CAPS.items()):
        # torch reads its ISA when it loads: the in-process side needs the caps from this process's start on.
        again = list(argv) if argv is not None else sys.argv[1:]
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.served_overhead", *again],
                  {**os.environ, **AVX2_CAPS})  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(0)

    def prompts(n: int) -> list[Req]:
        """n new prompts: each round's miss every prefix cache, as the first round's do."""
        seed = rng.randrange(2**31)
        if args.workload == "prefix-rep":
            return prefix_rep_reqs(seed, n, out_len=args.output_len)
        return random_reqs(seed, n, args.input_len, args.output_len)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_description(args.as_avx2)
    print(f"CPU: {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['isa'])})")
    shape = "4 x 1024-token prefixes + 128" if args.workload == "prefix-rep" else f"{args.input_len}"
    print(f"{args.model}: {args.num_prompts} x {shape} in / {args.output_len} out, all at once, dtype {args.dtype}")
    n_out = args.num_prompts * args.output_len
    rounds: list[dict] = []
    warm_up = prompts(2)
    model = ucm_model(args, model_folder(args))  # both sides' (a yardstick model is written once, here)
    served, offline = Served(warm_up, args, out_dir, model), None
    try:
        offline = Offline(warm_up, args, model)
        print(
            f"{'round':<7}{'served s':>10}{'in process s':>14}{'served / offline':>18}"
            f"{'TTFT ms served / in process':>30}{'in-process CPU s':>18}  CPU s while served"
        )
        for i in range(args.rounds):
            # Served first in each pair, then in process: the host's drift falls on both sides of a pair alike.
            reqs = prompts(args.num_prompts)
            served_wall, served_texts, summary = served.round(reqs)
            off = offline.round(reqs)
            # Results arrive in completion order on the served side: compare as multisets.
            same = sorted(served_texts) == sorted(off.texts)
            ratio = served_wall / off.wall_s
            served_ttft = summary["ttft_ms"]["mean"]
            ttft_ratio = served_ttft / (off.ttft_mean_s * 1e3)
            rounds.append(
                {
                    "served_wall_s": served_wall,
                    "offline_wall_s": off.wall_s,
                    "offline_cpu_s": off.cpu_s,
                    "offline_ttft_mean_ms": off.ttft_mean_s * 1e3,
                    "ratio": ratio,
                    "ttft_ratio": ttft_ratio,
                    "identical": same,
                    "served_summary": summary,
                }
            )
            ttfts = f"{served_ttft:.0f} / {off.ttft_mean_s * 1e3:.0f} = {ttft_ratio:.3f}"
            print(
                f"{i + 1:<7}{served_wall:>10.2f}{off.wall_s:>14.2f}{ratio:>18.3f}{ttfts:>30}{off.cpu_s:>18.1f}  "
                f"{cpu_line(**summary['cpu_s'])}"
                f"{'' if same else '  (greedy texts differ)'}",
                flush=True,
            )
    finally:
        served.close()
        if offline is not None:
            offline.close()
    median = statistics.median(r["ratio"] for r in rounds)
    ttft_median = statistics.median(r["ttft_ratio"] for r in rounds)
    completed = min(r["served_summary"]["completed"] for r in rounds)
    identical = all(r["identical"] for r in rounds)
    walls = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]
    print(
        f"served / offline = {median:.3f} (median of {len(rounds)} rounds; target <= 1.10); "
        f"{n_out / walls['served_wall_s']:.1f} vs {n_out / walls['offline_wall_s']:.1f} out tok/s in that round; "
        f"{completed}/{args.num_prompts} completed in every round; greedy texts identical: {identical}"
    )
    print(f"mean TTFT served / in process = {ttft_median:.3f} (median of {len(rounds)} rounds)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpu": cpu,
                    "args": vars(args),
                    "ratio": median,
                    "ttft_ratio": ttft_median,
                    "identical": identical,
                    "rounds": rounds,
                },
                indent=2,
            )
        )
    return 0 if completed == args.num_prompts and identical else 1


if __name__ == "__main__":
    sys.exit(main())
