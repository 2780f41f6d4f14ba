"""Where a step's time goes beside a busy neighbour: per-step wall time, in process, the same wave run four ways.

    python -m benchmarks.step_trace [--json bench_out/step_trace.json] [--png bench_out/step_trace.png]

One engine (the embedded model, `dtype auto`, all cores), a wave of 4 prompts of 460 tokens with 64 greedy tokens
each, timed step by step: idle and beside one plain Python busy loop, with the thread governor on and off
(engine/thread_governor.py). Each step's wall time is compared with the same step idle (steps are the same in all
four runs: same prompts, same budget), so the table says what the neighbour cost a step, prompt steps and decode
steps apart, and the PNG plots every step. The baseline is the idle run with the governor on, in the same process.
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
import torch

from benchmarks.vllm_harness import synthetic_prompt
from engine import LLM, SamplingParams
from engine.thread_governor import WINDOW_S
from ucm_kernels.cpu.host import cpu_info, vector_flags

PROMPTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 460, 64


def traced_wave(llm: LLM, seed: int) -> list[tuple[str, float, int]]:
    """(kind, seconds, threads) per step of one wave: kind 'prompt' if the step computed prompt tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    for i in range(PROMPTS):
        engine.add_request(f"w{seed}-{i}", synthetic_prompt(PROMPT_TOKENS, seed * PROMPTS + i), params)
    steps = []
    while engine.has_unfinished_requests():
        before = engine.stats().computed_tokens
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        kind = "prompt" if engine.stats().computed_tokens > before else "decode"
        steps.append((kind, seconds, torch.get_num_threads()))
    engine.kv_manager.pool.reset_prefix_cache()
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    llm = LLM(model="smollm2-135m", kv_cache_memory="256MiB")
    governor = llm.engine.governor
    assert governor is not None, "a CPU engine has a governor"
    widest = governor.max_threads
    traced_wave(llm, 999)  # warm: the first wave's one-time costs are not the subject
    runs: dict[str, list[tuple[str, float, int]]] = {}
    for label, busy, governed in (
        ("idle", False, True),
        ("busy, governor on", True, True),
        ("busy, governor off", True, False),
        ("idle, governor off", False, False),
    ):
        llm.engine.governor = governor if governed else None
        torch.set_num_threads(widest)
        governor.reset()
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            # A window's worth of time before the first step, as between two waves of a server: with a neighbour,
            # it is already running then, and the governor's first decision sees it.
            time.sleep(2 * WINDOW_S)
            runs[label] = traced_wave(llm, 1)
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
        print(f"{label}: {sum(s for _, s, _ in runs[label]):.2f} s over {len(runs[label])} steps", flush=True)
    llm.engine.governor = governor
    base = runs["idle"]
    print(f"\nhost: {cpu_info()[0]} [{' '.join(vector_flags())}], {os.cpu_count()} cores; {widest} engine threads")
    print(f"{'run':22}{'wave s':>8}{'prompt ms':>11}{'decode ms':>11}{'vs idle':>9}{'threads':>9}")
    table = {}
    for label, steps in runs.items():
        by = {k: [s * 1e3 for kind, s, _ in steps if kind == k] for k in ("prompt", "decode")}
        med = {k: statistics.median(v) if v else 0.0 for k, v in by.items()}
        total = sum(s for _, s, _ in steps)
        ratio = total / sum(s for _, s, _ in base)
        threads = sorted({t for _, _, t in steps})
        table[label] = {"wave_s": total, "median_ms": med, "vs_idle": ratio, "threads": threads, "steps": len(steps)}
        print(f"{label:22}{total:8.2f}{med['prompt']:11.1f}{med['decode']:11.1f}{ratio:9.2f}"
              f"{'/'.join(map(str, threads)):>9}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"cpu": cpu_info()[0], "table": table, "steps": runs}, indent=2))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        for label, steps in runs.items():
            ax.plot([s * 1e3 for _, s, _ in steps], label=label, linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("step wall time, ms (log)")
        ax.set_title(f"A wave of {PROMPTS}x{PROMPT_TOKENS}/{OUTPUT_TOKENS} beside a busy loop ({cpu_info()[0]})")
        ax.legend()
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
