"""oneDNN fp32 linear (kernels/cpu/onednn_linear.py) against F.linear, and its dispatch in `engine.models.dense`:
prefill-sized row counts go to oneDNN only for weight shapes where it measured faster, the choice is cached per
machine, lm_head gets no copy, and `UCM_CPU_LINEAR=torch` turns it off. No timing asserts: `measure` is replaced
by fixed numbers wherever a choice is tested."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import dense as dense_mod
from kernels.cpu import onednn_linear, skinny_gemm
from kernels.cpu.skinny_gemm import ROW_LADDER

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


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """UCM_CPU_LINEAR=auto, a fresh cache dir, the skinny kernel winning up to 8 rows, and oneDNN's `measure`
    replaced by the rounds in `rounds` (oneDNN ms, F.linear ms); returns (rounds, the (k, n) measured)."""
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
    assert dense_mod.pack_weight(torch.randn(48, 32)).onednn is None, "no memory spent where F.linear wins"
    rounds[:] = [(1.0, 2.0), (2.0, 1.0)]
    assert dense_mod.pack_weight(torch.randn(40, 32)).onednn is None, "rounds that disagree: F.linear"
    onednn_linear.forget()
    dense_mod.pack_weight(torch.randn(40, 32))
    assert measured.count((32, 40)) == 2, "a disagreement is not stored: the next process measures again"
    monkeypatch.setenv("UCM_CPU_LINEAR", "torch")
    measured.clear()
    assert dense_mod.pack_weight(torch.randn(56, 32)) is None and measured == []
