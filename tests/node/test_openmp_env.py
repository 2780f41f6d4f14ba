"""A serving node's OpenMP wait policy (node/openmp_env.py): a spin of NODE_SPIN_S in this CPU's rounds, set before
the node's module imports torch, only where the user chose none, and passed to Ray node actors."""

from __future__ import annotations

import math
import os
import threading
import time
import types
from collections.abc import Callable
from typing import TypeVar

import pytest

from launch import cli
from node import openmp_env
from node.openmp_env import (
    ASSUMED_ROUND_S,
    MAX_SPINCOUNT,
    MIN_SPINCOUNT,
    NODE_SPIN_S,
    node_openmp_env,
    node_spincount,
    openmp_wait,
)
from ucm_kernels.cpu.pause_probe import ROUNDS, TRIES, pause_seconds

ROUND_S = 28e-9  # a spin-wait round as the 2-core AMD EPYC (Zen 5) measured it
COUNT = str(round(NODE_SPIN_S / ROUND_S))
T = TypeVar("T")


@pytest.fixture
def measured(monkeypatch) -> None:
    """This CPU's round fixed, so the expected count is known (the real probe has its own test)."""
    monkeypatch.setattr(openmp_env, "pause_seconds", lambda: ROUND_S)


def test_the_spin_is_a_time_in_this_cpus_rounds() -> None:
    assert node_spincount(ROUND_S) == int(COUNT)
    assert node_spincount(2 * ROUND_S) == round(NODE_SPIN_S / ROUND_S / 2), "slower rounds, fewer of them"
    assert node_spincount(None) == round(NODE_SPIN_S / ASSUMED_ROUND_S), "no probe: an Intel core's round"
    assert node_spincount(1e-3) == MIN_SPINCOUNT and node_spincount(1e-12) == MAX_SPINCOUNT, "libgomp's at most"


def _within(deadline_s: float, fn: Callable[[], T]) -> tuple[T, float]:
    """fn()'s result and its wall time; fails if it has not returned within `deadline_s` (a generous bound: only a
    probe that hangs reaches it). A daemon thread, so a hung probe cannot keep the test process alive."""
    box: list[tuple[T, float]] = []

    def run() -> None:
        t0 = time.perf_counter()
        value = fn()
        box.append((value, time.perf_counter() - t0))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert box, f"no answer within {deadline_s} s"
    return box[0]


def test_the_probe_measures_this_cpu(tmp_path) -> None:
    _within(300, lambda: pause_seconds(tmp_path))  # builds the probe (a C compile): not what is timed below
    round_s, wall_s = _within(60, lambda: pause_seconds(tmp_path))
    assert round_s is not None and 0 < round_s < math.inf, f"a spin-wait round of {round_s} s"
    # The least of TRIES timings of ROUNDS rounds, all of them inside this call: true however loaded the box is
    # (a sum of the tries, or a figure in the wrong unit, would not be).
    assert round_s * ROUNDS * TRIES <= wall_s, (round_s, wall_s)
    assert MIN_SPINCOUNT <= int(node_openmp_env({})["GOMP_SPINCOUNT"]) <= MAX_SPINCOUNT


def test_set_only_where_the_user_chose_nothing(measured) -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert node_openmp_env(env) == {"GOMP_SPINCOUNT": COUNT}
    assert env["GOMP_SPINCOUNT"] == COUNT and openmp_wait(env) == f"GOMP_SPINCOUNT={COUNT}"
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(chosen)
        assert node_openmp_env(env) == {} and env == chosen, "the user's choice stays"
    assert openmp_wait({}) == "libgomp's default"


@pytest.mark.parametrize(
    ("command", "sets"), [("decode", True), ("prefill", True), ("router", False), ("store", False)]
)
def test_the_entry_point_sets_it_before_a_node_module_loads(measured, monkeypatch, command: str, sets: bool) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # tests/conftest.py sets it for the test process
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    seen: list[str | None] = []

    def import_module(name: str) -> types.SimpleNamespace:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))  # what torch's libgomp would read when this module loads
        return types.SimpleNamespace(**{cli.SUBCOMMANDS[command][1]: lambda argv: 0})

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    assert cli.main([command]) == 0
    assert seen == [COUNT if sets else None]


def test_ray_node_actors_get_it(measured, monkeypatch) -> None:
    from launch.ray.placement import node_options
    from launch.ray.spec import DeploymentSpec

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert node_options(DeploymentSpec())["runtime_env"] == {"env_vars": {"GOMP_SPINCOUNT": COUNT}}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert node_options(DeploymentSpec())["runtime_env"] == {"env_vars": {}}
    assert "GOMP_SPINCOUNT" not in os.environ, "the driver's own environment is left alone"
