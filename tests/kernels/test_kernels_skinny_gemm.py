"""The skinny fp32 GEMM (ucm_kernels/cpu/skinny_gemm.c) against F.linear, and its dispatch in `engine.models.dense`:
the row counts the calibration names go to the kernel, the others to F.linear, the choice is cached per machine,
and a model run either way gives the same greedy text. No timing asserts: `skinny_gemm.measure` is replaced by
fixed numbers wherever a choice is tested."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import dense as dense_mod
from ucm_kernels.cpu import skinny_gemm
from ucm_kernels.cpu.skinny_gemm import ROW_LADDER, PanelWeight, pack_panels, skinny_linear


@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [(1, 576, 960, False), (3, 64, 17, True), (8, 1536, 576, False), (13, 100, 48, True), (64, 576, 3072, True)],
)
def test_matches_f_linear(each_build, m, k, n, bias) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = skinny_linear(each_build, x, pack_panels(each_build, w), n, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    # fp32 sums of k products, in another order than the BLAS: a few ulps of the sum of |products|.
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T).max()
    assert got.shape == (m, n)
    assert (got - want).abs().max() <= bound


def test_non_contiguous_input_and_bad_arguments(native_lib) -> None:
    w = torch.randn(32, 16)
    x = torch.randn(16, 5).T  # [5, 16], not contiguous
    torch.testing.assert_close(skinny_linear(native_lib, x, pack_panels(native_lib, w), 32, None), F.linear(x, w))
    with pytest.raises(ValueError, match="fp32"):
        pack_panels(native_lib, w.bfloat16())
    with pytest.raises(ValueError, match="not 33 x 16"):
        skinny_linear(native_lib, x, pack_panels(native_lib, w), 33, None)


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """UCM_CPU_LINEAR=auto, a fresh cache dir, and `measure` replaced: returns `set(win_up_to)`, making the kernel
    win at row counts <= win_up_to, and the list of (k, n) measured."""
    monkeypatch.setenv("UCM_CPU_LINEAR", "auto")
    cache = tmp_path / "cache"
    monkeypatch.setenv("UCM_CACHE_DIR", str(cache))
    skinny_gemm.forget()
    state = {"up_to": 8}
    measured: list[tuple[int, int]] = []

    def fake_measure(lib, k, n, fmt=None):
        measured.append((k, n))
        return [{r: (1.0, 2.0) if r <= state["up_to"] else (2.0, 1.0) for r in ROW_LADDER}] * 2

    monkeypatch.setattr(skinny_gemm, "measure", fake_measure)
    monkeypatch.setattr(skinny_gemm, "MIN_PACK_BYTES", 0)  # the tests' weights are small

    def set_up_to(rows: int) -> list[tuple[int, int]]:
        skinny_gemm.forget()
        for stored in cache.glob("kernels/linear-*.json"):
            stored.unlink()
        state["up_to"] = rows
        measured.clear()
        return measured

    yield set_up_to
    skinny_gemm.forget()


def test_dispatch_follows_the_calibration(native_lib, forced, monkeypatch) -> None:
    measured = forced(16)
    w = torch.randn(48, 32)
    packed = dense_mod.pack_weight(w)
    assert isinstance(packed, dense_mod.F32Packed) and isinstance(packed.panels, PanelWeight)
    assert packed.panels.max_rows == 16 and packed.onednn is None, "a cache-sized weight: no oneDNN copy"
    assert measured == [(32, 48)]
    calls: list[int] = []
    real = PanelWeight.linear
    monkeypatch.setattr(PanelWeight, "linear", lambda self, x, b: calls.append(x.shape[0]) or real(self, x, b))
    for rows in (1, 16, 17, 200):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(dense_mod.dense(x, w, None, packed), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert calls == [1, 16], "rows past the calibrated count go to F.linear"
    # Cached per machine: a new process (no memo) reads the file instead of measuring.
    skinny_gemm.forget()
    assert dense_mod.pack_weight(w).panels.max_rows == 16 and measured == [(32, 48)]
    (stored,) = (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json")
    entries = json.loads(stored.read_text())["entries"]
    assert list(entries) == ["fp32 48x32"] and entries["fp32 48x32"]["max_rows"] == 16, entries


def test_never_faster_means_no_packed_copy(native_lib, forced, monkeypatch) -> None:
    forced(0)
    assert dense_mod.pack_weight(torch.randn(48, 32)) is None, "no memory spent where the kernel never wins"
    measured = forced(128)
    monkeypatch.setattr(skinny_gemm, "MIN_PACK_BYTES", 48 * 32 * 4 + 1)
    assert dense_mod.pack_weight(torch.randn(48, 32)) is None and measured == [], "a cache-sized weight: not measured"
    monkeypatch.setattr(skinny_gemm, "MIN_PACK_BYTES", 0)
    monkeypatch.setenv("UCM_CPU_LINEAR", "torch")
    forced(128)
    packed: list[object] = []
    real_pack_q4 = skinny_gemm.pack_q4
    monkeypatch.setattr(skinny_gemm, "pack_q4", lambda w: packed.append(w))  # start-up work the mode makes moot
    assert dense_mod.pack_weight(torch.randn(48, 32)) is None
    assert packed == [], "with the kernel off, no weight is looked at for 4-bit values"
    monkeypatch.setattr(skinny_gemm, "pack_q4", real_pack_q4)
    monkeypatch.setenv("UCM_CPU_LINEAR", "native")
    assert dense_mod.pack_weight(torch.randn(48, 32)).panels.max_rows == ROW_LADDER[-1]
    monkeypatch.setenv("UCM_CPU_LINEAR", "fastest")
    with pytest.raises(ValueError, match="UCM_CPU_LINEAR"):
        dense_mod.pack_weight(torch.randn(48, 32))


def test_greedy_text_is_the_same_either_way(monkeypatch, tmp_path) -> None:
    """The embedded model, fp32, greedy: decode steps through the kernel (forced on; its layers are exactly 4-bit,
    so the 4-bit panels) and through F.linear (forced off) give the same tokens."""
    from engine import LLM, SamplingParams

    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    params = SamplingParams(max_tokens=24, temperature=0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    calls: list[int] = []
    real = skinny_gemm.skinny_linear_q4
    monkeypatch.setattr(
        skinny_gemm, "skinny_linear_q4", lambda lib, x, *a: calls.append(x.shape[0]) or real(lib, x, *a)
    )
    outs = {}
    for mode in ("native", "torch"):
        monkeypatch.setenv("UCM_CPU_LINEAR", mode)
        skinny_gemm.forget()
        calls.clear()
        llm = LLM(model="smollm2-135m", dtype="float32")
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert bool(calls) == (mode == "native"), f"{mode}: {len(calls)} 4-bit kernel calls"
        del llm
    assert outs["native"] == outs["torch"]


def test_disagreeing_rounds_are_stored_as_provisional_and_say_where(native_lib, forced, monkeypatch, caplog) -> None:
    forced(16)
    rounds = [{r: (1.0, 2.0) if r <= up_to else (2.0, 1.0) for r in ROW_LADDER} for up_to in (8, 16)]
    monkeypatch.setattr(skinny_gemm, "measure", lambda lib, k, n, fmt=None: rounds)
    with caplog.at_level("INFO", logger="ucm_kernels.cpu.skinny_gemm"):
        assert dense_mod.pack_weight(torch.randn(48, 32)).panels.max_rows == 8, "the smaller answer of the two"
    assert "rounds disagreed on rows 8 vs 16" in caplog.text and "stored as provisional" in caplog.text
    (path,) = (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json")
    data = json.loads(path.read_text())
    assert not data["entries"] and [e["max_rows"] for e in data["provisional"].values()] == [8], data


@pytest.mark.parametrize(("kernel_ms", "won"), [(1.0, ROW_LADDER[-1]), (2.0, 0)])
def test_the_kernel_must_beat_the_best_alternative(native_lib, monkeypatch, tmp_path, kernel_ms, won) -> None:
    """The calibration times the kernel, F.linear and (where available) oneDNN on a reordered weight; the kernel
    takes a row count only when it beats the fastest of the others (timings replaced: F.linear 3 ms, oneDNN 1.5)."""
    from ucm_kernels.cpu import onednn_linear

    if not onednn_linear.available():
        pytest.skip("no oneDNN in this torch build: F.linear is the only alternative")
    monkeypatch.setenv("UCM_CPU_LINEAR", "auto")
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(skinny_gemm, "MIN_PACK_BYTES", 0)
    timed: list[int] = []

    def fake_best(runs, reps, seconds=float("inf")):
        timed.append(len(runs))
        for run in runs:  # each path still runs: a broken one would raise here
            run()
        return [kernel_ms, 3.0, 1.5][: len(runs)]

    monkeypatch.setattr(skinny_gemm, "alternating_best_ms", fake_best)
    skinny_gemm.forget()
    try:
        assert skinny_gemm.max_rows(native_lib, 32, 48) == won
    finally:
        skinny_gemm.forget()
    assert timed and set(timed) == {3}, "kernel, F.linear and oneDNN in every timing"


def test_one_close_loss_at_one_row_does_not_give_up_the_rows_it_wins(native_lib, forced, monkeypatch) -> None:
    """The kernel up to where its summed saving over the ladder peaks: a 1-row loss by 8% before wins of 5-40% at
    4 to 32 rows keeps those (it once stored 0 rows, the ladder stopping at its first loss); losses from 64 rows on
    end the range; a kernel that loses everywhere gets none."""
    forced(0)
    close = {1: (1.3, 1.2), 4: (1.4, 1.9), 8: (2.0, 2.4), 16: (3.1, 3.5), 32: (5.5, 5.8), 64: (10.0, 9.9),
             128: (19.5, 18.6)}  # fmt: skip
    monkeypatch.setattr(skinny_gemm, "measure", lambda lib, k, n, fmt=None: [close, close])
    assert skinny_gemm.max_rows(native_lib, 32, 48) == 32
    skinny_gemm.forget()
    slower = dict.fromkeys(ROW_LADDER[:2], (2.0, 1.0))  # the ladder stops after two losses in a row
    monkeypatch.setattr(skinny_gemm, "measure", lambda lib, k, n, fmt=None: [slower, slower])
    for stored in (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json"):
        stored.unlink()
    assert skinny_gemm.max_rows(native_lib, 32, 48) == 0


def test_the_ladder_stops_after_two_losses_in_a_row(native_lib, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("UCM_CPU_LINEAR", "auto")
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    # kernel ms per call by rows: loses at 1, wins at 4, loses at 8 and 16 (stop); 32 on is never timed
    kernel = {1: 2.0, 4: 1.0, 8: 2.0, 16: 2.0}
    timed: list[int] = []

    def fake_best(runs, reps, seconds=float("inf")):
        rows = len(timed) % 4
        timed.append(rows)
        return [kernel[ROW_LADDER[rows]], *[1.5] * (len(runs) - 1)]

    monkeypatch.setattr(skinny_gemm, "alternating_best_ms", fake_best)
    monkeypatch.setattr(skinny_gemm, "_runs", lambda lib, x, weights, packed: [lambda: None] * 3)
    rounds = skinny_gemm.measure(native_lib, 32, 48)
    assert [sorted(t) for t in rounds] == [[1, 4, 8, 16]] * len(rounds), rounds


def test_the_ladder_measures_a_decode_steps_rows_before_it_stops(native_lib, monkeypatch, tmp_path) -> None:
    """Losses at 1 and 4 rows do not end the ladder before 16 (MIN_LADDER_ROWS): the kernel that wins 8 and 16 is
    kept there, and the stored entry keeps the timings it was chosen from."""
    monkeypatch.setenv("UCM_CPU_LINEAR", "auto")
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    kernel = {1: 1.6, 4: 1.6, 8: 1.0, 16: 1.0, 32: 2.0, 64: 2.0}
    timed: list[int] = []

    def fake_best(runs, reps, seconds=float("inf")):
        rows = ROW_LADDER[len(timed) % 6]
        timed.append(rows)
        return [kernel[rows], *[1.5] * (len(runs) - 1)]

    monkeypatch.setattr(skinny_gemm, "alternating_best_ms", fake_best)
    monkeypatch.setattr(skinny_gemm, "_runs", lambda lib, x, weights, packed: [lambda: None] * 3)
    assert skinny_gemm.max_rows(native_lib, 512, 512) == 16  # 1 MB: large enough to be measured
    assert timed[:6] == [1, 4, 8, 16, 32, 64], timed
    (stored,) = (tmp_path / "cache" / "kernels").glob("linear-*.json")
    entry = json.loads(stored.read_text())["entries"]["fp32 512x512"]
    assert entry["max_rows"] == 16 and "16: 1.0 vs 1.5 ms" in entry["measured"], entry


@pytest.mark.parametrize("build", ["each", "scalar"])
@pytest.mark.parametrize(
    ("fmt", "k", "n"),
    [("fp32", 600, 100), ("fp32", 64, 17), ("q4", 576, 48), ("q4", 1536, 40), ("q8", 576, 56)],
)
def test_each_row_gets_the_bits_of_a_one_row_call(request, build, fmt, k, n) -> None:
    """Under 12 rows (24 for 8-bit panels) a call runs up to three 4-row tiles over each 128-k chunk of a panel (a
    4- or 8-bit chunk expanded by each tile as it goes, or first, in the scalar build), their sums parked between
    chunks; from there the blocked loop (x packed per call, a quantized chunk expanded first, k in chunks, rows in
    blocks of 144). Either way each row gets the floats a call of that row alone gets (the same sums in the
    same k order), for fp32, 4-bit and 8-bit panels, a bias, partial tiles, a partial last panel and k chunks of
    unequal length; and F.linear's result within fp32 rounding."""
    from ucm_kernels.cpu.q4_panels import pack_q4, random_q4_weight, skinny_linear_q4
    from ucm_kernels.cpu.q8_panels import pack_q8, random_q8_weight, skinny_linear_q8

    lib = request.getfixturevalue("scalar_lib" if build == "scalar" else "native_lib")
    gen = torch.Generator().manual_seed(k + n)
    if fmt == "q4":
        w = random_q4_weight(n, k, gen)
        panels, run = pack_q4(w), skinny_linear_q4
    elif fmt == "q8":
        w = random_q8_weight(n, k, gen)
        panels, run = pack_q8(w), skinny_linear_q8
    else:
        w = torch.randn(n, k, generator=gen)
        panels, run = pack_panels(lib, w), skinny_linear
    assert panels is not None, f"a random {fmt} weight packs as {fmt}"
    bias = torch.randn(n, generator=gen)
    x = torch.randn(300, k, generator=gen)
    for m, b in ((1, bias), (5, bias), (11, None), (12, None), (16, bias), (25, bias), (150, None), (300, bias)):
        got = run(lib, x[:m], panels, n, b)
        alone = torch.cat([run(lib, x[i : i + 1], panels, n, b) for i in range(m)])
        assert torch.equal(got, alone), f"{m} rows: max diff {(got - alone).abs().max()}"
        want = F.linear(x[:m].double(), w.double(), None if b is None else b.double()).float()
        bound = 4 * k * torch.finfo(torch.float32).eps * (x[:m].abs() @ w.abs().T).max()
        assert (got - want).abs().max() <= bound
