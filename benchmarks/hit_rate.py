"""Cache hit rate of the UCM store per eviction policy, next to Belady's MIN and an infinite cache.

Every request goes through the real `ucm.store.Store` code: `lookup` (hit prefix) → `load` the hit blocks
(counting, from the store's own tier stats, how many came from DRAM and how many from disk) → `dump` +
`commit` the missing blocks. Payloads are fake but byte-sized (one small layer per block), and capacities
are whole blocks (the record size, header included, times a block count), so "capacity" reads as a
fraction of the workload's working set (its distinct blocks).

Two sweeps, per policy (the same policy on both tiers, or "dram/disk" such as lru/tinylfu: TinyLFU's
frequency filter guarding the disk tier behind a plain LRU DRAM tier):

- `dram`: a DRAM-only store (no disk tier) of capacity f × working set. This is where the policies are
  compared: printed next to MIN for a single cache of the same size.
- `tiered`: a DRAM tier of `--dram-frac` × working set in front of an LMDB disk tier of f × working set.
  The LMDB environment lives in a fresh temporary directory per point (in /dev/shm when it exists: the
  benchmark measures hit rates, not fsync latency). The store writes behind every committed block to disk
  (an inclusive hierarchy); the replay calls `Store.flush()` after each request so the run is deterministic.
  The MIN printed is for ONE cache of DRAM + disk blocks (an upper bound; the inclusive store can use at most
  max(DRAM, disk) distinct blocks, so the gap to MIN is partly structural, not the policy's fault).

Hit rate = hit blocks / requested full blocks, with prefix semantics (a block after a miss is a miss, as in
the store). The Mooncake trace is subsampled by default to keep a full run near 3 minutes on 2 cores:
`--sample 4` keeps ~1/4 of the conversations whole (SHARDS-style, by a hash of each request's second
block, see benchmarks/traces.py), `--sample 1` replays all 12,031 requests; `--max-requests N` reads
only the first N lines. What was kept is printed. Synthetic workloads are seeded.

    .venv/bin/python -m benchmarks.hit_rate [--quick] [--json out.json] [--png bench_out/hit_rate.png]

What it shows (default run; table in docs/benchmarks.md): tiers hand a request's blocks to the policy
deepest first, so chains lose their tails, not their roots. `density` (prefix-aware: evicts leaves only, ranked
by a hit density it learns per hit-count class, remembering evicted blocks as ghosts) is the best policy on
Mooncake up to 10% of the working set (1%: 10.97 against LRU's 5.07; 2%: 15.34 against 7.86), on RAG, and
on shared system prompts at 2%; where recency is what predicts reuse (synthetic chat at 10%, Mooncake at 20%,
also tiered) it falls 0.15 to 0.37 points under LRU. `adaptive` follows LRU or `density`, whichever wins on sampled shadow caches, and
is >= LRU at every capacity of every workload, giving back part of `density`'s lead for that. No online policy
gets within 2 points of MIN on Mooncake (12.6 points at 1%, 2.35 at 20%): three quarters of its blocks are
never read again, MIN stores exactly the others, and nothing visible online (hit count, depth, position in
the request, first request or continuation) tells them apart beyond a reuse probability of 0.16 to 0.40 for
a block never hit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from benchmarks.hit_rate_point import Point
from benchmarks.hit_rate_report import plot, print_table
from benchmarks.traces import Request, Workload, make_workload, working_set
from common.keys import KeyNamespace, chain_key, root_key
from ucm.api import BlockRef, KVStore, Tier
from ucm.eviction import PolicyName
from ucm.eviction.belady import belady
from ucm.record import BlockRecord, checksum
from ucm.store import Store, StoreConfig
from ucm.store_config import DiskWrites

PAYLOAD_BYTES = 64
ROOT = root_key(KeyNamespace("hit-rate-bench", "fake", 512))


class Replayer:
    """Turns block ids into real chained keys and drives one store through a workload."""

    def __init__(self) -> None:
        self._refs: dict[int, BlockRef] = {}
        self._payload = bytes(PAYLOAD_BYTES)
        self._dst = [memoryview(bytearray(PAYLOAD_BYTES))]

    def record_bytes(self) -> int:
        ref = BlockRef(chain_key(ROOT, (0,)), ROOT, (0,))
        return BlockRecord.build(ref, [self._payload], [checksum(self._payload)]).nbytes

    def _ref(self, block: int, parent: BlockRef | None) -> BlockRef:
        ref = self._refs.get(block)
        if ref is None:
            parent_key = parent.key if parent is not None else ROOT
            ref = BlockRef(chain_key(parent_key, (block,)), parent_key, (block,))
            self._refs[block] = ref
        return ref

    def replay(
        self, store: KVStore, requests: list[Request], flush: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        """(DRAM hit blocks, disk hit blocks) over the whole workload, counted by the store's own tier stats.

        `store`: the in-process `Store` or a `StoreClient` of a daemon (the same calls, over its socket); `flush`:
        called after each request's commit, so the disk tier's write-behind is done before the next lookup."""
        dram_hits = disk_hits = 0
        for request in requests:
            refs: list[BlockRef] = []
            for block in request:
                refs.append(self._ref(block, refs[-1] if refs else None))
            hit = store.lookup([ref.key for ref in refs])
            if hit:
                before = store.stats().tiers
                task = store.load(refs[:hit], [0], [self._dst] * hit)
                task.wait()
                assert not task.failed_blocks, f"load of committed blocks failed: {task.failed_blocks}"
                after = store.stats().tiers
                dram = after[Tier.DRAM].hits - before[Tier.DRAM].hits
                disk = after[Tier.DISK].hits - before[Tier.DISK].hits if Tier.DISK in after else 0
                assert dram + disk == hit, f"tier hits {dram}+{disk} != {hit} loaded blocks"
                dram_hits, disk_hits = dram_hits + dram, disk_hits + disk
            missing = refs[hit:]
            if missing:
                store.dump(missing, 0, 1, [self._payload] * len(missing)).wait()
                store.commit([ref.key for ref in missing], True)
                if flush is not None:
                    flush()
        return dram_hits, disk_hits


def capacity_blocks(frac: float, working_set_blocks: int) -> int:
    """A tier of `frac` × the working set, in whole blocks (at least one)."""
    return max(1, round(frac * working_set_blocks))


def run_point(
    workload: str,
    sweep: str,
    policy: PolicyName,
    frac: float,
    requests: list[Request],
    ws: int,
    dram_frac: float,
    disk_policy: PolicyName | None = None,
    disk_writes: DiskWrites = DiskWrites.BEHIND,
    min_hits: int | None = None,
) -> Point:
    """`min_hits`: Belady's prefix hits at this capacity when the caller has them (they depend on the capacity only)."""
    replayer = Replayer()
    rec = replayer.record_bytes()
    cap = capacity_blocks(frac, ws)
    dram_blocks, disk_blocks = (cap, 0) if sweep == "dram" else (max(1, round(dram_frac * ws)), cap)
    start = time.perf_counter()
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="ucm-hitrate-", dir=shm if shm.is_dir() else None) as tmp:
        config = StoreConfig(
            dram_bytes=dram_blocks * rec,
            disk_path=tmp if disk_blocks else None,
            disk_bytes=disk_blocks * rec,
            policy=policy,
            disk_policy=disk_policy or policy,
            disk_writes=disk_writes,
        )
        with Store(config) as store:
            dram_hits, disk_hits = replayer.replay(store, requests, store.flush if disk_blocks else None)
            written = store.stats().tiers[Tier.DISK].bytes_written if disk_blocks else 0
    accesses = sum(map(len, requests))
    return Point(
        workload,
        sweep,
        policy_label(policy, disk_policy) + ("" if disk_writes is DiskWrites.BEHIND else f"[{disk_writes.value}]"),
        frac,
        dram_blocks,
        disk_blocks,
        accesses,
        dram_hits,
        disk_hits,
        min_hits if min_hits is not None else belady(requests, dram_blocks + disk_blocks).prefix_hits,
        accesses - ws,
        time.perf_counter() - start,
        disk_writes.value,
        round(written / rec),
    )


