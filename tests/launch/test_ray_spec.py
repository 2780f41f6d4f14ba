"""The Ray deployment's pieces that need no Ray cluster: the spec from `up`'s flags, and which keys each actor gets."""

from __future__ import annotations

import stat

import pytest

from common.kv_events.config import parse_kv_events_config
from common.save_policy import KVSavePolicy
from launch.launcher import build_parser
from launch.ray.actors import NodeLaunch
from launch.ray.keys import KeyBundle
from launch.ray.options import LOCAL, spec_from_args
from launch.ray.spec import STATUS_CLIENT, DeploymentSpec, NodeKind, parse_kind
from launch.serving_engine import ServingEngine
from ucm.store_config import DiskWrites


def test_up_flags_build_the_spec() -> None:
    args = build_parser().parse_args(["--ray", "--prefill", "2", "--node-cpus", "2", "--store-node", "10.0.0.5"])
    assert args.ray == LOCAL
    spec = spec_from_args(args)
    assert (spec.prefill, spec.decode, spec.colocated, spec.node_cpus) == (2, 1, 0, 2)
    assert spec.store_node == "10.0.0.5" and spec.secure and not spec.detached
    args = build_parser().parse_args(["--ray", "auto", "--topology", "colocated", "--insecure", "--detach"])
    spec = spec_from_args(args)
    assert (spec.prefill, spec.decode, spec.colocated, spec.secure, spec.detached) == (0, 0, 1, False, True)
    with pytest.raises(ValueError, match="--detach needs"):
        spec_from_args(build_parser().parse_args(["--ray", "--detach"]))
    # vLLM's --max-num-seqs and --max-num-batched-tokens and the colocated nodes' save policy reach the nodes'
    # command lines.
    args = ["--ray", "--topology", "colocated", "--max-num-seqs", "5", "--max-num-batched-tokens", "48",
            "--kv-save-policy", "evicted"]  # fmt: skip
    spec = spec_from_args(build_parser().parse_args(args))
    assert (spec.max_num_seqs, spec.max_num_batched_tokens, spec.kv_save_policy) == (5, 48, KVSavePolicy.EVICTED)
    assert spec_from_args(build_parser().parse_args(["--ray"])).kv_save_policy is None  # as computed
    # Which blocks the store writes to disk: the daemon's default unless given.
    assert spec_from_args(build_parser().parse_args(["--ray"])).disk_writes is None
    spec = spec_from_args(build_parser().parse_args(["--ray", "--disk-writes", "reused"]))
    assert spec.disk_writes is DiskWrites.REUSED
    launch = dict(index=0, router_addr="tcp://127.0.0.1:1", model="m", dtype="float32", device=None,
                  kv_cache_memory="1GiB", max_num_seqs=5, max_num_batched_tokens=48, kv_save_policy=KVSavePolicy.EVICTED,
                  heartbeat_interval_s=1.0, threads=1, keys=None)  # fmt: skip
    colocated = NodeLaunch(kind=NodeKind.COLOCATED, store_addr="tcp://127.0.0.1:2", **launch).argv(None)
    assert _flag(colocated, "--max-num-seqs") == "5" and _flag(colocated, "--kv-save-policy") == "evicted"
    assert _flag(colocated, "--max-num-batched-tokens") == "48"
    prefill = NodeLaunch(kind=NodeKind.PREFILL, store_addr="tcp://127.0.0.1:2", **launch).argv(None)
    assert "--kv-save-policy" not in prefill, "prefill nodes always save as they compute"
    storeless = NodeLaunch(kind=NodeKind.COLOCATED, store_addr=None, **launch).argv(None)
    assert "--kv-save-policy" not in storeless
    # Serving flags the actors do not carry yet are refused by name, never ignored.
    for flags, named in (
        (["--served-model-name", "chat"], "--served-model-name"),
        (["--max-model-len", "512"], "--max-model-len"),
        (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
        (["--host", "0.0.0.0"], "--host"),
    ):
        with pytest.raises(ValueError, match=named):
            spec_from_args(build_parser().parse_args(["--ray", *flags]))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_spec_validation_and_node_ids() -> None:
    with pytest.raises(ValueError, match="decode"):
        DeploymentSpec(decode=0)
    with pytest.raises(ValueError, match="at most 2"):
        DeploymentSpec(prefill=3, max_nodes_per_kind=2)
    assert parse_kind("colocated-3") == (NodeKind.COLOCATED, 3)
    with pytest.raises(ValueError):
        parse_kind("router")
    assert len(DeploymentSpec(max_nodes_per_kind=2).key_names()) == 6


def test_each_actor_gets_only_its_keys() -> None:
    bundle = KeyBundle.generate(("prefill-0", "decode-0"))
    router = set(bundle.for_router().files)
    # server.key: the store's public key (the router subscribes to its tiers' KV events)
    assert router == {
        "router.key", "router.key_secret", "server.key", "authorized/prefill-0.key", "authorized/decode-0.key"
    }  # fmt: skip
    store = set(bundle.for_store().files)
    assert {f for f in store if f.endswith(".key_secret")} == {"server.key_secret", f"{STATUS_CLIENT}.key_secret"}
    assert f"authorized/{STATUS_CLIENT}.key" in store and "authorized/decode-0.key" in store
    assert "router.key" in store  # its tiers' KV events publisher lets the router subscribe
    node = bundle.for_node("decode-0")
    assert set(node.files) == {"decode-0.key", "decode-0.key_secret", "router.key", "server.key"}
    with pytest.raises(ValueError, match="no key"):
        bundle.for_node("decode-7")
    folder = node.write()
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / "decode-0.key_secret").stat().st_mode) == 0o600
        # The folder is one a node's --curve-keys accepts: its pair for the router link and the store link.
        from common.auth import ClientAuth, KeyPaths

        ClientAuth.for_router(folder, "decode-0").load()
        ClientAuth.from_dir(folder, "decode-0").load()
        assert KeyPaths.of(folder).server_public.is_file()
    finally:
        import shutil

        shutil.rmtree(folder)


