"""oneDNN fp32 linear (ucm_kernels/cpu/onednn_linear.py) against F.linear, and its dispatch in `engine.models.dense`:
prefill-sized row counts, and each few-row class apart, go to oneDNN only for weight shapes where it measured faster,
the choices are cached per machine, and `UCM_CPU_LINEAR=torch` turns it off. No timing asserts: `measure` and
`measure_few` are replaced by fixed numbers wherever a choice is tested."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import dense as dense_mod
from engine.models.mlp import GatedMLP
from ucm_kernels.cpu import onednn_linear, skinny_gemm
from ucm_kernels.cpu.skinny_gemm import ROW_LADDER

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize(("m", "k", "n", "bias"), [(1, 576, 960, False), (300, 576, 3072, True), (17, 100, 48, True)])
def test_matches_f_linear(m, k, n, bias) -> None:
    gen = torch.Generator().manual_seed(m + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = onednn_linear.linear(x, onednn_linear.reorder(w), b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T).max()
    assert got.shape == (m, n) and (got - want).abs().max() <= bound
    with pytest.raises(ValueError, match="fp32"):
        onednn_linear.reorder(w.bfloat16())


FEW: list[dict[int, tuple[float, float]]] = []  # measure_few's rounds while `forced` is in use
FEW_MEASURED: list[tuple[int, int]] = []


def _skinny_kernel_loses(monkeypatch) -> None:
    """The skinny kernel measured slower at every row count: no panels, every call oneDNN's or F.linear's."""
    monkeypatch.setattr(skinny_gemm, "measure", lambda lib, k, n, fmt=None: [dict.fromkeys(ROW_LADDER, (2.0, 1.0))] * 2)


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """UCM_CPU_LINEAR=auto, a fresh cache dir, the skinny kernel winning up to 8 rows, oneDNN's `measure` replaced by
    the rounds in `rounds` (oneDNN ms, F.linear ms) and `measure_few` by oneDNN winning every few-row class (tests
    set `FEW` otherwise); returns (rounds, the (k, n) measured)."""
    monkeypatch.setenv("UCM_CPU_LINEAR", "auto")
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path / "cache"))
    skinny_gemm.forget()
    onednn_linear.forget()
    monkeypatch.setattr(skinny_gemm, "MIN_PACK_BYTES", 0)
    monkeypatch.setattr(onednn_linear, "MIN_PACK_BYTES", 0)
    monkeypatch.setattr(
        skinny_gemm,
        "measure",
        lambda lib, k, n, fmt=None: [{r: (1.0, 2.0) if r <= 8 else (2.0, 1.0) for r in ROW_LADDER}] * 2,
    )
    rounds = [(1.0, 2.0), (1.0, 2.0)]
    measured: list[tuple[int, int]] = []
    monkeypatch.setattr(onednn_linear, "measure", lambda k, n: measured.append((k, n)) or list(rounds))
    FEW[:] = [dict.fromkeys(onednn_linear.FEW_ROWS, (1.0, 2.0))] * 2
    monkeypatch.setattr(onednn_linear, "measure_few", lambda k, n: FEW_MEASURED.append((k, n)) or list(FEW))
    FEW_MEASURED.clear()
    yield rounds, measured
    skinny_gemm.forget()
    onednn_linear.forget()


def test_dispatch_follows_the_calibration(native_lib, forced, monkeypatch) -> None:
    _, measured = forced
    w = torch.randn(48, 32)
    packed = dense_mod.pack_weight(w)
    assert isinstance(packed, dense_mod.F32Packed) and packed.onednn is not None and packed.panels is not None
    assert measured == [(32, 48)]
    calls: list[int] = []
    real = onednn_linear.linear
    monkeypatch.setattr(onednn_linear, "linear", lambda x, r, b: calls.append(x.shape[0]) or real(x, r, b))
    for rows in (1, 8, 9, 200):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(dense_mod.dense(x, w, None, packed), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert calls == [9, 200], "rows past the skinny kernel's count go to oneDNN, fewer to the kernel"
    # Cached per machine: a new process (no memo) reads the file instead of measuring.
    onednn_linear.forget()
    assert dense_mod.pack_weight(w).onednn is not None and measured == [(32, 48)]
    (stored,) = (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json")
    assert json.loads(stored.read_text())["entries"]["onednn fp32 48x32"] == {"onednn": True}


def test_a_wide_weight_is_measured_at_fewer_rows() -> None:
    assert onednn_linear.measured_rows(576, 3072) == onednn_linear.ROWS
    assert 16 <= onednn_linear.measured_rows(576, 49152) < 64, "lm_head: a few dozen rows, a short start-up"
    assert onednn_linear.measured_rows(4096, 128256) == 16


def test_no_copy_where_it_lost_disagreed_or_is_off(native_lib, forced, monkeypatch) -> None:
    rounds, measured = forced
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]
    FEW[:] = [dict.fromkeys(onednn_linear.FEW_ROWS, (2.0, 1.0))] * 2
    assert dense_mod.pack_weight(torch.randn(48, 32)).onednn is None, "no memory spent where F.linear wins"
    rounds[:] = [(1.0, 2.0), (2.0, 1.0)]
    assert dense_mod.pack_weight(torch.randn(40, 32)).onednn is None, "rounds that disagree: F.linear"
    onednn_linear.forget()
    dense_mod.pack_weight(torch.randn(40, 32))
    assert measured.count((32, 40)) == 1, "a disagreement is stored as provisional: the next process takes it"
    monkeypatch.setenv("UCM_CPU_LINEAR", "torch")
    measured.clear()
    assert dense_mod.pack_weight(torch.randn(56, 32)) is None and measured == []


def test_few_row_classes_choose_apart(native_lib, forced, monkeypatch) -> None:
    """The skinny kernel losing everywhere (as on the Xeon with AMX in fp32): 1 and 32 rows measured faster through
    F.linear, 8 rows and prefill-sized calls through oneDNN; each call takes its class's path, and the classes are
    stored for the next process."""
    _skinny_kernel_loses(monkeypatch)
    FEW[:] = [{1: (2.0, 1.0), 8: (1.0, 2.0), 32: (2.0, 1.0)}] * 2
    w = torch.randn(64, 32)
    packed = dense_mod.pack_weight(w)
    assert isinstance(packed, dense_mod.F32Packed) and packed.panels is None and packed.onednn is not None
    assert packed.onednn.few_rows == {8} and packed.onednn.many_rows
    calls: list[int] = []
    real = onednn_linear.linear
    monkeypatch.setattr(onednn_linear, "linear", lambda x, r, b: calls.append(x.shape[0]) or real(x, r, b))
    for rows in (1, 2, 8, 9, 32, 33, 200):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(dense_mod.dense(x, w, None, packed), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert calls == [2, 8, 33, 200], "2-8 rows: the 8-row class; 9-32: the 32-row class; past 32: the prefill choice"
    (stored,) = (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json")
    assert json.loads(stored.read_text())["entries"]["onednn fp32 64x32 few rows"] == {"onednn_rows": [8]}
    onednn_linear.forget()
    again = dense_mod.pack_weight(w)
    assert again.onednn.few_rows == {8} and FEW_MEASURED == [(32, 64)], "read from the file, not measured again"


def test_a_few_row_class_the_rounds_disagree_on_goes_by_the_total(native_lib, forced, monkeypatch) -> None:
    _skinny_kernel_loses(monkeypatch)
    FEW[:] = [{1: (2.0, 1.0), 8: (1.0, 2.0), 32: (1.0, 2.0)}, {1: (2.0, 1.0), 8: (2.5, 1.0), 32: (1.0, 2.0)}]
    assert dense_mod.pack_weight(torch.randn(72, 32)).onednn.few_rows == {32}, "8 rows: 3.5 vs 3.0 ms in all"
    FEW[:] = [{1: (2.0, 1.0), 8: (1.0, 2.0), 32: (1.0, 2.0)}, {1: (2.0, 1.0), 8: (1.5, 1.0), 32: (1.0, 2.0)}]
    assert dense_mod.pack_weight(torch.randn(88, 32)).onednn.few_rows == {8, 32}, "8 rows: 2.5 vs 3.0 ms in all"
    onednn_linear.forget()
    assert dense_mod.pack_weight(torch.randn(88, 32)).onednn.few_rows == {8, 32}
    assert FEW_MEASURED.count((32, 88)) == 1, "a disagreement is stored as provisional: the next process takes it"


def test_no_copy_for_the_row_classes_the_skinny_kernel_takes(native_lib, forced, monkeypatch) -> None:
    """Calls of up to the skinny kernel's rows never reach oneDNN (`dense` tries the panels first), so the few-row
    classes within them keep no copy: oneDNN winning only there keeps none at all (a whole weight's memory)."""
    rounds, _ = forced
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]  # F.linear past the few-row classes
    packed = dense_mod.pack_weight(torch.randn(48, 32))  # the kernel up to 8 rows, oneDNN winning 1, 8 and 32
    assert isinstance(packed, dense_mod.F32Packed) and packed.panels is not None and packed.panels.max_rows == 8
    assert packed.onednn is not None and packed.onednn.few_rows == {32} and not packed.onednn.many_rows
    monkeypatch.setattr(
        skinny_gemm,
        "measure",
        lambda lib, k, n, fmt=None: [{r: (1.0, 2.0) if r <= 32 else (2.0, 1.0) for r in ROW_LADDER}] * 2,
    )
    skinny_gemm.forget()
    packed = dense_mod.pack_weight(torch.randn(40, 32))
    assert isinstance(packed, dense_mod.F32Packed) and packed.panels is not None and packed.panels.max_rows == 32
    assert packed.onednn is None, "every class oneDNN won is the kernel's: no copy"