def policy_label(policy: PolicyName, disk_policy: PolicyName | None) -> str:
    return policy.value if disk_policy in (None, policy) else f"{policy.value}/{disk_policy.value}"


def parse_policies(spec: str) -> list[tuple[PolicyName, PolicyName | None]]:
    out = []
    for item in spec.split(","):
        dram, _, disk = item.partition("/")
        out.append((PolicyName(dram), PolicyName(disk) if disk else None))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL (default <repo>/../shared/data/traces/)")
    ap.add_argument("--quick", action="store_true", help="a small run: fewer requests, capacities and workloads")
    ap.add_argument("--workloads", default=None, help="comma list of " + ",".join(w.value for w in Workload))
    ap.add_argument("--policies", default=",".join(n.value for n in PolicyName), help="comma list; dram/disk pairs ok")
    ap.add_argument("--tiered-policies", default=None, help="default: lru,s3fifo,density,adaptive,lru/tinylfu")
    ap.add_argument("--fracs", default=None, help="Mooncake DRAM capacities as fractions of the working set")
    ap.add_argument("--synthetic-fracs", default=None, help="the same for the synthetic workloads")
    ap.add_argument("--tiered-fracs", default=None, help="disk fractions for the tiered sweep ('' = skip it)")
    ap.add_argument("--dram-frac", type=float, default=0.01, help="DRAM tier in the tiered sweep")
    ap.add_argument(
        "--disk-writes",
        default=DiskWrites.BEHIND.value,
        help="the tiered sweep's disk writes, comma list of " + ",".join(w.value for w in DiskWrites),
    )
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--sample", type=int, default=None, help="keep ~1/k Mooncake conversations (default 4; quick 8)")
    ap.add_argument("--synthetic-requests", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=Path("bench_out/hit_rate.png"))
    args = ap.parse_args(argv)
    # Each request hands a load to the store's thread pool; with CPython's default 5 ms switch interval
    # the main thread waits for the GIL after every hand-off, which would dominate the replay time.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    try:
        return _run(args)
    finally:
        sys.setswitchinterval(interval)


