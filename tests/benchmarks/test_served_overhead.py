"""A tiny run of benchmarks/served_overhead.py: a real `ucm-serve up` and a real in-process engine take turns, and
the served greedy texts equal the in-process ones in every round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_rounds_alternate_on_new_prompts_and_agree(tmp_path: Path) -> None:
    out = tmp_path / "so.json"
    argv = [
        sys.executable, "-m", "benchmarks.served_overhead", "--num-prompts", "3", "--input-len", "40",
        "--output-len", "4", "--rounds", "2", "--max-num-seqs", "2", "--kv-cache-memory", "64MiB",
        "--port", str(free_port()), "--out-dir", str(tmp_path / "logs"), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rounds = result["rounds"]
    assert len(rounds) == 2 and result["identical"], rounds
    for r in rounds:
        assert r["served_summary"]["completed"] == 3 and r["served_summary"]["failed"] == 0, r
        assert r["served_wall_s"] > 0 and r["offline_wall_s"] > 0 and r["offline_cpu_s"] > 0, r
        assert r["offline_ttft_mean_ms"] <= r["offline_wall_s"] * 1e3, "a first token comes before the last"
        assert 0 < r["served_summary"]["ttft_ms"]["mean"] <= r["served_wall_s"] * 1e3, r
    ratios = sorted(r["ratio"] for r in rounds)
    assert result["ratio"] == pytest.approx((ratios[0] + ratios[1]) / 2), "the median of the rounds' ratios"
    assert "median of 2 rounds" in proc.stdout
