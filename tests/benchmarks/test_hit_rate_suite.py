"""The eviction-policy suite: held-out traces that are what they claim, and a tiny run of the whole judgement,
the real daemon's replay included."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import hit_rate_suite
from benchmarks.trace_suite import SYNTHETIC_BLOCK_TOKENS, TraceName, azure_rows, conversation_half, generated
from benchmarks.traces import default_trace_path

needs_traces = pytest.mark.skipif(not default_trace_path().is_file(), reason="../shared/data/traces not present")


@needs_traces
def test_conversation_halves_split_by_conversation() -> None:
    tune, hold = conversation_half(TraceName.CONV_TUNE), conversation_half(TraceName.CONV_HOLDOUT)
    lines = sum(1 for _ in default_trace_path().open())
    assert len(tune.requests) + len(hold.requests) == lines
    # Every turn of a conversation (same block after the system prompt) sits in one half only.
    seconds = [{r.hash_ids[1] for r in t.requests if len(r.hash_ids) > 1} for t in (tune, hold)]
    assert seconds[0] and seconds[1] and not seconds[0] & seconds[1]
    assert not tune.name.held_out and hold.name.held_out


@needs_traces
@pytest.mark.parametrize("name", [TraceName.AZURE_CHAT, TraceName.AZURE_RAG, TraceName.AZURE_AGENT])
def test_generated_traces_keep_azure_arrivals_and_lengths(name: TraceName) -> None:
    trace = generated(name)
    rows = azure_rows("code" if name is TraceName.AZURE_AGENT else "conv")
    assert [(r.timestamp_ms, r.input_length, r.output_length) for r in trace.requests] == [
        (r.timestamp_ms, r.context_tokens, r.generated_tokens) for r in rows
    ]
    parents: dict[int, int] = {}
    for r in trace.requests:
        assert len(r.hash_ids) == math.ceil(r.input_length / SYNTHETIC_BLOCK_TOKENS)
        for parent, child in zip([-1, *r.hash_ids], r.hash_ids, strict=False):
            assert parents.setdefault(child, parent) == parent, "a block id always follows the same parent"
    assert generated(name).requests == trace.requests, "seeded: the same trace every time"
    blocks = trace.full_blocks()
    accesses, distinct = sum(map(len, blocks)), len({b for r in blocks for b in r})
    assert 0.2 < 1 - distinct / accesses < 0.9, "some reuse, not all of it"


@needs_traces
def test_tiny_suite_run_and_daemon_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "suite.json"
    rc = hit_rate_suite.main([
        "--traces", "conv-tune,azure-agent", "--policies", "lru,gdsf,density", "--fracs", "0.02,0.1",
        "--candidate", "density", "--max-requests", "600", "--jobs", "1", "--daemon-check", "azure-agent@0.02",
        "--json", str(out), "--png", str(tmp_path / "suite.png"),
    ])  # fmt: skip
    assert rc == 0 and (tmp_path / "suite.png").stat().st_size > 1000
    result = json.loads(out.read_text())
    points = result["points"]
    assert len(points) == 2 * 3 * 2
    for p in points:
        assert 0 <= p["dram_hits"] <= p["belady_hits"] <= p["infinite_hits"] <= p["accesses"], p
    gaps = result["verdict"]["gap_closed"]
    assert gaps["conv-tune"]["lru"] == 0.0 and set(gaps) == {"conv-tune", "azure-agent"}
    check = result["verdict"]["daemon_check"]
    assert check["daemon"] == check["in_process"], "the daemon runs the same store: the same hits, to the block"
    printed = capsys.readouterr().out
    assert "held-out mean" in printed and "daemon replay of azure-agent" in printed and "dram" in printed
