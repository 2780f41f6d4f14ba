"""Every eviction policy on every trace of the suite and every capacity, in one table: does it generalize?

The traces (benchmarks/trace_suite.py): the Mooncake conversation trace's tuning half, and four traces held out
from tuning (its other half; chat, RAG and agent structure on the Azure traces' arrivals and lengths). Each
point replays a trace through the real `ucm.store.Store` with a DRAM tier of f × the trace's working set
(benchmarks/hit_rate.py's `run_point`), next to Belady's MIN at the same capacity.

Scores, per policy and trace: the hit rate at each capacity, and the fraction of the LRU→MIN gap it closes,
pooled over the capacities (`gap_closed`). The candidate (`--candidate`, the store's default by default) is checked against
the issue's bars: on every cell ≥ the best baseline − 0.5 points; on the held-out traces ≥ 30% of the gap on
average; on the conversation trace ≥ 40%.

    .venv/bin/python -m benchmarks.hit_rate_suite [--quick] [--json bench_out/hit_rate_suite.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from benchmarks.hit_rate import Replayer, capacity_blocks, run_point
from benchmarks.hit_rate_point import Point
from benchmarks.trace_suite import TraceName, load
from benchmarks.traces import working_set
from ucm.eviction import PolicyName
from ucm.eviction.belady import belady
from ucm.store_config import DEFAULT_POLICY

BASELINES = (PolicyName.LRU, PolicyName.S3FIFO, PolicyName.ARC, PolicyName.TINYLFU, PolicyName.GDSF, PolicyName.LRFU)
FRACS = (0.01, 0.02, 0.05, 0.1, 0.2)
MARGIN = 0.005  # the candidate may trail the best baseline by half a point
HELD_OUT_GAP, CONVERSATION_GAP = 0.30, 0.40


@functools.cache
def _blocks(name: TraceName, max_requests: int | None = None) -> list[list[int]]:
    """A trace's requests (the first `max_requests`) as full-block ids, once per worker process."""
    return load(name).full_blocks()[:max_requests]


def _point(args: tuple[TraceName, float, PolicyName, int, int | None]) -> Point:
    name, frac, policy, min_hits, max_requests = args
    blocks = _blocks(name, max_requests)
    return run_point(name.value, "dram", policy, frac, blocks, working_set(blocks), 0.0, min_hits=min_hits)


def _min_hits(args: tuple[TraceName, float, int | None]) -> int:
    name, frac, max_requests = args
    blocks = _blocks(name, max_requests)
    return belady(blocks, capacity_blocks(frac, working_set(blocks))).prefix_hits


def gap_closed(points: list[Point], policy: str) -> float:
    """(policy − LRU) / (MIN − LRU), each summed over the points' capacities (one trace's points). Pooled rather
    than a mean of per-capacity ratios: where MIN is within a few blocks of LRU (a cache holding nearly all that
    comes back) a ratio of two tiny numbers would swamp the mean."""
    gain = span = 0
    for p in points:
        if p.policy == policy:
            lru = next(q for q in points if q.capacity_frac == p.capacity_frac and q.policy == PolicyName.LRU.value)
            gain += (p.dram_hits + p.disk_hits) - (lru.dram_hits + lru.disk_hits)
            span += lru.belady_hits - (lru.dram_hits + lru.disk_hits)
    return gain / span if span else 0.0


