"""`ucm-serve up --engine vllm` without starting vLLM: a missing vLLM venv and unsupported combinations are one line
and exit 2; each vLLM instance's command line (role, store address with its own CURVE client, cores, flags) and the
router's. The real cluster runs in tests/connector/test_vllm_pd_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cluster import ClusterSpec, StoreMode
from launch.vllm_cluster import VllmCluster
from launch.vllm_command import VllmMissing


def _up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "up", "--engine", "vllm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_missing_vllm_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = _up(env={"UCM_VLLM_VENV": str(tmp_path / "none")})
    assert out.returncode == 2, out
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"no vLLM at {tmp_path / 'none'}" in errors[0] and "install_ucm_vllm_plugin.sh" in errors[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [(("--ray",), "--ray is not supported"), (("--kv-events-config", "{}"), "--kv-events-config is not supported")],
)
def test_unsupported_combinations(args: tuple[str, ...], says: str) -> None:
    out = _up(*args)
    assert out.returncode == 2 and says in out.stderr, out


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text("#!/bin/sh\n")
    return tmp_path


def test_instance_commands(fake_venv: Path) -> None:
    cluster = VllmCluster(ClusterSpec(prefill=1, decode=1, max_num_seqs=8, served_model_name="smol"), venv=fake_venv)
    cluster.model_dir = "/models/smol"
    store = cluster.store_addr
    assert store is not None and store.startswith("tcp://127.0.0.1:")
    commands = {kind: cluster.command(kind, 0) for kind in ("prefill", "decode")}
    for kind, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        argv = commands[kind].argv()
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert config["kv_role"] == role and config["kv_load_failure_policy"] == "recompute"
        assert config["kv_connector_extra_config"]["store"] == store, "no keys made yet: the plain address"
        assert argv[argv.index("--served-model-name") + 1] == "smol"
        assert argv[argv.index("--max-num-seqs") + 1] == "8"
        assert ("--enable-prompt-tokens-details" in argv) == (kind == "decode"), "cached_tokens from the consumer"
    cpus = {commands[k].env()["VLLM_CPU_OMP_THREADS_BIND"] for k in commands}
    if (os.cpu_count() or 1) >= 2:
        assert len(cpus) == 2, f"each instance gets its own cores: {cpus}"
    assert cluster.urls("prefill") == [commands["prefill"].url]
    assert cluster.urls("decode") == [commands["decode"].url]


def test_refused_specs(fake_venv: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="colocated"):
        VllmCluster(ClusterSpec(prefill=0, decode=0, colocated=1), venv=fake_venv)
    with pytest.raises(ValueError, match="store"):
        VllmCluster(ClusterSpec(store=StoreMode.NONE), venv=fake_venv)
    with pytest.raises(VllmMissing):
        VllmCluster(ClusterSpec(), venv=tmp_path / "none")
