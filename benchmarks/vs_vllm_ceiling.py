"""The best ratios to vLLM that this host's own limits allow on benchmarks.vs_vllm's workloads (issue 49).

A server can do no better than compute every FLOP a workload needs at the host's measured matmul rate and read every
byte at its measured read bandwidth, nothing else taking time. This puts that floor beside vLLM-CPU's measured
figures from benchmarks.vs_vllm's JSON: the ratio a perfect server would reach, against the target. Where the floor
misses the target, the target is out of reach on this host whatever the engine does. Beside it: the same floor at the
fractions of the limits the engine reaches (benchmarks.roofline's prefill and decode rows), which says how much of
the gap the kernels explain and how much the rest (scheduling, serving) does.

    random        each wave of `concurrency` requests arrives together and finishes together (the same lengths,
                  EOS ignored; the client sends the next as one ends): its prompts' prefill FLOPs at the matmul rate,
                  then out_len - 1 decode steps, each the slower of reading every weight and the wave's K/V so far
                  at the read bandwidth and computing its rows at the matmul rate
    cold          the probe's prompt (2048 tokens) in the FLOPs of its prefill, attention included
    prefix_rep    benchmarks.prefix_floor's least mean first-token time (every prefix once, every suffix), with this
                  model's FLOPs

Limits and fractions come from benchmarks.roofline's JSON of the same host (`--roofline`); without it the limits are
measured now and the engine's fractions are left out.

    python -m benchmarks.vs_vllm_ceiling --vs-vllm bench_out/vs_vllm.json [--roofline bench_out/roofline.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks.bench_server import VLLM
from benchmarks.prefix_floor import best_order_mean_flops
from benchmarks.roofline import (
    PREFILL_TOKENS,
    ROUNDS,
    kv_bytes,
    measure_rates,
    prefill_flops,
    read_bandwidth_gbs,
    weight_bytes,
)
from benchmarks.vs_vllm_workloads import BURST, PROBE_TOKENS, RANDOM, Burst, RandomShape
from benchmarks.yardstick_models import model_config
from engine.model_config import ModelConfig
from engine.step_budget import linear_flops_per_token


@dataclass(frozen=True)
class Limits:
    """What the host does at best (FLOP/s, bytes/s), and what fraction of each the engine's phases reach."""

    matmul: float
    read: float
    prefill_fraction: float = 1.0
    decode_fraction: float = 1.0

    def at_engine(self) -> Limits:
        return Limits(self.matmul * self.prefill_fraction, self.read * self.decode_fraction)


def random_s(mc: ModelConfig, shape: RandomShape, limits: Limits, itemsize: int) -> float:
    """Seconds the random workload takes at `limits` (module docstring)."""
    waves = math.ceil(shape.prompts / shape.concurrency)
    prefill = shape.concurrency * prefill_flops(mc, shape.prompt_len) / limits.matmul
    row_flops = linear_flops_per_token(mc) + 2 * mc.vocab_size * mc.hidden_size
    decode = sum(
        max(
            (weight_bytes(mc, itemsize) + shape.concurrency * kv_bytes(mc, shape.prompt_len + i, itemsize))
            / limits.read,
            shape.concurrency * row_flops / limits.matmul,
        )
        for i in range(1, shape.out_len)
    )
    return waves * (prefill + decode)


def random_tok_s(mc: ModelConfig, shape: RandomShape, limits: Limits, itemsize: int) -> float:
    return shape.prompts * shape.out_len / random_s(mc, shape, limits, itemsize)


def cold_ms(mc: ModelConfig, tokens: int, limits: Limits) -> float:
    return prefill_flops(mc, tokens) / limits.matmul * 1e3


def prefix_rep_mean_ms(mc: ModelConfig, burst: Burst, limits: Limits) -> float:
    return best_order_mean_flops(mc, burst)[0] / limits.matmul * 1e3


@dataclass(frozen=True)
class Row:
    metric: str  # benchmarks.vs_vllm's table key
    better: str  # "higher" or "lower"
    target: float  # the ratio to vLLM's the issue asks for
    vllm: float
    ucm: float | None
    floor: float  # at 100% of the limits
    at_engine: float | None  # at the engine's measured fractions of them

    def ratio(self, value: float) -> float:
        return value / self.vllm

    def of_limits(self, value: float) -> float:
        """The fraction of the host's limits a server reaching `value` runs at (1: the floor itself)."""
        return value / self.floor if self.better == "higher" else self.floor / value

    @property
    def needs(self) -> float:
        """The fraction of the limits the target needs: every phase at least this near them."""
        return self.of_limits(self.target * self.vllm)

    @property
    def reachable(self) -> bool:
        return self.needs <= 1.0