def test_a_copy_kept_for_a_few_row_class_takes_the_prefill_calls_at_a_near_tie(native_lib, forced) -> None:
    """oneDNN won the 32-row class, past the kernel's 8 rows, so its copy stays; F.linear won the prefill-sized calls
    by 1% in both rounds: a near tie, and the copy takes them too (one copy of the weight, not two). By 10% in both,
    or in one round of two: F.linear keeps them (the latter stored as provisional)."""
    rounds, measured = forced
    rounds[:] = [(1.01, 1.0), (1.01, 1.0)]
    packed = dense_mod.pack_weight(torch.randn(48, 32))
    assert packed.onednn is not None and packed.onednn.few_rows == {32} and packed.onednn.many_rows
    assert dense_mod.takes_every_call(packed) and measured == [(32, 48), (32, 48)], "the second: the tie's"
    rounds[:] = [(1.1, 1.0), (1.1, 1.0)]
    packed = dense_mod.pack_weight(torch.randn(40, 32))
    assert packed.onednn.few_rows == {32} and not packed.onednn.many_rows and not dense_mod.takes_every_call(packed)
    rounds[:] = [(1.1, 1.0), (1.01, 1.0)]
    assert not dense_mod.pack_weight(torch.randn(56, 32)).onednn.many_rows
    (stored,) = (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json")
    entries = json.loads(stored.read_text())
    assert entries["entries"]["onednn fp32 48x32 near tie"] == {"near_tie": True}
    assert entries["provisional"]["onednn fp32 56x32 near tie"] == {"near_tie": False}


def test_a_weight_whose_copies_take_every_call_is_freed(native_lib, forced, monkeypatch) -> None:
    """Panels up to 8 rows and oneDNN for every class past them: `dense` never reads the plain weight, so the module
    frees it (the parameter becomes None) and gives the same bits as before. Where F.linear keeps a class (the
    32-row one here, or the calls past the few-row classes) the weight stays."""
    gen = torch.Generator().manual_seed(7)

    def seeded(hidden: int) -> GatedMLP:
        mlp = GatedMLP(hidden, 24, bias=False)
        with torch.no_grad():
            for w in (mlp.gate_up_weight, mlp.down_weight):
                w.copy_(torch.randn(w.shape, generator=gen))
        return mlp

    mlp = seeded(32)
    xs = [torch.randn(rows, 32, generator=gen) for rows in (1, 8, 9, 32, 33, 200)]
    gate_up, down = mlp.gate_up_weight, mlp.down_weight
    mlp.pack_weights()
    assert mlp.gate_up_weight is None and mlp.down_weight is None
    for x in xs:  # the same packed copies beside the plain weights: the same bits, so `dense` never read them
        h = dense_mod.dense_silu_and_mul(x, gate_up, None, mlp.gate_up_packed)
        assert torch.equal(mlp(x), dense_mod.dense(h, down, None, mlp.down_packed))
        want = F.linear(F.silu(x @ gate_up[:24].T) * (x @ gate_up[24:].T), down)
        torch.testing.assert_close(mlp(x), want, atol=1e-4, rtol=1e-4)

    FEW[:] = [{1: (1.0, 2.0), 8: (1.0, 2.0), 32: (2.0, 1.0)}] * 2  # F.linear keeps 9-32 rows
    kept = seeded(40)
    kept.pack_weights()
    assert kept.gate_up_weight is not None and not dense_mod.takes_every_call(kept.gate_up_packed)
    rounds, _ = forced
    rounds[:] = [(2.0, 1.0), (2.0, 1.0)]  # ... or the calls past 32 rows
    FEW[:] = [dict.fromkeys(onednn_linear.FEW_ROWS, (1.0, 2.0))] * 2
    kept = seeded(56)
    kept.pack_weights()
    assert kept.gate_up_weight is not None and not dense_mod.takes_every_call(kept.gate_up_packed)


def test_row_classes() -> None:
    assert [onednn_linear.row_class(r) for r in (1, 2, 8, 9, 32, 33, 4096)] == [1, 8, 8, 32, 32, None, None]


def _many(onednn: bool) -> onednn_linear.OnednnCalls:
    """A layer weight's calls under `forced`: oneDNN at every few-row class, and past them as given."""
    return onednn_linear.OnednnCalls(frozenset(onednn_linear.FEW_ROWS), onednn)


@pytest.fixture
def layer_rounds(forced, monkeypatch):
    """Shapes 48x32 (oneDNN wins alone) and 40x32 (F.linear wins alone); `measure_layer` replaced by the per-round
    ms of (the shapes' mix, all oneDNN, all F.linear) in the returned list; each call's shapes are recorded."""
    del forced  # its UCM_CPU_LINEAR, cache dir and few-row results; `measure` is replaced below
    monkeypatch.setattr(onednn_linear, "measure", lambda k, n: [(1.0, 2.0)] * 2 if n == 48 else [(2.0, 1.0)] * 2)
    layer: list[list[float]] = [[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]]
    calls: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(onednn_linear, "measure_layer", lambda shapes, *_: calls.append(list(shapes)) or list(layer))
    return layer, calls


def test_a_layer_whose_shapes_disagree_takes_its_fastest_measured_path(native_lib, layer_rounds, monkeypatch) -> None:
    """Alone, one shape chose oneDNN and the other F.linear; timed as a layer, all F.linear won: both weights' calls
    past the few-row classes go through F.linear, and the answer is stored for the next process."""
    layer, calls = layer_rounds
    a, b = torch.randn(48, 32), torch.randn(40, 32)
    choice = dense_mod.f32_layer_choice([a, b])
    assert choice == {(48, 32): _many(False), (40, 32): _many(False)} and calls == [[(48, 32), (40, 32)]]
    packed = [dense_mod.pack_weight(w, layer=choice) for w in (a, b)]
    assert all(p is None or p.onednn is None or not p.onednn.takes(200) for p in packed)
    used: list[int] = []
    real = onednn_linear.linear
    monkeypatch.setattr(onednn_linear, "linear", lambda x, r, bias: used.append(x.shape[0]) or real(x, r, bias))
    x = torch.randn(200, 32)
    for w, p in zip((a, b), packed, strict=True):
        torch.testing.assert_close(dense_mod.dense(x, w, None, p), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert used == [], "200 rows: F.linear for both, as the layer measured"
    assert dense_mod.pack_weight(a).onednn.takes(200), "alone (no layer choice), the shape keeps its own"
    (stored,) = (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json")
    entries = json.loads(stored.read_text())["entries"]
    assert entries["onednn fp32 layer 48x32 40x32"] == {"onednn_layer": [False, False]}
    onednn_linear.forget()
    layer[:] = [[1.0, 2.0, 3.0]] * 2
    assert dense_mod.f32_layer_choice([a, b]) == choice and len(calls) == 1, "read from the file, not measured"


def test_a_layer_keeps_its_shapes_mix_where_it_wins_or_the_rounds_disagree(native_lib, layer_rounds) -> None:
    layer, calls = layer_rounds
    a, b = torch.randn(48, 32), torch.randn(40, 32)
    layer[:] = [[1.0, 2.0, 3.0], [1.0, 3.0, 2.0]]
    assert dense_mod.f32_layer_choice([a, b]) == {(48, 32): _many(True), (40, 32): _many(False)}
    a, b = torch.randn(48, 64), torch.randn(40, 64)  # another layer: the first's answer is stored
    layer[:] = [[3.0, 1.0, 2.0], [3.0, 2.0, 1.0]]
    assert dense_mod.f32_layer_choice([a, b]) == {(48, 64): _many(True), (40, 64): _many(False)}, (
        "rounds disagree: the mix"
    )
    onednn_linear.forget()
    dense_mod.f32_layer_choice([a, b])
    assert len(calls) == 2, "a disagreement is stored as provisional: the next process takes it"


def test_a_layer_whose_shapes_agree_is_not_timed(native_lib, layer_rounds) -> None:
    _, calls = layer_rounds
    got = dense_mod.f32_layer_choice([torch.randn(48, 32), torch.randn(48, 64)])
    assert got == {(48, 32): _many(True), (48, 64): _many(True)}
    assert dense_mod.f32_layer_choice([torch.randn(48, 32).bfloat16()]) is None, "fp32 weights only"
    assert calls == []


def test_a_layer_whose_shapes_split_a_few_row_class_takes_its_fastest_way_there(native_lib, forced, monkeypatch):
    """Alone, 48x32 chose oneDNN at 8 rows and 40x32 F.linear; timed as a layer at 8 rows (a stack past the
    last-level cache), all oneDNN won: both take oneDNN for 8-row calls, the other classes as they agreed."""
    _skinny_kernel_loses(monkeypatch)
    few = {48: {1: (1.0, 2.0), 8: (1.0, 2.0), 32: (1.0, 2.0)}, 40: {1: (1.0, 2.0), 8: (2.0, 1.0), 32: (1.0, 2.0)}}
    monkeypatch.setattr(onednn_linear, "measure_few", lambda k, n: [few[n]] * 2)
    timed: list[tuple[int, ...]] = []

    def layer(shapes, candidates, row_counts, layers):
        timed.append(tuple(row_counts))
        assert layers >= onednn_linear.LAYER_STACK
        return [[3.0, 1.0, 2.0]] * 2  # (the mix, all oneDNN, all F.linear)

    monkeypatch.setattr(onednn_linear, "measure_layer", layer)
    a, b = torch.randn(48, 32), torch.randn(40, 32)
    choice = dense_mod.f32_layer_choice([a, b])
    assert timed == [(8,)], "only the class the shapes split is timed"
    assert choice is not None and {c.few_rows for c in choice.values()} == {frozenset(onednn_linear.FEW_ROWS)}
    packed = dense_mod.pack_weight(b, layer=choice)
    assert packed is not None and packed.onednn is not None and packed.onednn.takes(8)
    assert not dense_mod.pack_weight(b).onednn.takes(8), "alone, the shape keeps its own"
    (stored,) = (Path(os.environ["UCM_CACHE_DIR"]) / "kernels").glob("linear-*.json")
    entries = json.loads(stored.read_text())["entries"]
    assert entries["onednn fp32 layer 48x32 40x32 at 8 rows"] == {"onednn_layer": [True, True]}
