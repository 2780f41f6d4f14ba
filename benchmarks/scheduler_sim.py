"""The real Scheduler on vLLM-bench-shaped workloads with a step-cost model instead of a model, so admission
policies and chunk budgets can be compared without CPU noise (FCFS is the baseline in the same run).

Step time = `--step-floor-s` (one pass over the weights: a decode step) + tokens / `--prefill-tok-s`; the
defaults are this project's 2-core AVX2 host in fp32 (docs/benchmarks.md). Workloads:

    prefix-rep   4 prefixes x 1024 + 128 suffix, 64 out, 32 at once      (vllm bench serve prefix_repetition)
    random       512 in / 64 out, 32 prompts at concurrency 8             (vllm bench serve random)

    .venv/bin/python -m benchmarks.scheduler_sim --json bench_out/scheduler_sim.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.keys import KeyNamespace, root_key
from engine.config import SchedulingPolicy
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelRunnerOutput

BLOCK = 16
ROOT = root_key(KeyNamespace("sim", "float32", BLOCK))


def simulate(
    policy: SchedulingPolicy,
    budget: int,
    prompts: list[list[int]],
    out_len: int,
    floor_s: float,
    tok_s: float,
    concurrency: int | None = None,
) -> dict[str, float]:
    now = [0.0]
    sched = Scheduler(
        KVCacheManager(40_000, BLOCK),
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        policy=policy,
        clock=lambda: now[0],
    )
    pending = list(enumerate(prompts))
    live: dict[str, Request] = {}
    start: dict[str, float] = {}
    ttft: dict[str, float] = {}

    def submit() -> None:
        while pending and (concurrency is None or len(live) < concurrency):
            i, prompt = pending.pop(0)
            req = Request(
                str(i),
                prompt,
                SamplingParams(max_tokens=out_len, ignore_eos=True),
                root_key=ROOT,
                block_size=BLOCK,
                arrival=i,
                seed=0,
            )
            sched.add_request(req)
            live[req.request_id], start[req.request_id] = req, now[0]

    submit()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        now[0] += floor_s + sum(s.num_scheduled_tokens for s in out.scheduled) / tok_s
        result = ModelRunnerOutput()
        for s in out.scheduled:
            if s.num_samples:
                result.sampled[s.request_id] = [7] * s.num_samples
        sched.update_from_output(out, result)
        for s in out.scheduled:
            req = live.get(s.request_id)
            if req is not None and s.request_id not in ttft and req.num_output_tokens:
                ttft[s.request_id] = now[0] - start[s.request_id]
            if req is not None and req.is_finished:
                del live[s.request_id]
        submit()
    return {
        "mean_ttft_s": sum(ttft.values()) / len(prompts),
        "out_tok_s": len(prompts) * out_len / now[0],
        "computed_tokens": sched.stats.computed_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--step-floor-s", type=float, default=0.035)
    ap.add_argument("--prefill-tok-s", type=float, default=420.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = random.Random(1)
    heads = [[rng.randrange(1000, 40000) for _ in range(1024)] for _ in range(4)]
    rep = [heads[rng.randrange(4)] + [rng.randrange(1000, 40000) for _ in range(128)] for _ in range(32)]
    rnd = [[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(32)]
    rows = []
    print(
        f"{'budget':>6} {'policy':<12} {'prefix-rep TTFT s':>18} {'computed':>9} {'random@8 TTFT s':>16} {'tok/s':>7}"
    )
    for budget in args.budgets:
        for policy in SchedulingPolicy:
            a = simulate(policy, budget, rep, 64, args.step_floor_s, args.prefill_tok_s)
            b = simulate(policy, budget, rnd, 64, args.step_floor_s, args.prefill_tok_s, concurrency=8)
            rows.append({"budget": budget, "policy": policy.value, "prefix_rep": a, "random_c8": b})
            print(
                f"{budget:>6} {policy.value:<12} {a['mean_ttft_s']:>18.1f} {a['computed_tokens']:>9} "
                f"{b['mean_ttft_s']:>16.1f} {b['out_tok_s']:>7.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