def rows(mc: ModelConfig, limits: Limits, engine: Limits | None, itemsize: int, vs: dict[str, Any]) -> list[Row]:
    table, targets = vs["table"], vs["targets"]
    vllm, ucm = table[VLLM], table.get("ucm-up", {})
    figures = {
        "random_out_tok_s": lambda lim: random_tok_s(mc, RANDOM, lim, itemsize),
        "cold_ttft_ms": lambda lim: cold_ms(mc, PROBE_TOKENS, lim),
        "prefix_rep_ttft_mean_ms": lambda lim: prefix_rep_mean_ms(mc, BURST, lim),
    }
    return [
        Row(
            metric,
            targets[metric][0],
            targets[metric][1],
            vllm[metric],
            ucm.get(metric),
            figure(limits),
            None if engine is None else figure(engine),
        )
        for metric, figure in figures.items()
        if metric in vllm
    ]


def limits_from(roofline: dict[str, Any] | None, model: str, mc: ModelConfig) -> tuple[Limits, Limits | None]:
    """(the host's limits, the same at the engine's fractions) from benchmarks.roofline's JSON, else measured now."""
    if roofline is None:
        rates = measure_rates(mc, model, argparse.Namespace(prefill_tokens=PREFILL_TOKENS, rounds=ROUNDS))
        read, _ = read_bandwidth_gbs(ROUNDS)
        return Limits(max(rates.values()) * 1e9, read * 1e9), None
    dtype = roofline["dtype"]
    mine = [r for r in roofline["rows"] if r["model"] == model]
    assert mine, f"the roofline JSON has no rows of {model}"
    limits = Limits(roofline["models"][model]["matmul_gflops"][dtype] * 1e9, roofline["read_gbs"] * 1e9)
    # The engine's rates themselves against these limits: a row's fraction is against the limit of its own seconds.
    prefill = next(r["rate"] for r in mine if r["phase"].startswith("prefill")) / limits.matmul
    decode = min(r["rate"] for r in mine if r["phase"].startswith("decode")) / limits.read  # the widest batch's
    return limits, Limits(limits.matmul, limits.read, prefill, decode).at_engine()


def report(rows: list[Row], limits: Limits, engine: Limits | None) -> str:
    head = f"limits: matmul {limits.matmul / 1e12:.2f} TFLOP/s, read {limits.read / 1e9:.1f} GB/s"
    if engine is not None:
        head += (
            f"; the engine's kernels: {engine.matmul / 1e12:.2f} TFLOP/s prefill, {engine.read / 1e9:.1f} GB/s decode"
        )
    lines = [head, "", "| metric | vLLM | ucm | floor | best x | target | target needs | vLLM at | ucm at | at the engine's kernels |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        sign = ">=" if r.better == "higher" else "<="
        ucm = ("", "") if r.ucm is None else (f"{r.ucm:.1f}", f"{r.of_limits(r.ucm):.0%}")
        eng = "" if r.at_engine is None else f"{r.at_engine:.1f} ({r.ratio(r.at_engine):.2f}x)"
        lines.append(
            f"| {r.metric} | {r.vllm:.1f} | {ucm[0]} | {r.floor:.1f} | {r.ratio(r.floor):.2f}x | {sign} {r.target}x | "
            f"{r.needs:.0%} of limits | {r.of_limits(r.vllm):.0%} | {ucm[1]} | {eng} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vs-vllm", type=Path, required=True, help="benchmarks.vs_vllm's JSON (a yardstick model's)")
    ap.add_argument("--roofline", type=Path, default=None, help="benchmarks.roofline's JSON of the same host")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    vs = json.loads(args.vs_vllm.read_text())
    model = vs["model"]
    mc = model_config(model)  # a yardstick model's: the embedded one's 4-bit weights read other bytes
    roofline = json.loads(args.roofline.read_text()) if args.roofline is not None else None
    limits, engine = limits_from(roofline, model, mc)
    itemsize = torch.empty((), dtype=getattr(torch, vs["vllm_dtype"])).element_size()
    table = rows(mc, limits, engine, itemsize, vs)
    print(f"{model} on {vs['cpu']['model']}, {vs['cpu']['cores']} cores, {vs['vllm_dtype']}")
    print(report(table, limits, engine))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"model": model, "cpu": vs["cpu"], "limits": asdict(limits), "engine": engine and asdict(engine)}
        args.json.write_text(json.dumps({**out, "rows": [asdict(r) for r in table]}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