def test_up_and_the_cli_do_not_import_ray() -> None:
    # Ray is an optional extra: only a Ray path (up --ray, scale, status, down) may load it.
    import subprocess
    import sys

    code = (
        "import sys, launch.cli, launch.launcher; launch.launcher.build_parser().parse_args(['--ray']); "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_up_ray_engine_vllm_builds_a_pd_spec() -> None:
    """`up --ray --engine vllm`: prefill and decode instances (1 + 1 by default) on the store; colocated or
    store-less refused."""
    spec = spec_from_args(build_parser().parse_args(["--ray", "--engine", "vllm"]))
    assert spec.engine is ServingEngine.VLLM and (spec.prefill, spec.decode, spec.colocated) == (1, 1, 0)
    with pytest.raises(ValueError, match="colocated"):
        spec_from_args(build_parser().parse_args(["--ray", "--engine", "vllm", "--topology", "colocated"]))
    with pytest.raises(ValueError, match="store"):
        DeploymentSpec(engine=ServingEngine.VLLM, store=False)


def test_up_ray_kv_events_config_reaches_every_node_at_its_own_offset() -> None:
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}'
    spec = spec_from_args(build_parser().parse_args(["--ray", "--prefill", "2", "--kv-events-config", config]))
    assert spec.kv_events is not None and spec.kv_events.endpoint == "tcp://*:5557"
    ports = {}
    for node_id in spec.key_names():  # every node the deployment may ever run (scaled in later too): its own ports
        events = spec.kv_events_for(node_id)
        assert events is not None
        ports[node_id] = (events.endpoint, events.replay_endpoint)
    assert ports["prefill-0"] == ("tcp://*:5557", "tcp://*:5657")
    assert ports["decode-1"] == ("tcp://*:5574", "tcp://*:5674")  # after the 16 prefill ids
    assert len({p for pair in ports.values() for p in pair}) == 2 * len(ports)
    launch = dict(index=1, router_addr="tcp://127.0.0.1:1", store_addr=None, model="m", dtype="float32", device=None,
                  kv_cache_memory="1GiB", max_num_seqs=5, max_num_batched_tokens=None, kv_save_policy=None,
                  heartbeat_interval_s=1.0, threads=1, keys=None)  # fmt: skip
    argv = NodeLaunch(kind=NodeKind.DECODE, kv_events=spec.kv_events_for("decode-1"), **launch).argv(None)
    assert parse_kv_events_config(_flag(argv, "--kv-events-config")).endpoint == "tcp://*:5574"
    # The store's tiers publish at the offset after every node id's.
    store = spec.store_kv_events()
    assert store is not None and store.endpoint == f"tcp://*:{5557 + len(spec.key_names())}"
    assert store.endpoint not in {p for pair in ports.values() for p in pair}
    assert DeploymentSpec(kv_events=spec.kv_events, store=False).store_kv_events() is None
    assert "--kv-events-config" not in NodeLaunch(kind=NodeKind.DECODE, **launch).argv(None)
    close = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
    with pytest.raises(ValueError, match="apart"):  # 48 node ids' ports would collide
        spec_from_args(build_parser().parse_args(["--ray", "--kv-events-config", close]))
    with pytest.raises(ValueError, match="--engine vllm"):
        spec_from_args(build_parser().parse_args(["--ray", "--engine", "vllm", "--kv-events-config", config]))