def report(points: list[Point], candidate: str) -> dict[str, object]:
    policies = list(dict.fromkeys(p.policy for p in points))
    traces = list(dict.fromkeys(p.workload for p in points))
    print(
        f"\nhit rate % per trace and capacity (f of its working set), DRAM-only store; MIN = Belady; candidate {candidate}"
    )
    print(f"{'trace':<14}{'cap':>6}" + "".join(f"{n:>9}" for n in policies) + f"{'MIN':>8}{'cand-best':>10}")
    below: list[str] = []
    for trace in traces:
        rows = [p for p in points if p.workload == trace]
        for frac in dict.fromkeys(p.capacity_frac for p in rows):
            row = {p.policy: p for p in rows if p.capacity_frac == frac}
            base = [row[b.value].hit_rate for b in BASELINES if b.value in row]
            cand = row[candidate].hit_rate if candidate in row else float("nan")
            delta = cand - max(base) if base else float("nan")
            if delta < -MARGIN:
                below.append(f"{trace}@{frac:g}: {100 * delta:+.2f}")
            any_p = next(iter(row.values()))
            print(
                f"{trace:<14}{frac:>6g}"
                + "".join(f"{100 * row[n].hit_rate:>9.2f}" if n in row else f"{'-':>9}" for n in policies)
                + f"{100 * any_p.belady_hits / any_p.accesses:>8.2f}{100 * delta:>+10.2f}"
            )
    print("\nfraction of the LRU→MIN gap closed, pooled over capacities (held-out traces marked *)")
    print(f"{'trace':<15}" + "".join(f"{n:>9}" for n in policies))
    gaps: dict[str, dict[str, float]] = {}
    for trace in traces:
        rows = [p for p in points if p.workload == trace]
        gaps[trace] = {n: gap_closed(rows, n) for n in policies}
        mark = "*" if TraceName(trace).held_out else " "
        print(f"{trace + mark:<15}" + "".join(f"{100 * gaps[trace][n]:>8.1f}%" for n in policies))
    held = [t for t in traces if TraceName(t).held_out]
    held_mean = {n: sum(gaps[t][n] for t in held) / len(held) for n in policies} if held else {}
    if held:
        print(f"{'held-out mean':<15}" + "".join(f"{100 * held_mean[n]:>8.1f}%" for n in policies))
    conv = [t for t in traces if t in (TraceName.CONV_TUNE.value, TraceName.CONV_HOLDOUT.value)]
    conv_mean = sum(gaps[t][candidate] for t in conv) / len(conv) if conv and candidate in policies else float("nan")
    print(
        f"\ncandidate {candidate}: cells more than {100 * MARGIN:g} points under the best baseline: "
        f"{len(below)}{' (' + '; '.join(below) + ')' if below else ''}; held-out mean gap closed "
        f"{100 * held_mean.get(candidate, float('nan')):.1f}% (target {100 * HELD_OUT_GAP:g}%); conversation trace "
        f"{100 * conv_mean:.1f}% (target {100 * CONVERSATION_GAP:g}%)"
    )
    return {
        "candidate": candidate,
        "cells_below_best": below,
        "gap_closed": gaps,
        "held_out_mean": held_mean,
        "conversation_gap": conv_mean,
    }


