"""How much of the LRU→MIN gap an eviction policy could close if it knew which blocks come back, and how well
what it can see predicts that (issue 50: why the default closes a quarter of the gap, not 30–40%).

Per trace of the suite (benchmarks/trace_suite.py) and capacity, in one run:

- `lru`, `density` (the default): the real `ucm.store.Store` replay of benchmarks/hit_rate.py.
- `oracle`: an LRU that is told, when it stores a block, whether the block will ever be read again, and stores
  only those (touching a request's blocks deepest first, as the store hands them to its policy). It is not an
  online policy; it shows how far knowing *who comes back*, and nothing about *when*, goes.
- `MIN`: Belady's offline optimum (ucm/eviction/belady.py).

and, from the trace alone, what an online policy sees of that future: a request's *follow-up* is the next later
request whose full blocks begin with all of its own (a conversation's next turn); the table gives P(follow-up)
by the request's turn (how many follow-ups it is itself: what a block's hit count and lineage tell `density`) and
by its prompt length. Where those probabilities are far from 0 and 1, no policy can store exactly the blocks
that return, which the oracle does.

    .venv/bin/python -m benchmarks.reuse_bound [--traces conv-tune,...] [--json bench_out/reuse_bound.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.hit_rate import capacity_blocks, run_point
from benchmarks.hit_rate_suite import FRACS
from benchmarks.trace_suite import TraceName, load
from benchmarks.traces import working_set
from ucm.eviction import PolicyName
from ucm.eviction.belady import belady
from ucm.store_config import DEFAULT_POLICY

TURNS = 4  # turns 0, 1, 2 and 3 or more
LENGTH_SPLITS = 3  # prompt-length terciles


def oracle_lru(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Prefix hits of an LRU of `capacity` blocks that stores a missed block only if it is read again later."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    later: set[int] = set()
    reused_later: list[list[bool]] = []
    for request in reversed(requests):  # for each access: is its block read again after it?
        reused_later.append([block in later for block in request])
        later.update(request)
    reused_later.reverse()
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for request, again in zip(requests, reused_later, strict=True):
        in_prefix = True
        for block in request:
            in_prefix = in_prefix and block in cache
            hits += in_prefix
        for block, keep in zip(reversed(request), reversed(again), strict=True):  # deepest first, as the store
            if keep:
                cache[block] = None
                cache.move_to_end(block)
            else:
                cache.pop(block, None)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


@dataclass(frozen=True)
class FollowUps:
    """P(a request gets a follow-up), by its turn and by its prompt length's tercile."""

    by_turn: list[tuple[int, float]]  # (requests, P) for turns 0 .. TURNS-1 (the last: that many or more)
    by_length: list[tuple[int, int, float]]  # (up to this many blocks, requests, P) per tercile
    stored_reused: float  # of the blocks a cache without limit stores, the share read again


def follow_ups(requests: Sequence[Sequence[int]]) -> FollowUps:
    open_ends: dict[tuple[int, ...], list[int]] = {}  # a request's full blocks -> its indices still unfollowed
    turn = [0] * len(requests)
    followed = [False] * len(requests)
    seen: set[int] = set()
    for j, request in enumerate(requests):
        for length in range(len(request), 0, -1):  # the longest earlier request it continues
            waiting = open_ends.get(tuple(request[:length]))
            if waiting:
                i = waiting.pop()
                followed[i], turn[j] = True, turn[i] + 1
                break
        # Only a request that added content of its own can be continued: one made of blocks seen before (a
        # shared system prompt alone) would read as the "turn" every later prompt under that prefix continues.
        if request and request[-1] not in seen:
            open_ends.setdefault(tuple(request), []).append(j)
        seen.update(request)
    by_turn = []
    for t in range(TURNS):
        members = [i for i in range(len(requests)) if min(turn[i], TURNS - 1) == t]
        by_turn.append((len(members), sum(followed[i] for i in members) / max(1, len(members))))
    order = sorted(range(len(requests)), key=lambda i: len(requests[i]))
    by_length = []
    for k in range(LENGTH_SPLITS):
        part = order[k * len(order) // LENGTH_SPLITS : (k + 1) * len(order) // LENGTH_SPLITS]
        if part:
            p = sum(followed[i] for i in part) / len(part)
            by_length.append((len(requests[part[-1]]), len(part), p))
    seen.clear()
    stored = reused = 0
    for request in requests:
        for block in request:
            if block in seen:
                reused += 1
            else:
                seen.add(block)
                stored += 1
    return FollowUps(by_turn, by_length, reused / max(1, stored + reused))


@dataclass(frozen=True)
class Cell:
    trace: str
    frac: float
    accesses: int
    lru: int
    density: int
    oracle: int
    min: int


def _cell(args: tuple[TraceName, float]) -> Cell:
    name, frac = args
    blocks = load(name).full_blocks()
    ws = working_set(blocks)
    cap = capacity_blocks(frac, ws)
    mn = belady(blocks, cap).prefix_hits
    lru = run_point(name.value, "dram", PolicyName.LRU, frac, blocks, ws, 0.0, min_hits=mn)
    dens = run_point(name.value, "dram", DEFAULT_POLICY, frac, blocks, ws, 0.0, min_hits=mn)
    return Cell(name.value, frac, lru.accesses, lru.dram_hits, dens.dram_hits, oracle_lru(blocks, cap), mn)


def gap_share(cells: list[Cell], attr: str) -> float:
    """(attr − LRU) / (MIN − LRU), summed over the cells' capacities (hit_rate_suite's pooled gap closed)."""
    gap = sum(c.min - c.lru for c in cells)
    return sum(getattr(c, attr) - c.lru for c in cells) / gap if gap else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=",".join(t.value for t in TraceName))
    ap.add_argument("--fracs", default=",".join(map(str, FRACS)))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path("bench_out/reuse_bound.json"))
    args = ap.parse_args(argv)
    traces = [TraceName(t) for t in args.traces.split(",")]
    fracs = [float(f) for f in args.fracs.split(",")]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        cells = list(pool.map(_cell, [(t, f) for t in traces for f in fracs]))
    print("hit % per capacity: lru · density · oracle (told who returns) · MIN; then the gap share pooled")
    print(f"{'trace':<14}" + "".join(f" | {f:<19g}" for f in fracs) + f" | {'density':>7} {'oracle':>7}")
    follow: dict[str, object] = {}
    for name in traces:
        rows = [c for c in cells if c.trace == name.value]
        line = "".join(
            f" | {'·'.join(f'{100 * h / c.accesses:.1f}' for h in (c.lru, c.density, c.oracle, c.min)):<19}"
            for c in rows
        )
        shares = f"{100 * gap_share(rows, 'density'):>6.1f}% {100 * gap_share(rows, 'oracle'):>6.1f}%"
        print(f"{name.value:<14}{line} | {shares}")
    print("\nP(follow-up) by turn 0 / 1 / 2 / 3+ (requests), and by prompt-length tercile (up to N blocks)")
    for name in traces:
        fu = follow_ups(load(name).full_blocks())
        follow[name.value] = asdict(fu)
        turns = " / ".join(f"{p:.2f} ({n})" for n, p in fu.by_turn)
        lengths = " / ".join(f"{p:.2f} (≤{b})" for b, _, p in fu.by_length)
        print(f"{name.value:<14}{turns};  {lengths};  accesses that re-read a block {100 * fu.stored_reused:.0f}%")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cells": [asdict(c) for c in cells], "follow_ups": follow}, indent=1))
    print(f"\n{len(cells)} cells in {time.perf_counter() - t0:.0f}s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
