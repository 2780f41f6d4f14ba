"""A serving node's OpenMP wait policy (node/openmp_env.py): set before the node's module imports torch, only where
the user chose none, and passed to Ray node actors."""

from __future__ import annotations

import os
import types

import pytest

from launch import cli
from node.openmp_env import NODE_SPINCOUNT, node_openmp_env, openmp_wait


def test_set_only_where_the_user_chose_nothing() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert node_openmp_env(env) == {"GOMP_SPINCOUNT": NODE_SPINCOUNT}
    assert env["GOMP_SPINCOUNT"] == NODE_SPINCOUNT and openmp_wait(env) == f"GOMP_SPINCOUNT={NODE_SPINCOUNT}"
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(chosen)
        assert node_openmp_env(env) == {} and env == chosen, "the user's choice stays"
    assert openmp_wait({}) == "libgomp's default"


@pytest.mark.parametrize(
    ("command", "sets"), [("decode", True), ("prefill", True), ("router", False), ("store", False)]
)
def test_the_entry_point_sets_it_before_a_node_module_loads(monkeypatch, command: str, sets: bool) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # tests/conftest.py sets it for the test process
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    seen: list[str | None] = []

    def import_module(name: str) -> types.SimpleNamespace:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))  # what torch's libgomp would read when this module loads
        return types.SimpleNamespace(**{cli.SUBCOMMANDS[command][1]: lambda argv: 0})

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    assert cli.main([command]) == 0
    assert seen == [NODE_SPINCOUNT if sets else None]


def test_ray_node_actors_get_it(monkeypatch) -> None:
    from launch.ray.placement import node_options
    from launch.ray.spec import DeploymentSpec

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert node_options(DeploymentSpec())["runtime_env"] == {"env_vars": {"GOMP_SPINCOUNT": NODE_SPINCOUNT}}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert node_options(DeploymentSpec())["runtime_env"] == {"env_vars": {}}
    assert "GOMP_SPINCOUNT" not in os.environ, "the driver's own environment is left alone"
