"""benchmarks.vs_vllm_ceiling's arithmetic: the random workload's floor counted wave by wave, the slower of reading
and computing per decode step, the fractions of the limits a figure and a target mean, and the whole report from the
two JSON files it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import vs_vllm_ceiling as ceiling
from benchmarks.roofline import kv_bytes, prefill_flops, weight_bytes
from benchmarks.vs_vllm_workloads import RandomShape
from engine.step_budget import linear_flops_per_token
from tests.benchmarks.test_prefix_floor import MC  # the same tiny Llama shape

SHAPE = RandomShape(prompts=6, prompt_len=8, out_len=3, concurrency=4)  # 2 waves (the second not full), 2 decodes


def test_the_random_floor_is_each_waves_prefill_then_its_decode_steps() -> None:
    limits = ceiling.Limits(matmul=1e9, read=1e6)  # reading is slow: every decode step is bound by its bytes
    step = [(weight_bytes(MC, 2) + 4 * kv_bytes(MC, 8 + i, 2)) / 1e6 for i in (1, 2)]
    wave = 4 * prefill_flops(MC, 8) / 1e9 + sum(step)
    assert ceiling.random_s(MC, SHAPE, limits, 2) == pytest.approx(2 * wave)
    assert ceiling.random_tok_s(MC, SHAPE, limits, 2) == pytest.approx(6 * 3 / (2 * wave))


def test_a_decode_step_that_computes_longer_than_it_reads_counts_its_compute() -> None:
    limits = ceiling.Limits(matmul=1e6, read=1e15)
    compute = 4 * (linear_flops_per_token(MC) + 2 * MC.vocab_size * MC.hidden_size) / 1e6
    prefill = 4 * prefill_flops(MC, 8) / 1e6
    assert ceiling.random_s(MC, SHAPE, limits, 2) == pytest.approx(2 * (prefill + 2 * compute))


def test_slower_kernels_give_a_lower_ceiling() -> None:
    limits = ceiling.Limits(2e12, 30e9, prefill_fraction=0.8, decode_fraction=0.7)
    engine = limits.at_engine()
    assert (engine.matmul, engine.read) == (pytest.approx(1.6e12), pytest.approx(21e9))
    assert ceiling.random_tok_s(MC, SHAPE, engine, 2) < ceiling.random_tok_s(MC, SHAPE, limits, 2)
    assert ceiling.cold_ms(MC, 64, engine) == pytest.approx(ceiling.cold_ms(MC, 64, limits) / 0.8)


def test_fractions_of_the_limits_for_both_directions() -> None:
    faster = ceiling.Row("random_out_tok_s", "higher", 1.3, vllm=50.0, ucm=40.0, floor=100.0, at_engine=None)
    assert (faster.of_limits(50.0), faster.of_limits(40.0), faster.needs) == (0.5, 0.4, pytest.approx(0.65))
    assert faster.reachable
    slower = ceiling.Row("cold_ttft_ms", "lower", 0.8, vllm=1000.0, ucm=900.0, floor=900.0, at_engine=None)
    assert slower.needs == pytest.approx(900 / 800) and not slower.reachable, "the floor itself misses 800 ms"
    assert slower.of_limits(900.0) == 1.0


def test_the_report_reads_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vs = {
        "model": "llama-1b",
        "cpu": {"model": "Test CPU", "cores": 2},
        "vllm_dtype": "bfloat16",
        "targets": {"random_out_tok_s": ["higher", 1.3], "cold_ttft_ms": ["lower", 0.8]},
        "table": {"vllm": {"random_out_tok_s": 40.0, "cold_ttft_ms": 3000.0}, "ucm-up": {"random_out_tok_s": 42.0}},
    }
    roof = {
        "dtype": "bfloat16",
        "read_gbs": 30.0,
        "models": {"llama-1b": {"matmul_gflops": {"bfloat16": 2000.0, "float32": 400.0}}},
        "rows": [
            # Each 0.9 of the limit of its own seconds: the ceiling takes the rates against the run's limits, the
            # widest batch's (the lowest) for decode
            {"model": "llama-1b", "phase": "prefill 1536", "fraction": 0.9, "rate": 1.6e12},
            {"model": "llama-1b", "phase": "decode b1", "fraction": 0.9, "rate": 27e9},
            {"model": "llama-1b", "phase": "decode b8", "fraction": 0.9, "rate": 21e9},
        ],
    }
    (tmp_path / "vs.json").write_text(json.dumps(vs))
    (tmp_path / "roof.json").write_text(json.dumps(roof))
    out = tmp_path / "out.json"
    argv = ["--vs-vllm", str(tmp_path / "vs.json"), "--roofline", str(tmp_path / "roof.json"), "--json", str(out)]
    assert ceiling.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["limits"] == {"matmul": 2e12, "read": 30e9, "prefill_fraction": 1.0, "decode_fraction": 1.0}
    assert result["engine"]["matmul"] == pytest.approx(1.6e12) and result["engine"]["read"] == pytest.approx(21e9)
    rows = {r["metric"]: r for r in result["rows"]}
    assert set(rows) == {"random_out_tok_s", "cold_ttft_ms"} and rows["cold_ttft_ms"]["ucm"] is None
    assert rows["random_out_tok_s"]["at_engine"] < rows["random_out_tok_s"]["floor"]
    printed = capsys.readouterr().out
    assert "| random_out_tok_s | 40.0 | 42.0 |" in printed and "of limits" in printed


def test_only_a_yardstick_model_has_a_ceiling(tmp_path: Path) -> None:
    (tmp_path / "vs.json").write_text(json.dumps({"model": "embedded"}))
    with pytest.raises(ValueError, match="unknown yardstick shape"):
        ceiling.main(["--vs-vllm", str(tmp_path / "vs.json")])
