"""A short soak (benchmarks/soak.py): mixed load (streaming, non-streaming, clients hanging up, shared prefixes)
on a whole cluster, then every node's free KV blocks are back to the idle baseline exactly and every process's
memory within the soak's tolerance; nothing failed, nothing was restarted. Both topologies: a prefill/decode pair,
and the one engine `up` starts on a small host, whose saves and disk writes act only on reuse. The long run is
`--minutes 30`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not an installed package

from benchmarks.soak import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("topology", ["disagg", "colocated"])  # colocated: what `up` starts on a small host
def test_soak_returns_to_baseline(tmp_path, topology: str) -> None:
    argv = ["--minutes", "1", "--sample-s", "10", "--concurrency", "3", "--topology", topology, "--out", str(tmp_path)]
    code = main(argv)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").stat().st_size > 0
    assert not report["failures"] and not report["restarts"], report
    assert {"stream", "plain", "disconnect", "prefix"} <= set(report["requests"]), report["requests"]
    failed = {what: check for what, check in report["checks"].items() if not check["ok"]}
    assert not failed, failed
    assert any(what.startswith("free blocks") for what in report["checks"])
    assert len([s for s in report["samples"] if s["phase"] == "load"]) >= 3
    assert code == 0
