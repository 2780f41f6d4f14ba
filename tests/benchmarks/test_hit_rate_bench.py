"""A tiny run of benchmarks/hit_rate.py: sane numbers, files written, and the store really used its policy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import hit_rate
from benchmarks.traces import Workload, default_trace_path, make_workload, working_set
from ucm.eviction import LRUPolicy, PolicyName


def test_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workloads = "chat,rag" + (",mooncake" if default_trace_path().is_file() else "")
    out_json, out_png = tmp_path / "hr.json", tmp_path / "hr.png"
    rc = hit_rate.main([
        "--workloads", workloads, "--max-requests", "150", "--sample", "1", "--synthetic-requests", "120",
        "--fracs", "0.05,0.3", "--tiered-fracs", "0.2", "--dram-frac", "0.05", "--disk-writes", "behind,reused",
        "--json", str(out_json), "--png", str(out_png),
    ])  # fmt: skip
    assert rc == 0
    assert out_png.stat().st_size > 1000
    printed = capsys.readouterr()
    assert "MIN" in printed.out and "[1/" in printed.err, "table on stdout, progress on stderr"
    points = json.loads(out_json.read_text())
    n_workloads = len(workloads.split(","))
    tiered = 1 if "mooncake" in workloads else 0
    assert (
        len(points) == len(PolicyName) * 2 * n_workloads + 2 * 5 * tiered
    )  # tiered: lru, s3fifo, density, adaptive, lru/tinylfu, each writing behind and reused
    for p in points:
        total = p["dram_hits"] + p["disk_hits"]
        assert 0 <= total <= p["belady_hits"] <= p["infinite_hits"] < p["accesses"], p
        assert p["sweep"] == "tiered" or p["disk_hits"] == 0, p
        if p["sweep"] == "tiered":
            assert p["policy"].endswith("[reused]") == (p["disk_writes"] == "reused"), p
            assert p["disk_blocks_written"] > 0 or p["disk_writes"] == "reused", p
    lru = sorted((p["capacity_frac"], p["hit_rate"]) for p in points
                 if p["policy"] == "lru" and p["workload"] == "chat" and p["sweep"] == "dram")  # fmt: skip
    assert lru[0][1] <= lru[1][1], "LRU has the inclusion property: more capacity, no fewer hits"


def test_store_replay_matches_a_direct_lru_simulation() -> None:
    """The store's DRAM tier, driven by the replay, makes exactly the choices of a bare LRU policy that is told
    each request's blocks deepest first, as the tier does (ucm.chain_order)."""
    requests = make_workload(Workload.CHAT, num_requests=300, seed=1)
    ws = working_set(requests)
    point = hit_rate.run_point("chat", "dram", PolicyName.LRU, 0.1, requests, ws, 0.0)
    capacity = point.dram_blocks
    lru, hits = LRUPolicy(capacity), 0
    for request in requests:
        hit = 0
        while hit < len(request) and request[hit] in lru:
            hit += 1
        for block in reversed(request[:hit]):
            lru.touch(block)
        # The store decides at dump time which blocks it already holds (content-addressed: skip them),
        # so one evicted while the request's other blocks commit is not stored again.
        stored = [block in lru for block in request[hit:]]
        parents = [request[i - 1] if i else None for i in range(hit, len(request))]
        for block, parent, skip in reversed(list(zip(request[hit:], parents, stored))):
            if skip:
                continue
            while lru.used_bytes + 1 > capacity:  # the tier makes room first, then inserts
                lru.evict(lambda key: True)
            lru.insert(block, 1, parent)
        hits += hit
    assert point.dram_hits == hits and point.disk_hits == 0
    assert 0 < hits < point.infinite_hits