def daemon_check(
    name: TraceName, frac: float, policy: PolicyName, max_requests: int | None = None
) -> dict[str, object]:
    """Replay one trace through a real store daemon (its own process, ZeroMQ, one worker so requests keep their
    order) and through the in-process store the table uses; print the daemon's own tier counters beside both."""
    from launch.store_process import StoreProcess
    from ucm.client import StoreClient
    from ucm.daemon_cli import _table

    blocks = _blocks(name, max_requests)
    ws = working_set(blocks)
    here = run_point(name.value, "dram", policy, frac, blocks, ws, 0.0, min_hits=0)
    replayer = Replayer()
    dram_bytes = here.dram_blocks * replayer.record_bytes()
    extra = ("--policy", policy.value, "--workers", "1")
    with StoreProcess(dram=str(dram_bytes), extra=extra) as daemon, StoreClient(daemon.address) as client:
        t0 = time.perf_counter()
        dram_hits, disk_hits = replayer.replay(client, blocks)
        seconds = time.perf_counter() - t0
        stats = client.stats()
    there = (dram_hits + disk_hits) / here.accesses
    print(
        f"\ndaemon replay of {name.value} at {frac:g} ({here.dram_blocks} blocks), {policy.value}: daemon "
        f"{100 * there:.2f}%, in-process store {100 * here.hit_rate:.2f}% (difference "
        f"{100 * (there - here.hit_rate):+.2f} points, bar 0.1) in {seconds:.0f}s; the daemon's store-stats:"
    )
    print(_table(stats))
    return {"trace": name.value, "frac": frac, "policy": policy.value, "daemon": there, "in_process": here.hit_rate}


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(p.workload for p in points))
    fig, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 3.6), squeeze=False)
    for ax, trace in zip(axes[0], traces, strict=True):
        rows = [p for p in points if p.workload == trace]
        fracs = sorted(dict.fromkeys(p.capacity_frac for p in rows))
        for policy in dict.fromkeys(p.policy for p in rows):
            ys = [100 * next(p.hit_rate for p in rows if p.policy == policy and p.capacity_frac == f) for f in fracs]
            ax.plot(fracs, ys, marker="o", markersize=3, label=policy)
        mins = [100 * next(p.belady_hits / p.accesses for p in rows if p.capacity_frac == f) for f in fracs]
        ax.plot(fracs, mins, "k--", label="MIN")
        ax.set_xscale("log")
        ax.set_title(trace + (" (held out)" if TraceName(trace).held_out else " (tuning)"), fontsize=9)
        ax.set_xlabel("capacity / working set")
    axes[0][0].set_ylabel("hit rate %")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=",".join(t.value for t in TraceName))
    ap.add_argument("--policies", default=",".join(p.value for p in PolicyName))
    ap.add_argument("--fracs", default=",".join(map(str, FRACS)))
    ap.add_argument("--candidate", default=DEFAULT_POLICY.value, help="the policy checked against the bars")
    ap.add_argument("--quick", action="store_true", help="two traces, two capacities")
    ap.add_argument("--max-requests", type=int, default=None, help="replay only each trace's first N requests")
    ap.add_argument("--jobs", type=int, default=2, help="processes")
    ap.add_argument("--json", type=Path, default=Path("bench_out/hit_rate_suite.json"))
    ap.add_argument("--png", type=Path, default=Path("bench_out/hit_rate_suite.png"))
    ap.add_argument(
        "--daemon-check",
        default="conv-holdout@0.02",
        help="TRACE@FRAC replayed through a real daemon with the candidate policy ('' = skip)",
    )
    args = ap.parse_args(argv)
    traces = [TraceName(t) for t in ("conv-tune,azure-agent" if args.quick else args.traces).split(",")]
    policies = [PolicyName(p) for p in args.policies.split(",")]
    fracs = [float(f) for f in ("0.02,0.1" if args.quick else args.fracs).split(",")]
    for name in traces:  # loaded here once for the daemon check too (`_blocks` is cached per process)
        print(f"{name.value}: {len(_blocks(name, args.max_requests))} requests", flush=True)
    t0 = time.perf_counter()
    cells = [(t, f, args.max_requests) for t in traces for f in fracs]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        mins = dict(zip(cells, pool.map(_min_hits, cells), strict=True))
        jobs = [(t, f, p, mins[(t, f, m)], m) for t, f, m in cells for p in policies]
        points = []
        for i, point in enumerate(pool.map(_point, jobs), 1):
            points.append(point)
            print(
                f"[{i}/{len(jobs)}] {point.workload} {point.capacity_frac:g} {point.policy}: {100 * point.hit_rate:.2f}% "
                f"(MIN {100 * point.belady_hits / point.accesses:.2f}%) {point.seconds:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    verdict = report(points, args.candidate)
    if args.daemon_check:
        trace, _, frac = args.daemon_check.partition("@")
        verdict["daemon_check"] = daemon_check(
            TraceName(trace), float(frac), PolicyName(args.candidate), args.max_requests
        )
    print(f"\n{len(points)} points in {time.perf_counter() - t0:.0f}s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"points": [asdict(p) | {"hit_rate": p.hit_rate} for p in points], "verdict": verdict}, indent=1)
    )
    plot(points, args.png)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
