"""Whether a decode step's weight reads hide prompt work on this host (issue 49): a step of 8 decodes and P new prompt
tokens against a step of the 8 decodes alone, and the read bandwidth of one core against all of them.

    python -m benchmarks.mixed_steps [--model llama-1b] [--tokens 0 64 128 256 512 1024 2040] [--json F]

A decode step of a bf16 1B model reads every weight (2.2 GB) and computes little; a prompt step computes much per
weight it reads. Were the two to overlap, prompt tokens riding on decode steps would cost less than in prompt steps of
their own, and a scheduler should feed decode steps small prompt chunks (Sarathi-Serve's premise). Measured here:

    step           the engine (yardstick model, dtype auto, every core, prefix caching off) with 8 requests decoding
                   (512-token prompts), each step adding one fresh P-token prompt that samples one token (P = 0: the
                   decodes alone); the arms take turns step by step, their order reversed every round, so that a shared
                   host's phases (seconds to minutes here) fall on all of them; the median step per P
    per token      (step(P) - step(0)) / P: what a prompt token adds to a step; were reads and products to overlap, it
                   would be least at small P (the products hidden under the reads), well under a prompt step's own
    read           benchmarks.roofline's streaming read of a buffer 4x the last-level cache, on 1 thread and on all:
                   where one core reads at half of two, the bandwidth is the cores' outstanding misses, not the
                   memory's, and a core busy with tile products issues none: its reads and products take turns

The baseline in the same run: a prompt step's own rate, the least per-token cost of the P of PROMPT_STEP or more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks.roofline import read_bandwidth_gbs
from benchmarks.vllm_harness import synthetic_prompt
from benchmarks.yardstick_models import SHAPES, ensure_model
from engine import LLM, SamplingParams
from engine.config import resolve_dtype_name
from ucm_kernels.cpu.host import cpu_info, vector_flags
from ucm_kernels.cpu.peak_probe import peak

DECODES, DECODE_PROMPT = 8, 512
TOKENS = (0, 64, 128, 256, 512, 1024, 2040)  # 2040 + 8 decodes: the step budget of 2048
ROUNDS = 8
PROMPT_STEP = 512  # prompt tokens from which a step counts as a prompt step of its own (the baseline's)


@dataclass(frozen=True)
class MixedRow:
    """One P's steps: the median, what it adds to the decodes' step, per prompt token and against a prompt step's."""

    prompt_tokens: int
    step_ms: float
    added_ms: float
    per_token_ms: float
    of_prompt_step: float  # per_token_ms / a prompt step's (module doc: the baseline)


def mixed_rows(steps_ms: dict[int, list[float]]) -> list[MixedRow]:
    """Rows from each P's step times (P = 0 the decodes alone, and at least one P > 0)."""
    if 0 not in steps_ms or len(steps_ms) < 2 or any(not v for v in steps_ms.values()):
        raise ValueError("need the decodes' steps (P = 0) and at least one P > 0, each timed")
    base = statistics.median(steps_ms[0])
    added = {p: statistics.median(v) - base for p, v in steps_ms.items() if p > 0}
    per_token = {p: a / p for p, a in added.items()}
    prompt_step = min((c for p, c in per_token.items() if p >= PROMPT_STEP), default=per_token[max(per_token)])
    rows = [MixedRow(0, base, 0.0, 0.0, 0.0)]
    for p in sorted(added):
        rows.append(MixedRow(p, base + added[p], added[p], per_token[p], per_token[p] / prompt_step))
    return rows


def time_steps(model: str, tokens: list[int], rounds: int) -> dict[int, list[float]]:
    """Each P's step times (module doc: step), the arms taking turns step by step."""
    llm = LLM(
        model=str(ensure_model(model)),
        dtype="auto",
        kv_cache_memory="3GiB",
        max_num_seqs=DECODES + 1,
        max_num_batched_tokens=max(2048, max(tokens) + DECODES),
        enable_prefix_caching=False,
    )
    engine = llm.engine
    engine.governor = None  # every core: the read bandwidth below is measured on them
    try:
        decode = SamplingParams(max_tokens=(rounds + 1) * len(tokens) + 64, temperature=0, ignore_eos=True)
        for i in range(DECODES):
            engine.add_request(f"decode-{i}", synthetic_prompt(DECODE_PROMPT, i), decode)
        while True:  # until a step computes no prompt token: every request decodes (benchmarks.roofline's test)
            before = engine.stats().computed_tokens
            engine.step()
            if engine.stats().computed_tokens == before:
                break
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        steps: dict[int, list[float]] = {p: [] for p in tokens}
        seed = 1000
        for r in range(rounds + 1):  # the first round warms each shape up and is not counted
            for p in tokens if r % 2 == 0 else tokens[::-1]:
                if p:
                    seed += 1
                    engine.add_request(f"prompt-{seed}", synthetic_prompt(p, seed), one)
                before = engine.stats().computed_tokens
                t0 = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t0
                computed = engine.stats().computed_tokens - before
                assert computed == p, f"the step computed {computed} prompt tokens, not {p}: its budget split them"
                if r:
                    steps[p].append(seconds * 1000)
            if r:
                print(f"  round {r}: " + "  ".join(f"P={p} {steps[p][-1]:.0f} ms" for p in tokens), flush=True)
        return steps
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(SHAPES), default="llama-1b")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="prompt tokens a step adds (0 too)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    tokens = sorted(set(args.tokens) | {0})
    threads = os.cpu_count() or 1
    model_name, _ = cpu_info()
    host = f"{model_name} [{' '.join(vector_flags())}], {threads} cores"
    print(f"host: {host}", flush=True)
    reads = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        reads[n] = read_bandwidth_gbs(3)[0]
    torch.set_num_threads(threads)
    print("read: " + ", ".join(f"{n} thread(s) {gbs:.1f} GB/s" for n, gbs in reads.items()), flush=True)
    dtype = resolve_dtype_name("auto", "cpu")  # the engine's below
    peak_before = peak(dtype, threads)
    steps = time_steps(args.model, tokens, args.rounds)
    peak_after = peak(dtype, threads)
    rows = mixed_rows(steps)
    print(f"\n{args.model} ({dtype}), {DECODES} requests decoding; the host's {dtype} loop before / after: "
          f"{'-' if peak_before is None else f'{peak_before.tflops:.2f}'} / "
          f"{'-' if peak_after is None else f'{peak_after.tflops:.2f}'} TFLOP/s")  # fmt: skip
    print(f"{'prompt tokens':>14}{'step ms':>10}{'added ms':>10}{'ms/token':>10}{'of a prompt step':>18}")
    for row in rows:
        cells = (
            f"{row.added_ms:>10.1f}{row.per_token_ms:>10.3f}{row.of_prompt_step:>18.2f}" if row.prompt_tokens else ""
        )
        print(f"{row.prompt_tokens:>14}{row.step_ms:>10.1f}{cells}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "benchmark": "mixed_steps",
            "host": host,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "model": args.model,
            "read_gbs": {str(n): g for n, g in reads.items()},
            "peak_tflops": [None if p is None else p.tflops for p in (peak_before, peak_after)],
            "steps_ms": {str(p): v for p, v in steps.items()},
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