def _run(args: argparse.Namespace) -> int:
    q = args.quick
    workloads = [
        Workload(w)
        for w in (args.workloads or ("mooncake,chat" if q else ",".join(w.value for w in Workload))).split(",")
    ]
    policies = parse_policies(args.policies)
    tiered_policies = parse_policies(args.tiered_policies or "lru,s3fifo,density,adaptive,lru/tinylfu")
    fracs = [float(f) for f in (args.fracs or ("0.02,0.1" if q else "0.01,0.02,0.05,0.1,0.2")).split(",")]
    syn_fracs = [float(f) for f in (args.synthetic_fracs or args.fracs or "0.02,0.1").split(",")]
    tiered_spec = args.tiered_fracs if args.tiered_fracs is not None else ("0.05" if q else "0.05,0.2")
    tiered = [float(f) for f in tiered_spec.split(",") if f]
    writes = [DiskWrites(w) for w in args.disk_writes.split(",")]
    max_req = args.max_requests
    sample = args.sample or (8 if q else 4)
    n_syn = args.synthetic_requests or (1000 if q else 2000)

    plan = [(w, "dram", f) for w in workloads for f in (fracs if w is Workload.MOONCAKE else syn_fracs)]
    plan += [(Workload.MOONCAKE, "tiered", f) for f in tiered if Workload.MOONCAKE in workloads]
    data = {}
    for w in workloads:
        reqs = make_workload(
            w, trace=args.trace, num_requests=max_req if w is Workload.MOONCAKE else n_syn, sample=sample
        )
        data[w] = (reqs, working_set(reqs))
        n = sum(map(len, reqs))
        print(
            f"{w.value}: {len(reqs)} requests, {n} block accesses, working set {data[w][1]} blocks"
            + (
                f" (lines read: {max_req or 'all'}, ~1/{sample} of the conversations kept)"
                if w is Workload.MOONCAKE
                else ""
            ),
            flush=True,
        )
    # Each point to measure: the tiered sweep pairs every policy with every disk-write mode; the DRAM sweep has no disk.
    runs = [
        (w, sweep, frac, policy, disk_policy, disk_writes)
        for w, sweep, frac in plan
        for (policy, disk_policy), disk_writes in (
            [(pol, wr) for pol in tiered_policies for wr in writes]
            if sweep == "tiered"
            else [(pol, DiskWrites.BEHIND) for pol in policies]
        )
    ]
    points: list[Point] = []
    t0 = time.perf_counter()
    for w, sweep, frac, policy, disk_policy, disk_writes in runs:
        reqs, ws = data[w]
        p = run_point(w.value, sweep, policy, frac, reqs, ws, args.dram_frac, disk_policy, disk_writes)
        points.append(p)
        print(
            f"[{len(points)}/{len(runs)}] {w.value} {sweep} cap={frac:g} {p.policy}: hit {100 * p.hit_rate:.2f}% "
            f"(dram {100 * p.dram_hits / p.accesses:.2f}%, disk {100 * p.disk_hits / p.accesses:.2f}%) "
            f"MIN {100 * p.belady_hits / p.accesses:.2f}% in {p.seconds:.1f}s"
            + (f", {p.disk_blocks_written} blocks written to disk" if sweep == "tiered" else ""),
            file=sys.stderr,
            flush=True,
        )
    print_table(points)
    print(f"\n{len(points)} points in {time.perf_counter() - t0:.0f}s")
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(points, args.png)
    print(f"wrote {args.png}")
    if args.json:
        args.json.write_text(json.dumps([asdict(p) | {"hit_rate": p.hit_rate} for p in points], indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
