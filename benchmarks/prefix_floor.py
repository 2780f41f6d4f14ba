"""The compute floor of issue 10's prefix_repetition burst on this host, beside what the servers measured.

The burst (vLLM's `prefix_repetition` dataset, as `benchmarks.vs_vllm` sends it): 32 requests at once, 4 prefixes of
1024 tokens, 8 requests on each with a 128-token suffix of their own. With perfect prefix caching the server must
still compute every prefix once and every suffix: 8192 prompt tokens, before the last first token. A request's first
token needs its whole prompt computed; the order with the least mean first-token time computes one prefix group
after the other, each prefix and then its 8 suffixes (Sidney's decomposition for precedence in series-parallel
form: the groups are alike, and a group's prefix with all its suffixes has the best work per request). On a host
that computes at a fixed rate the floor of the mean first-token time is that order's mean completion time. Beside it,
the same order as a step-based engine runs it: a step takes every row through every layer before any row gets its
token, so a group's followers, computed in one step, finish together at its end.

The rate is measured now: this model's prompt-sized matmuls (its layers' shapes at a leader's 1152 rows, F.linear,
best of several rounds, in both dtypes; the faster one counts, as `dtype auto` picks). Attention is counted at the
same rate, which no attention kernel reaches, so the floor is generous. With `--vs-vllm JSON` (benchmarks.vs_vllm's
output) the table puts vLLM's and ucm-serve's measured means beside it, and the 0.5x target.

    .venv/bin/python -m benchmarks.prefix_floor [--vs-vllm bench_out/vs_vllm.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_server import VLLM
from benchmarks.vs_vllm_workloads import Burst
from engine.model_config import ModelConfig
from engine.model_source import resolve_model_dir
from engine.step_budget import linear_flops_per_token
from ucm_kernels.cpu.host import cpu_info
from ucm_kernels.cpu.timing import alternating_best_ms

MODEL = "smollm2-135m"
TARGET = 0.5  # issue 10: mean TTFT <= 0.5x vLLM-CPU's


def attention_flops(mc: ModelConfig, start: int, end: int) -> int:
    """Causal attention of positions [start, end) over everything before them: QK^T and PV, 2 flops a MAC."""
    pairs = sum(p + 1 for p in range(start, end))
    return 4 * mc.head_dim * mc.num_heads * mc.num_layers * pairs


def prefix_and_suffix_flops(mc: ModelConfig, burst: Burst) -> tuple[int, int]:
    """The work of one prefix, and of one request's suffix over it."""
    per_token = linear_flops_per_token(mc)
    prefix = per_token * burst.prefix_len + attention_flops(mc, 0, burst.prefix_len)
    end = burst.prefix_len + burst.suffix_len
    return prefix, per_token * burst.suffix_len + attention_flops(mc, burst.prefix_len, end)


def best_order_mean_flops(mc: ModelConfig, burst: Burst) -> tuple[float, int]:
    """(mean first-token completion, whole burst) in flops, in the order of least mean (module docstring)."""
    prefix, suffix = prefix_and_suffix_flops(mc, burst)
    done, completions = 0, []
    for _ in range(burst.prefixes):
        done += prefix
        for _ in range(burst.per_prefix):
            done += suffix
            completions.append(done)
    return sum(completions) / len(completions), done


def batched_order_mean_flops(mc: ModelConfig, burst: Burst) -> float:
    """The mean first-token completion in flops in the same order as a step-based engine runs it: a group's leader
    (its prefix and suffix) in one step, its other requests' suffixes together in the next, each request done at
    its step's end (a step computes every row through every layer before any row's token)."""
    prefix, suffix = prefix_and_suffix_flops(mc, burst)
    done, completions = 0, []
    for _ in range(burst.prefixes):
        done += prefix + suffix
        completions.append(done)
        done += (burst.per_prefix - 1) * suffix
        completions += [done] * (burst.per_prefix - 1)
    return sum(completions) / len(completions)


def linear_shapes(mc: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's matmuls as the engine runs them: qkv fused, o, gate_up fused, down."""
    return [
        (mc.q_size + 2 * mc.kv_size, mc.hidden_size),
        (mc.hidden_size, mc.q_size),
        (2 * mc.intermediate_size, mc.hidden_size),
        (mc.hidden_size, mc.intermediate_size),
    ]


class LayerMatmuls:
    """Decoder layers' matmuls (`linear_shapes`) through F.linear at `rows` rows: `layers` distinct weights of each
    shape (a model's weights come from memory, not from a cache one warm weight stays in), random operands made
    once."""

    def __init__(self, mc: ModelConfig, rows: int, dtype: torch.dtype, layers: int = 1) -> None:
        gen = torch.Generator().manual_seed(0)
        shapes = linear_shapes(mc)
        self.inputs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes]
        self.weights = [[torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes] for _ in range(layers)]
        self.flops = layers * sum(2 * rows * n * k for n, k in shapes)
        self.run()  # warm-up: oneDNN builds its primitives

    def run(self) -> None:
        for layer in self.weights:
            for x, w in zip(self.inputs, layer, strict=True):
                F.linear(x, w)

    def gflops(self, rounds: int) -> float:
        """GFLOP/s of a pass over every layer, best of `rounds`."""
        ms = alternating_best_ms([self.run], rounds)[0]
        return self.flops / (ms / 1000) / 1e9


