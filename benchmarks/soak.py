"""Soak: mixed load on a whole cluster for a long time, watching for leaks (issue 11, "nothing lost").

Starts store daemon + prefill + decode + router (launch/cluster.py), warms up, takes a baseline at idle, then runs
`--concurrency` clients for `--minutes`: streaming and non-streaming completions, clients that hang up
mid-stream, and prompts sharing a few long prefixes (store and prefix-cache hits). Every `--sample-s` it records
each process's RSS (and of it, mapped file pages) and each node's free KV blocks. After the load it waits for the
cluster to go idle and compares with the baseline: free blocks must be back exactly, and each process's memory, its RSS
less file pages (the model's weights and LMDB's map are page cache the kernel may drop and refill, not a leak),
within a tolerance (the store may grow by its
DRAM tier plus the most bytes it reported holding outside it at once, `StoreStats.transit_bytes_peak`: the daemon
keeps freed memory for reuse; a node by its KV cache, whose pages are touched on first use; beyond that, growth is a
leak).

    .venv/bin/python -m benchmarks.soak --minutes 30 --out bench_out/soak     # JSON + PNG in --out
    .venv/bin/python -m benchmarks.soak --minutes 2 --sample-s 10 --out /tmp/soak

Exit status 0 when every check passed. Not part of CI by default (tests/cluster/test_soak.py runs a short one).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.prom_text import metric
from benchmarks.sse_client import StreamResult, stream_completion
from common.auth import ClientAuth
from common.size import parse_size
from launch.cluster import Cluster, ClusterSpec
from launch.topology import Topology, choose_topology
from ucm.api import StoreStats
from ucm.client import StoreClient

MODEL = "smollm2-135m"
STATS_CLIENT = "soak"  # the key this script reads the store daemon's stats with
PREFIXES = [
    (
        "You are a careful assistant for a museum. Visitors ask about exhibits, tickets, the cafe, the garden, "
        "accessibility and the gift shop; answer briefly and politely. "
    )
    * 3,
    (
        "This is the maintenance log of a wind farm: turbine ids, blade inspections, gearbox temperatures, "
        "wind speeds, downtime and spare parts ordered, one line per event. "
    )
    * 3,
]
WORDS = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "grove",
    "harbor",
    "iris",
    "jade",
    "kelp",
    "lotus",
    "maple",
    "nectar",
    "opal",
    "pine",
    "quartz",
    "reed",
]


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 30.0
    sample_s: float = 30.0
    concurrency: int = 4
    dram: str = "64MiB"
    kv_cache_memory: str = "64MiB"
    rss_rel_tol: float = 0.10  # growth allowed beyond the cache allowances, relative ...
    rss_abs_tol_mib: float = 64.0  # ... plus absolute (allocator slack, lazily imported modules)
    seed: int = 0
    # disagg: a prefill and a decode node (the store's every path); colocated: one engine, as `up` starts on a small
    # host, whose node saves only the evicted blocks that come back (connector/, ucm/reuse_admission.py)
    topology: Topology = Topology.DISAGG


@dataclass
class Sample:
    t: float
    phase: str  # baseline, load, final
    rss_mib: dict[str, float]
    file_mib: dict[str, float]  # of rss_mib, pages of mapped files (RssFile)
    free_blocks: dict[str, float]

    def memory_mib(self, name: str) -> float:
        """What the checks compare: RSS less file pages (anonymous and shared memory)."""
        return self.rss_mib.get(name, float("nan")) - self.file_mib.get(name, 0.0)


@dataclass
class Report:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)  # kind -> count
    failures: dict[str, int] = field(default_factory=dict)  # kind -> requests that did not complete as asked
    restarts: dict[str, int] = field(default_factory=dict)  # children the supervisor had to restart
    checks: dict[str, dict] = field(default_factory=dict)  # what -> {baseline, final, limit, ok}
    store_transit_peak_mib: float = 0.0  # the most the store held outside its DRAM tier at once

    @property
    def ok(self) -> bool:
        return not self.failures and not self.restarts and all(c["ok"] for c in self.checks.values())


def resident_and_file_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, RssFile) of a process in MiB, from /proc/PID/status."""
    fields = {"VmRSS": 0.0, "RssFile": 0.0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in fields:
                fields[key] = int(line.split()[1]) / 1024
    return fields["VmRSS"], fields["RssFile"]


def snapshot(cluster: Cluster, t0: float, phase: str) -> Sample:
    mem = {name: resident_and_file_mib(child.proc.pid) for name, child in dict(cluster.children).items() if child.alive}
    free: dict[str, float] = {}
    for line in httpx.get(cluster.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ucm_node_free_kv_blocks{"):
            free[line.split('node="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    rss, files = {n: m[0] for n, m in mem.items()}, {n: m[1] for n, m in mem.items()}
    return Sample(round(time.monotonic() - t0, 1), phase, rss, files, free)


def store_stats(cluster: Cluster) -> StoreStats:
    assert cluster.store_addr is not None, "the soak runs a store daemon"
    auth = ClientAuth.from_dir(cluster.keys.dir, STATS_CLIENT) if cluster.keys is not None else None
    with StoreClient(cluster.store_addr, timeout_s=10.0, retry_after_s=0.0, auth=auth) as client:
        return client.stats()


def one_request(url: str, rng: random.Random) -> tuple[str, bool]:
    """Send one request of a random kind; (kind, completed as asked)."""
    kind = rng.choice(["stream", "plain", "disconnect", "prefix", "prefix"])
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
    prompt = (rng.choice(PREFIXES) + "Question: " + words) if kind == "prefix" else f"Tell me about {words}."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(8, 32), "temperature": 0}
    if kind == "plain":
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        return kind, r.status_code == 200 and bool(r.json()["choices"][0]["finish_reason"])
    result = stream_completion(url, body, StreamResult(), stop_after_chunks=2 if kind == "disconnect" else None)
    if kind == "disconnect":
        return kind, result.status == 200 and not result.errors and result.exception is None
    return kind, result.ok


def wait_idle(cluster: Cluster, timeout_s: float = 300.0) -> None:
    """Until no node runs or queues anything and the router holds no sequence."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = httpx.get(cluster.url + "/health", timeout=10).json()["nodes"]
        if (
            all(n["running"] == 0 and n["waiting"] == 0 for n in nodes.values())
            and metric(cluster.url, "ucm_running_sequences") == 0
        ):
            time.sleep(1.0)  # one more heartbeat round, so free-block counts are the idle ones
            return
        time.sleep(0.5)
    raise RuntimeError("the cluster did not go idle")


@dataclass
class _Clients:
    threads: list[threading.Thread]

    def join_all(self) -> None:
        for t in self.threads:
            t.join()


def _run_clients(
    url: str,
    config: SoakConfig,
    counts: Counter[str],
    failures: Counter[str],
    stop_at: float | None = None,
    requests_each: int | None = None,
) -> _Clients:
    """`config.concurrency` clients sending requests back to back, until `stop_at` or `requests_each` each."""
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        sent = 0
        while (stop_at is None or time.monotonic() < stop_at) and (requests_each is None or sent < requests_each):
            sent += 1
            try:
                kind, ok = one_request(url, rng)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                kind, ok = f"transport ({type(e).__name__})", False
            with lock:
                counts[kind] += 1
                failures[kind] += not ok

    threads = [
        threading.Thread(target=client, args=(config.seed + 1 + i,), daemon=True) for i in range(config.concurrency)
    ]
    for t in threads:
        t.start()
    return _Clients(threads)


def run(config: SoakConfig, log=print) -> Report:
    report = Report(config)
    nodes = choose_topology(config.topology, None, None)  # the node counts `up --topology` starts
    spec = ClusterSpec(
        prefill=nodes.prefill,
        decode=nodes.decode,
        colocated=nodes.colocated,
        dtype="float32",
        dram=config.dram,
        kv_cache_memory=config.kv_cache_memory,
        # one engine takes the host's cores, as under `up`
        node_args=("--threads", "1") if nodes.topology is Topology.DISAGG else (),
        extra_keys=(STATS_CLIENT,),
    )
    with Cluster(spec, log=lambda s: None) as cluster:
        t0 = time.monotonic()
        # Warm-up, as concurrent as the load: prefixes reach the store, allocator pools and code paths settle.
        _run_clients(cluster.url, config, Counter(), Counter(), requests_each=3).join_all()
        wait_idle(cluster)
        baseline = snapshot(cluster, t0, "baseline")
        report.samples.append(baseline)
        log(
            f"[soak] baseline RSS MiB {baseline.rss_mib}, of it file pages {baseline.file_mib}, "
            f"free blocks {baseline.free_blocks}"
        )
        counts: Counter[str] = Counter()
        failures: Counter[str] = Counter()
        stop_at = time.monotonic() + config.minutes * 60
        clients = _run_clients(cluster.url, config, counts, failures, stop_at=stop_at)
        while (left := stop_at - time.monotonic()) > 0:
            time.sleep(min(config.sample_s, left))  # the sampling period itself
            if time.monotonic() < stop_at:
                sample = snapshot(cluster, t0, "load")
                report.samples.append(sample)
                log(
                    f"[soak] t={sample.t:.0f}s requests {sum(counts.values())} RSS MiB "
                    f"{ {k: round(v) for k, v in sample.rss_mib.items()} } (file pages "
                    f"{ {k: round(v) for k, v in sample.file_mib.items()} }) free {sample.free_blocks}"
                )
        clients.join_all()
        wait_idle(cluster)
        final = snapshot(cluster, t0, "final")
        report.samples.append(final)
        report.requests = dict(counts)
        report.failures = {k: v for k, v in failures.items() if v}
        supervisor = getattr(cluster, "supervisor", None)
        report.restarts = {k: v for k, v in getattr(supervisor, "restarts", {}).items() if v}
        report.store_transit_peak_mib = round(store_stats(cluster).transit_bytes_peak / 2**20, 1)
        allowances = {"store": parse_size(config.dram) / 2**20 + report.store_transit_peak_mib}
        for name in cluster.node_names():
            allowances[name] = parse_size(config.kv_cache_memory) / 2**20
        for name in baseline.rss_mib:
            base, end = baseline.memory_mib(name), final.memory_mib(name)
            limit = base * (1 + config.rss_rel_tol) + config.rss_abs_tol_mib + allowances.get(name, 0.0)
            report.checks[f"rss less file pages {name}"] = {
                "baseline": round(base, 1),
                "final": round(end, 1),
                "limit": round(limit, 1),
                "ok": end <= limit,
            }
        for node, base in baseline.free_blocks.items():
            end = final.free_blocks.get(node, float("nan"))
            report.checks[f"free blocks {node}"] = {"baseline": base, "final": end, "limit": base, "ok": end == base}
    return report


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    names = sorted({n for s in report.samples for n in s.rss_mib})
    for name in names:
        pts = [(s.t, s.rss_mib[name], s.memory_mib(name)) for s in report.samples if name in s.rss_mib]
        (line,) = top.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
        top.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--", color=line.get_color())
    top.set_ylabel("RSS (MiB; dashed: less file pages)")
    top.legend(fontsize=8)
    top.set_title(
        f"soak: {report.config.minutes:g} min, {sum(report.requests.values())} requests, "
        f"{'OK' if report.ok else 'FAILED'}"
    )
    nodes = sorted({n for s in report.samples for n in s.free_blocks})
    for node in nodes:
        pts = [(s.t, s.free_blocks[node]) for s in report.samples if node in s.free_blocks]
        bottom.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=node)
    bottom.set_ylabel("free KV blocks")
    bottom.set_xlabel("seconds since start")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    ap.add_argument("--minutes", type=float, default=d.minutes)
    ap.add_argument("--sample-s", type=float, default=d.sample_s)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument(
        "--dram",
        default=d.dram,
        help="store DRAM tier (the store's RSS may grow by this, plus what it held in transit at most)",
    )
    ap.add_argument("--kv-cache-memory", default=d.kv_cache_memory)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--topology",
        type=Topology,
        default=d.topology,
        choices=[Topology.DISAGG, Topology.COLOCATED],
        metavar="{disagg,colocated}",
        help=f"the nodes under load (default: {d.topology.value})",
    )
    ap.add_argument("--out", type=Path, default=Path("bench_out/soak"), help="folder for soak.json and soak.png")
    args = ap.parse_args(argv)
    config = SoakConfig(
        minutes=args.minutes,
        sample_s=args.sample_s,
        concurrency=args.concurrency,
        dram=args.dram,
        kv_cache_memory=args.kv_cache_memory,
        seed=args.seed,
        topology=args.topology,
    )
    report = run(config)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(
        json.dumps({**asdict(report), "ok": report.ok}, indent=2, default=lambda o: o.value)  # enums by value
    )
    plot(report, args.out / "soak.png")
    print(f"requests {report.requests}; failures {report.failures or 'none'}; restarts {report.restarts or 'none'}")
    print(f"the store held at most {report.store_transit_peak_mib} MiB outside its DRAM tier at once")
    for what, check in report.checks.items():
        print(
            f"{'ok  ' if check['ok'] else 'FAIL'} {what}: baseline {check['baseline']} -> final {check['final']} "
            f"(limit {check['limit']})"
        )
    print(f"wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
