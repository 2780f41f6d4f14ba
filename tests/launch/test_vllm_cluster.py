"""`ucm-serve up --engine vllm` without starting vLLM: a missing vLLM venv and an unsupported combination are one line
and exit 2; each vLLM instance's command line (role, store address with its own CURVE client, cores, flags) and the
router's. The real cluster runs in tests/connector/test_vllm_pd_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.kv_events.config import KVEventsConfig
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


def test_unsupported_combinations() -> None:
    out = _up("--ray", "--topology", "colocated")  # refused before Ray starts
    assert out.returncode == 2 and "not colocated" in out.stdout, out


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
    root = Path(__file__).resolve().parents[2]
    for command in commands.values():  # vLLM imports the connector of this checkout, whatever its venv last installed
        assert command.env()["PYTHONPATH"].split(os.pathsep)[0] == str(root)
        assert (root / "connector" / "vllm_plugin.py").is_file()
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


def test_kv_events_per_instance_and_the_router_subscribed(fake_venv: Path) -> None:
    """`up --engine vllm --kv-events-config`: each instance publishes at its own offset (vLLM's config, no null
    fields), the store at the next one, and the router is told every publisher and given the tokenizer's folder."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:7100", replay_endpoint="tcp://*:7200")
    spec = ClusterSpec(prefill=1, decode=1, kv_events=config)
    cluster = VllmCluster(spec, venv=fake_venv)
    cluster.model_dir = "/models/smol"
    for kind, nth in (("prefill", 0), ("decode", 1)):
        argv = cluster.command(kind, 0).argv()
        events = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert events["endpoint"] == f"tcp://*:{7100 + nth}" and events["replay_endpoint"] == f"tcp://*:{7200 + nth}"
        assert None not in events.values() and events["enable_kv_cache_events"] is True
    assert cluster.store_kv_events() == config.for_node(2)
    cluster.store_events_addr = "tcp://127.0.0.1:7102,tcp://127.0.0.1:7202"  # what start_store reads back
    args = cluster.router_args()
    published = [args[i + 1] for i, a in enumerate(args) if a == "--vllm-kv-events"]
    assert published == [
        f"{cluster.urls('prefill')[0]}=tcp://127.0.0.1:7100,tcp://127.0.0.1:7200",
        f"{cluster.urls('decode')[0]}=tcp://127.0.0.1:7101,tcp://127.0.0.1:7201",
    ]
    assert args[args.index("--store-kv-events") + 1] == cluster.store_events_addr
    assert args[args.index("--model") + 1] == "/models/smol"
    # The router's own parser takes them.
    from router.cli import build_parser, vllm_events_endpoints

    parsed = build_parser().parse_args(args[1:])
    assert [url for url, _ in vllm_events_endpoints(parsed.vllm_kv_events)] == cluster.urls("prefill") + cluster.urls(
        "decode"
    )
