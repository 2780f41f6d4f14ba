"""How near this host's own limits the engine runs (issue 49): its measured matmul rate and memory read bandwidth,
and each phase of the yardstick models (benchmarks/yardstick_models.py) as a fraction of them.

    python -m benchmarks.roofline [--models llama-1b qwen-0.5b] [--dtype auto] [--json bench_out/roofline.json]

Measured in this process, all on the same threads (the engine's thread governor is off, so both see every core);
the limits before and after each model's phases, the higher counting:

    matmul rate    torch's F.linear on one decoder layer's shapes (qkv fused, o, gate_up fused, down) at a
                   1536-token step, bf16 and fp32, best of --rounds
    read bandwidth the fastest of torch's sum, its dot product (of the buffer with itself) and a native sum that
                   reads each thread's share as 4 or 8 streams (ucm_kernels/cpu/peak_probe.py: read_sum; a thread
                   reads faster as several streams, 31-32 GB/s against torch's 25-28 on the 2-core Xeon with AMX), over
                   an fp32 buffer of 4x the last-level cache (at least 1 GiB, at most 4), best of --rounds
    prefill        the engine's step that computes one 1536-token prompt (and samples its first token), --repeats
                   new prompts, in FLOPs the step needs: every layer's qkv and causal attention for every row, o and MLP
                   for every row but the last layer's (it runs them on the sampled row alone), the lm_head on one row;
                   each step between two passes of F.linear over every layer's shapes, distinct weights (the faster
                   counting)
    decode b       B requests decoding together (prompts of vs_vllm's random shape, 512 tokens), --repeats runs of
                   16 steps, each between two reads of the probe's buffer (the faster counting), each run's median
                   step in bytes a step must read: every weight (the tied lm_head whole; in the checkpoint's dtype where
                   the engine's is wider) and each request's K and V so far.
                   At that context, because vs_vllm_ceiling applies this fraction to that workload's decode steps:
                   at 256-token prompts Llama-1B's batch 8 read 92% (2-core Xeon with AMX), at 512 84%: the
                   attention reads twice the K/V, at ~14 GB/s (random blocks) where the weights stream at ~28

    host peak      the rate of a loop of the CPU's widest multiply-accumulate in the engine's dtype on registers
                   (ucm_kernels/cpu/peak_probe.py), before and after each model: a shared host's phase (the 2-core
                   Xeon with AMX: ~4.5 or ~1.9 TFLOP/s, for seconds to minutes); no matmul reaches it

Fractions: prefill's FLOP/s of the matmul rate in the engine's dtype (attention counted at the matmul rate, as the
issue asks), the median over its steps of each step against the rate of its own seconds. The best step against the
run's best rate (`best_fraction`, beside it) sets the two minutes apart: on the 2-core Xeon with AMX, whose speed
moves 2x within a minute, that read 44% to 169% from run to run. Decode's likewise, bytes/s of the read of its own
seconds, the median run by that fraction: the 2-core Zen 4 EPYC's read moves between 32 and 62 GB/s within minutes,
and against the run's best the same kernels read 49-88%. A model
whose weights partly fit the last-level cache may read faster than DRAM: the fraction can then pass 100%. Targets
(issue 49): prefill >= 85%, decode >= 75%.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks.prefix_floor import LayerMatmuls, attention_flops, linear_shapes, matmul_gflops
from benchmarks.vllm_harness import synthetic_prompt
from benchmarks.vs_vllm_workloads import RANDOM
from benchmarks.yardstick_models import SHAPES, ensure_model
from engine import LLM, SamplingParams
from engine.config import resolve_dtype_name
from engine.model_config import ModelConfig
from engine.step_budget import linear_flops_per_token
from ucm_kernels.cpu.host import cpu_info, last_level_cache_bytes, vector_flags
from ucm_kernels.cpu.peak_probe import peak, read_sum
from ucm_kernels.cpu.timing import alternating_best_ms

TARGETS = {"prefill": 0.85, "decode": 0.75}
PREFILL_TOKENS = 1536  # the prompt step timed: each matmul's rows
ROUNDS = 5  # matmul and read timings: the best counts
DECODE_PROMPT, DECODE_STEPS = RANDOM.prompt_len, 16


READ_STREAMS = (4, 8)  # the native read's streams a thread (peak_probe.read_sum: one stream a thread reads slower)


class ReadProbe:
    """The host's streaming read: the fastest of torch's sum, a dot product of a buffer with itself and a native sum
    reading each thread's share as READ_STREAMS streams (where it builds), over a buffer well past the last-level cache
    on torch's threads. The buffer is kept, so that a decode's steps can be held against reads of the same seconds."""

    def __init__(self) -> None:
        llc = last_level_cache_bytes() or (64 << 20)
        self.size = min(max(4 * llc, 1 << 30), 4 << 30)
        self._buf = torch.ones(self.size // 4, dtype=torch.float32)
        self._reads: list[Callable[[], object]] = [self._buf.sum, lambda: torch.dot(self._buf, self._buf)]
        threads, ptr = torch.get_num_threads(), self._buf.data_ptr()
        if read_sum(ptr, 16, 1, 1) is not None:
            self._reads += [functools.partial(read_sum, ptr, self._buf.numel(), s, threads) for s in READ_STREAMS]
        for read in self._reads:
            read()  # first touch
        self.best = 0.0  # GB/s: the fastest read so far

    def gbs(self, rounds: int) -> float:
        gbs = self.size / (min(alternating_best_ms(self._reads, rounds)) / 1000) / 1e9
        self.best = max(self.best, gbs)
        return gbs


def read_bandwidth_gbs(rounds: int) -> tuple[float, int]:
    """(GB/s, buffer bytes) of a `ReadProbe` made for the one measurement."""
    probe = ReadProbe()
    return probe.gbs(rounds), probe.size


def prefill_flops(mc: ModelConfig, tokens: int) -> int:
    """What the engine's prompt step computes (module docstring): the last layer's o and MLP on the sampled row."""
    per_layer_token = linear_flops_per_token(mc) // mc.num_layers
    qkv = 2 * mc.hidden_size * (mc.q_size + 2 * mc.kv_size)
    skipped = (per_layer_token - qkv) * (tokens - 1)
    lm_head = 2 * mc.vocab_size * mc.hidden_size
    return linear_flops_per_token(mc) * tokens - skipped + attention_flops(mc, 0, tokens) + lm_head


def weight_bytes(mc: ModelConfig, itemsize: int) -> int:
    """Every weight a decode step reads: the layers' matmuls, biases and norms, the final norm and the lm_head."""
    layer = sum(n * k for n, k in linear_shapes(mc)) + 2 * mc.hidden_size
    layer += (mc.q_size + 2 * mc.kv_size) if mc.qkv_bias else 0
    return itemsize * (mc.num_layers * layer + mc.vocab_size * mc.hidden_size + mc.hidden_size)