def matmul_gflops(mc: ModelConfig, rows: int, dtype: torch.dtype, rounds: int) -> float:
    """GFLOP/s of one layer's matmuls at `rows` rows, best of `rounds`."""
    return LayerMatmuls(mc, rows, dtype).gflops(rounds)


@dataclass
class Floor:
    cpu: str
    flags: str
    threads: int
    gflops: dict[str, float]
    dtype: str
    tokens: int
    linear_tflop: float
    attention_tflop: float
    burst_s: float
    mean_ttft_floor_s: float
    mean_ttft_batched_s: float  # the same order at the same rate, a group's followers finishing in one step
    vllm_mean_ttft_s: float | None = None
    ucm_mean_ttft_s: float | None = None


def measure(burst: Burst, rounds: int) -> Floor:
    mc = ModelConfig.from_folder(resolve_model_dir(MODEL))
    rows = burst.prefix_len + burst.suffix_len
    rates = {
        str(dt).removeprefix("torch."): matmul_gflops(mc, rows, dt, rounds) for dt in (torch.bfloat16, torch.float32)
    }
    dtype = max(rates, key=lambda d: rates[d])
    mean_flops, burst_flops = best_order_mean_flops(mc, burst)
    linear = linear_flops_per_token(mc) * burst.tokens
    model, flags = cpu_info()
    isa = " ".join(sorted(f for f in flags.split() if f.startswith(("avx", "amx")) or f == "fma"))
    rate = rates[dtype] * 1e9
    return Floor(
        cpu=model,
        flags=isa,
        threads=torch.get_num_threads(),
        gflops={d: round(r, 1) for d, r in rates.items()},
        dtype=dtype,
        tokens=burst.tokens,
        linear_tflop=linear / 1e12,
        attention_tflop=(burst_flops - linear) / 1e12,
        burst_s=burst_flops / rate,
        mean_ttft_floor_s=mean_flops / rate,
        mean_ttft_batched_s=batched_order_mean_flops(mc, burst) / rate,
    )


def read_vs_vllm(path: Path) -> tuple[float | None, float | None]:
    """(vLLM's, ucm-serve's `up`) best prefix_repetition mean TTFT in seconds from benchmarks.vs_vllm's JSON."""
    table = json.loads(path.read_text())["table"]

    def mean_s(name: str) -> float | None:
        ms = table.get(name, {}).get("prefix_rep_ttft_mean_ms")
        return None if ms is None else ms / 1000

    return mean_s(VLLM), mean_s("ucm-up")


def report(floor: Floor) -> str:
    rows = [
        ("host", f"{floor.cpu} [{floor.flags}], {floor.threads} thread(s)"),
        (
            "matmul rate, the model's layers at prompt size",
            ", ".join(f"{d} {r} GFLOP/s" for d, r in floor.gflops.items()),
        ),
        ("dtype (the faster)", floor.dtype),
        ("prompt tokens the burst computes", str(floor.tokens)),
        ("work: linear + attention", f"{floor.linear_tflop:.2f} + {floor.attention_tflop:.2f} TFLOP"),
        ("whole burst at that rate", f"{floor.burst_s:.2f} s"),
        ("FLOOR of the mean TTFT (best order, nothing else)", f"{floor.mean_ttft_floor_s:.2f} s"),
        ("the same with a group's followers done in one step", f"{floor.mean_ttft_batched_s:.2f} s"),
    ]
    if floor.vllm_mean_ttft_s is not None:
        target = TARGET * floor.vllm_mean_ttft_s
        rows += [
            ("vLLM-CPU's measured mean TTFT (best round)", f"{floor.vllm_mean_ttft_s:.2f} s"),
            (f"target: {TARGET}x of it", f"{target:.2f} s"),
            ("floor / vLLM's mean", f"{floor.mean_ttft_floor_s / floor.vllm_mean_ttft_s:.2f}"),
            ("followers in one step / vLLM's mean", f"{floor.mean_ttft_batched_s / floor.vllm_mean_ttft_s:.2f}"),
            ("target reachable at 100% of the matmul rate", "yes" if floor.mean_ttft_floor_s <= target else "NO"),
        ]
    if floor.ucm_mean_ttft_s is not None:
        rows += [
            ("ucm-serve up's measured mean TTFT (best round)", f"{floor.ucm_mean_ttft_s:.2f} s"),
            (
                "floor / ucm-serve's mean (how near the floor it runs)",
                f"{floor.mean_ttft_floor_s / floor.ucm_mean_ttft_s:.2f}",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vs-vllm", type=Path, default=None, help="benchmarks.vs_vllm's JSON: the measured means")
    ap.add_argument("--rounds", type=int, default=20, help="matmul timing rounds (the best counts)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    floor = measure(Burst(), args.rounds)
    if args.vs_vllm is not None:
        floor.vllm_mean_ttft_s, floor.ucm_mean_ttft_s = read_vs_vllm(args.vs_vllm)
    print(report(floor))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(floor), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
