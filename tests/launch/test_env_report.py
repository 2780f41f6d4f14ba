"""`ucm-serve env` (launch/env_report.py): the host, versions and lock, and every calibrated choice with its file;
`--pin FILE` then `UCM_PIN=FILE` replays those choices in a run with an empty cache, without timing anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch import env_report, launcher
from ucm_kernels.cpu import calibration, calibration_store
from ucm_kernels.cpu.calibration import Geometry, ShapeClass
from ucm_kernels.cpu.host import cpu_info

# The native path wins some classes and torch others: a plan no default would produce by chance.
TIMES = {
    ShapeClass.DECODE: {"native": 1.0, "torch": 2.0},
    ShapeClass.CHUNK: {"native": 3.0, "torch": 1.0},
    ShapeClass.PROMPT: {"native": 1.0, "torch": 4.0},
}


@pytest.fixture
def measured(monkeypatch):
    """Calibrations in this test measure TIMES (counted), never the kernels."""
    calls: list[ShapeClass] = []

    def fake(lib, g, shape_class):
        calls.append(shape_class)
        return [TIMES[shape_class]]

    monkeypatch.setattr(calibration, "measure", fake)
    monkeypatch.setenv("UCM_CPU_ATTENTION", "auto")
    monkeypatch.delenv("UCM_PIN", raising=False)
    calibration.forget()
    yield calls
    calibration.forget()


def test_env_lists_the_host_and_every_choice_and_a_pin_replays_them(measured, monkeypatch, tmp_path, native_lib):
    first, second = tmp_path / "first", tmp_path / "second"
    geometry = Geometry("float32", 9, 3, 64, 16)
    monkeypatch.setenv("UCM_CACHE_DIR", str(first))
    chosen = calibration.plan(native_lib, geometry)
    assert len(measured) == len(ShapeClass), "measured once per class"

    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "env", "--json", "--pin", str(tmp_path / "pin.json")],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    assert report["host"]["cpu"] == cpu_info()[0] and report["versions"]["torch"]
    assert report["lock"]["differ"] == [], "the test venv is the lock"
    (choice,) = [c for c in report["choices"] if c["kind"] == "calibration" and c["name"] == geometry.label()]
    assert choice["file"].startswith(str(first)) and choice["library"] == native_lib.path.name

    # Elsewhere: an empty cache, the pin named; the same plan, and nothing timed.
    monkeypatch.setenv("UCM_CACHE_DIR", str(second))
    monkeypatch.setenv("UCM_PIN", str(tmp_path / "pin.json"))
    calibration.forget()
    measured.clear()
    assert calibration.plan(native_lib, geometry) == chosen
    assert measured == [], "a pinned choice is not measured"
    assert not (second / "kernels").exists() or not list((second / "kernels").glob("calibration-*.json"))


def test_the_text_report_names_the_lock_and_the_overrides(monkeypatch) -> None:
    monkeypatch.setenv("UCM_ADAPTIVE_THREADS", "0")
    text = env_report.render(env_report.collect())
    assert "UCM_ADAPTIVE_THREADS=0" in text and cpu_info()[0] in text
    assert "the venv is the lock" in text


def test_a_bad_pin_file_is_a_clear_error(monkeypatch, tmp_path) -> None:
    bad = tmp_path / "pin.json"
    bad.write_text('{"choices": 3}')
    monkeypatch.setenv("UCM_PIN", str(bad))
    with pytest.raises(ValueError, match="not a pin file"):
        calibration_store.pinned("calibration", 1, "x")


def test_the_choices_are_read_after_the_rest_once_up_says_so(measured, monkeypatch, tmp_path, native_lib, capsys):
    """`up` starts the report beside its nodes and lets it read the choices once they registered: a choice stored
    meanwhile (a node's warm-up) is in it, and what runs after the line is the choices alone (launch/launcher.py)."""
    monkeypatch.setenv("UCM_CACHE_DIR", str(tmp_path))
    geometry = Geometry("float32", 9, 3, 64, 16)
    order: list[str] = []
    lock_state = env_report.lock_state
    monkeypatch.setattr(env_report, "lock_state", lambda: order.append("lock") or lock_state())
    report = env_report.collect(lambda: order.append("line") or calibration.plan(native_lib, geometry))
    assert order == ["lock", "line"], "host, versions and lock are read before the line, the choices after it"
    assert [c["name"] for c in report["choices"] if c["kind"] == "calibration"] == [geometry.label()]
    assert report["host"]["cpu"] == cpu_info()[0] and report["lock"]["differ"] == []

    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # a user's shell: the child's stdout is block-buffered
    child = launcher.start_environment_report()
    launcher.print_environment(child)
    assert child.returncode == 0
    text = capsys.readouterr().out
    assert text.startswith("[up] environment (ucm-serve env):") and f"[up]   choices    1 in {tmp_path}" in text
    assert geometry.label() in text, "the whole report came back from a child that skips its teardown"