def kv_bytes(mc: ModelConfig, tokens: int, itemsize: int) -> int:
    return 2 * mc.num_layers * mc.kv_size * tokens * itemsize


def time_prefill(llm: LLM, tokens: int, seed: int) -> float:
    """Seconds of the step that computes a new `tokens`-token prompt whole."""
    engine, seconds = llm.engine, None
    engine.add_request(f"p{seed}", synthetic_prompt(tokens, seed * 100), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        before = engine.stats().computed_tokens
        t0 = time.perf_counter()
        engine.step()
        if engine.stats().computed_tokens - before == tokens:
            seconds = time.perf_counter() - t0
    assert seconds is not None, f"no step computed the {tokens}-token prompt at once (max_num_batched_tokens?)"
    return seconds


def paired_prefill(llm: LLM, matmuls: LayerMatmuls, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(seconds of a prompt step, F.linear's FLOP/s at the step's shapes around it) for --repeats new prompts: the
    rate the higher of a pass over every layer's matmuls (distinct weights, as long as the step's own matmuls) just
    before and one just after the step, so that each step is held against the host's speed of the same seconds (a
    shared host's moves by 2x within seconds to minutes)."""
    pairs = []
    for r in range(args.repeats):
        before = matmuls.gflops(1)
        step_s = time_prefill(llm, args.prefill_tokens, seed=10 + r)
        rate = max(before, matmuls.gflops(1)) * 1e9
        print(f"  prefill {args.prefill_tokens}: {step_s * 1e3:.0f} ms, F.linear around it {rate / 1e12:.2f} TFLOP/s",
              flush=True)  # fmt: skip
        pairs.append((step_s, rate))
    return pairs


def median_pair(pairs: list[tuple[float, float]], work: int) -> tuple[float, float]:
    """The (seconds, rate) pair whose step ran at the median fraction of its own limit (FLOP/s or read B/s) doing
    `work` (FLOPs or bytes): the upper median."""
    assert pairs, "no step was timed"
    return sorted(pairs, key=lambda p: work / p[0] / p[1])[len(pairs) // 2]


def time_decode(
    llm: LLM, batch: int, seed: int, groups: int = 1, read: Callable[[], float] | None = None
) -> list[tuple[list[float], float]]:
    """`groups` runs of DECODE_STEPS steps in which `batch` requests decode together (their prompts computed first),
    each as (its steps' seconds, the higher of `read`'s B/s just before and just after it; 0 without `read`)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=groups * DECODE_STEPS + 8, temperature=0, ignore_eos=True)
    ids = [f"d{seed}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, synthetic_prompt(DECODE_PROMPT, seed * 1000 + batch * 10 + i), params)
    before = -1
    while engine.stats().computed_tokens != before:  # the prompts, up to the first step that computes none
        before = engine.stats().computed_tokens
        engine.step()
    reads = [read() if read is not None else 0.0]
    timed: list[tuple[list[float], float]] = []
    for _ in range(groups):
        steps: list[float] = []
        for _ in range(DECODE_STEPS):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        assert engine.stats().computed_tokens == before, "a prompt token in a timed decode step"
        reads.append(read() if read is not None else 0.0)
        timed.append((steps, max(reads[-2:])))
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return timed


def measure_model(shape: str, dtype: str, probe: ReadProbe, args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = ensure_model(shape)
    mc = ModelConfig.from_folder(folder)
    llm = LLM(
        model=str(folder),
        dtype=dtype,
        kv_cache_memory="512MiB",
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(2048, args.prefill_tokens),
        enable_prefix_caching=False,
    )
    llm.engine.governor = None  # every core, as the matmuls and the read were measured
    torch.set_num_threads(args.threads)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # The weights in the fewest bytes they are exactly: a bf16 checkpoint served in fp32 (an AVX2-only host) decodes
    # from bf16 panels, half the fp32 bytes, which the fraction would otherwise count (157% on the 2-core Zen 4).
    config = json.loads((folder / "config.json").read_text())
    stored = config.get("dtype", config.get("torch_dtype"))  # transformers' name for it, new and old
    weight_itemsize = min(itemsize, 2 if stored in ("bfloat16", "float16") else 4)
    try:
        time_prefill(llm, args.prefill_tokens, seed=9)  # warm: one-time costs are not the subject
        time_decode(llm, max(args.batches), seed=9)
        rows = []
        flops = prefill_flops(mc, args.prefill_tokens)
        matmuls = LayerMatmuls(mc, args.prefill_tokens, getattr(torch, dtype), layers=mc.num_layers)
        pairs = paired_prefill(llm, matmuls, args)
        del matmuls
        median = median_pair(pairs, flops)
        best_s = min(p[0] for p in pairs)
        rows.append(
            {
                "model": shape,
                "phase": f"prefill {args.prefill_tokens}",
                "work": flops,
                "unit": "FLOP",
                "ms": median[0] * 1e3,
                "rate": flops / median[0],
                "roofline": median[1],
                "fraction": flops / median[0] / median[1],
                "target": TARGETS["prefill"],
                "best_ms": best_s * 1e3,  # best step against the best matmul rate: main() sets best_fraction
                "pairs": [{"ms": ms * 1e3, "matmul_flop_s": rate} for ms, rate in pairs],
            }
        )
        for batch in args.batches:
            groups = time_decode(llm, batch, seed=2, groups=args.repeats, read=lambda: probe.gbs(1) * 1e9)
            context = DECODE_PROMPT + args.repeats * DECODE_STEPS // 2  # the middle step's K/V per request
            read = weight_bytes(mc, weight_itemsize) + batch * kv_bytes(mc, context, itemsize)
            runs = [(statistics.median(steps), bw) for steps, bw in groups]
            step_s, bw = median_pair(runs, read)
            print(f"  decode b{batch}: {step_s * 1e3:.1f} ms, read around it {bw / 1e9:.1f} GB/s", flush=True)
            rows.append(
                {
                    "model": shape,
                    "phase": f"decode b{batch}",
                    "work": read,
                    "unit": "B",
                    "ms": step_s * 1e3,
                    "rate": read / step_s,
                    "roofline": bw,
                    "fraction": read / step_s / bw,
                    "target": TARGETS["decode"],
                    "tok_s": batch / step_s,
                    "best_ms": min(ms for ms, _ in runs) * 1e3,  # main() sets best_fraction against the run's read
                    "runs": [
                        {"ms": ms * 1e3, "read_gbs": around / 1e9, "steps_ms": [x * 1e3 for x in steps]}
                        for (ms, around), (steps, _) in zip(runs, groups, strict=True)
                    ],
                }
            )
        return rows
    finally:
        llm.close()
        del llm
        gc.collect()


def measure_rates(mc: ModelConfig, shape: str, args: argparse.Namespace) -> dict[str, float]:
    """F.linear's GFLOP/s at a prefill step's layer shapes, bf16 and fp32."""
    rates = {
        str(dt).removeprefix("torch."): matmul_gflops(mc, args.prefill_tokens, dt, args.rounds)
        for dt in (torch.bfloat16, torch.float32)
    }
    print(
        f"{shape}: matmul at {args.prefill_tokens} rows: "
        + ", ".join(f"{d} {r:.0f} GFLOP/s" for d, r in rates.items()),
        flush=True,
    )
    return rates


def fmt_work(row: dict[str, Any]) -> tuple[str, str]:
    if row["unit"] == "FLOP":
        return f"{row['work'] / 1e12:.2f} TFLOP", f"{row['rate'] / 1e12:.2f} of {row['roofline'] / 1e12:.2f} TFLOP/s"
    return f"{row['work'] / 1e9:.2f} GB", f"{row['rate'] / 1e9:.1f} of {row['roofline'] / 1e9:.1f} GB/s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--dtype", default="auto", help="the engine's: auto (as served), bfloat16 or float32")
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="prefill steps timed, each between two matmul passes; decode runs, each between two reads",
    )
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="matmul and read timings (the best counts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype_name(args.dtype, "cpu")
    model_name, _ = cpu_info()
    host = f"{model_name} [{' '.join(vector_flags())}], {args.threads} thread(s), engine dtype {dtype}"
    print(f"host: {host}", flush=True)
    probe = ReadProbe()
    print(
        f"read bandwidth: {probe.gbs(args.rounds):.1f} GB/s (streaming reads of {probe.size / 2**30:.2f} GiB)",
        flush=True,
    )
    report: dict[str, Any] = {
        "host": host,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dtype": dtype,
        "threads": args.threads,
        "read_gbs": probe.best,
        "models": {},
    }
    rows: list[dict[str, Any]] = []
    for shape in args.models:
        mc = ModelConfig.from_folder(ensure_model(shape))
        peak_before = peak(dtype, args.threads)
        rates = measure_rates(mc, shape, args)
        model_rows = measure_model(shape, dtype, probe, args)
        # The limits again after the phases, the higher counting: on a shared host, load that came and went during
        # one measurement of a limit would otherwise flatter every fraction (phases are best-of too).
        rates = {d: max(r, again) for (d, r), again in zip(rates.items(), measure_rates(mc, shape, args).values())}
        probe.gbs(args.rounds)  # decode's reads too: the best so far counts
        print(f"read bandwidth (the best so far): {probe.best:.1f} GB/s", flush=True)
        for row in model_rows:  # each paired with its own seconds' limit; the best against the best beside it
            best = rates[dtype] * 1e9 if row["unit"] == "FLOP" else probe.best * 1e9
            row["best_fraction"] = row["work"] / (row["best_ms"] / 1e3) / best
        # The host's phase around them: its multiply-accumulate loop's rate, before and after (module doc).
        peaks = [p.tflops if p is not None else None for p in (peak_before, peak(dtype, args.threads))]
        if peak_before is not None:
            print(f"host peak ({peak_before.kind.name} loop) before / after {shape}: "
                  f"{' / '.join('-' if x is None else f'{x:.2f}' for x in peaks)} TFLOP/s", flush=True)  # fmt: skip
        report["models"][shape] = {"matmul_gflops": rates, "peak_tflops": peaks}
        rows += model_rows
    report["read_gbs"] = probe.best
    print(
        f"\n{'model':<11}{'phase':<14}{'work':>12}{'time ms':>10}  {'achieved of measured':<28}{'fraction':>9}  target"
    )
    for row in rows:
        work, rate = fmt_work(row)
        ok = "ok" if row["fraction"] >= row["target"] else "--"
        print(
            f"{row['model']:<11}{row['phase']:<14}{work:>12}{row['ms']:>10.1f}  {rate:<28}{100 * row['fraction']:>8.0f}%"
            f"  >= {100 * row['target']:.0f}% {ok}"
            + (f"  (best step / best rate: {100 * row['best_fraction']:.0f}%)" if "best_fraction" in row else "")
        )
    report["rows"] = rows
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
