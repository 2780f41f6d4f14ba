"""benchmarks.vs_vllm's summaries of interleaved rounds: each side's best per metric, and the ratios round by round."""

from __future__ import annotations

from benchmarks import vs_vllm


def _run(tok_s: float, prefix_ms: float, ttft: list[float]) -> dict:
    return {
        "random": {"completed": 32, "output_tok_per_s": tok_s},
        "prefix-rep": {"completed": 32, "ttft_mean_ms": prefix_ms},
        "ttft_2048_ms": ttft,
    }


def test_best_and_round_ratios() -> None:
    rows = {
        "ucm-up": {"startup_s": 10.0, "runs": [_run(160, 2000, [700, 70, 60]), _run(140, 2400, [600, 90, 80])]},
        "vllm": {"startup_s": 90.0, "runs": [_run(140, 2000, [600, 100, 110]), _run(140, 2100, [640, 120, 100])]},
    }
    best = vs_vllm.best(rows["ucm-up"])
    # throughput at its highest, latencies at their lowest, the repeated TTFT the best of a round's repeats
    assert best["random_out_tok_s"] == 160 and best["prefix_rep_ttft_mean_ms"] == 2000
    assert best["cold_ttft_ms"] == 600 and best["repeat_ttft_ms"] == 60 and best["startup_s"] == 10.0
    ratios = vs_vllm.round_ratios(rows)
    assert list(ratios) == ["ucm-up"], "vLLM is the baseline, not a row"
    assert ratios["ucm-up"]["random_out_tok_s"] == [160 / 140, 1.0]
    assert ratios["ucm-up"]["cold_ttft_ms"] == [700 / 600, 600 / 640]
    assert ratios["ucm-up"]["repeat_ttft_ms"] == [60 / 100, 80 / 100]
    assert vs_vllm.round_ratios({"ucm-up": rows["ucm-up"]}) == {}, "no vLLM row: no ratios"
