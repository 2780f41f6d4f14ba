"""`--kv-events-config` on `up`/`serve` and the node roles, `--prefix-source` on the router: parsed into typed
configs, refused with the reason in one line, each node of a cluster on its own ports (vLLM's per-rank offset)."""

from __future__ import annotations

import argparse
import json

import pytest

from common.kv_events.config import KVEventsConfig
from launch import launcher
from launch.cluster import Cluster, ClusterSpec, StoreMode
from node.config import add_node_args, config_from_args
from protocol import messages as P
from protocol.messages import NodeRole
from router.cli import build_parser as router_parser
from router.cli import store_events_endpoint
from router.config import PrefixSource
from router.pairing_policy import PairingPolicy

EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6100", "replay_endpoint": "tcp://*:6200"}'


def _node_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return parser.parse_args(["--router", "tcp://127.0.0.1:1", "--insecure", *extra])


def test_node_flag_parses_into_the_config() -> None:
    config = config_from_args(_node_args("--kv-events-config", EVENTS), NodeRole.DECODE)
    assert config.kv_events == KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:6100", replay_endpoint="tcp://*:6200"
    )
    assert config.publishes_kv_events
    assert config_from_args(_node_args(), NodeRole.DECODE).kv_events is None
    with pytest.raises(ValueError, match="unknown field `buffer`"):
        config_from_args(_node_args("--kv-events-config", '{"buffer": 1}'), NodeRole.DECODE)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("{not json", "is not a JSON object"),
        ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6100", "replay_endpoint": "tcp://*:6101"}', "apart"),
    ],
    ids=["bad-json", "ports-collide"],
)
def test_up_refuses_a_bad_config_in_one_line(value: str, words: str, capsys) -> None:
    code = launcher.main(["--model", "smollm2-135m", "--prefill", "1", "--decode", "1", "--kv-events-config", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("ucm-serve up: error: --kv-events-config"), err
    assert words in err[0]


def test_each_node_gets_its_own_ports(monkeypatch) -> None:
    spec = ClusterSpec(
        prefill=1,
        decode=2,
        secure=False,
        kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6100", replay_endpoint="tcp://*:6200"),
    )
    cluster = Cluster(spec, log=lambda *_: None)
    argvs: dict[str, list[str]] = {}
    monkeypatch.setattr(cluster, "_spawn", lambda name, argv, env=None, nice=0: argvs.setdefault(name, argv))
    for kind, index in (("prefill", 0), ("decode", 0), ("decode", 1)):
        cluster.start_node(kind, index)
    got = {name: json.loads(argv[argv.index("--kv-events-config") + 1]) for name, argv in argvs.items()}
    assert {name: (c["endpoint"], c["replay_endpoint"]) for name, c in got.items()} == {
        "prefill-0": ("tcp://*:6100", "tcp://*:6200"),
        "decode-0": ("tcp://*:6101", "tcp://*:6201"),
        "decode-1": ("tcp://*:6102", "tcp://*:6202"),
    }


def test_router_prefix_source_flag() -> None:
    assert router_parser().parse_args(["--insecure"]).prefix_source is PrefixSource.EVENTS
    args = router_parser().parse_args(["--insecure", "--prefix-source", "heartbeat"])
    assert args.prefix_source is PrefixSource.HEARTBEAT
    with pytest.raises(SystemExit):
        router_parser().parse_args(["--insecure", "--prefix-source", "gossip"])


def test_router_pairing_flag() -> None:
    assert router_parser().parse_args(["--insecure"]).pairing is PairingPolicy.COST
    args = router_parser().parse_args(["--insecure", "--pairing", "prefix-slack"])
    assert args.pairing is PairingPolicy.PREFIX_SLACK
    with pytest.raises(SystemExit):
        router_parser().parse_args(["--insecure", "--pairing", "random"])


def test_router_store_kv_events_flag() -> None:
    args = router_parser().parse_args(["--insecure", "--store-kv-events", "tcp://h:5557,tcp://h:5558"])
    assert store_events_endpoint(args.store_kv_events) == P.KVEventsEndpoint("tcp://h:5557", "tcp://h:5558", "")
    assert store_events_endpoint("ipc:///tmp/ev") == P.KVEventsEndpoint("ipc:///tmp/ev", None, "")
    assert store_events_endpoint(None) is None


@pytest.mark.slow
def test_a_cluster_node_publishes_its_blocks_to_a_curve_consumer(tmp_path) -> None:
    """`up`'s processes with --kv-events-config: a consumer holding a key from the cluster's folder subscribes to the
    node over CURVE, as one written for vLLM would, and sees the prompt's full blocks stored."""
    import time

    import httpx
    import zmq

    from common.auth import ServerAuth
    from common.kv_events.codec import BatchDecoder
    from common.kv_events.events import BlockStored

    spec = ClusterSpec(
        prefill=0,
        decode=0,
        colocated=1,
        store=StoreMode.NONE,
        dtype="float32",
        kv_cache_memory="64MiB",
        heartbeat_interval_s=0.2,
        node_args=("--threads", "1"),
        extra_keys=("indexer",),
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/replay"
        ),
    )
    prompt = [1000 + i for i in range(40)]  # 2 full blocks of 16
    with Cluster(spec, log=lambda s: None) as cluster:
        assert cluster.keys is not None
        keys = ServerAuth(cluster.keys.dir / "indexer.key_secret", cluster.keys.authorized).client_keys_for(
            "colocated-0"
        )
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            keys.apply(sub)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{tmp_path}/ev")
            time.sleep(0.5)
            r = httpx.post(
                cluster.url + "/v1/completions",
                json={"model": spec.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            stored: list[BlockStored] = []
            deadline = time.monotonic() + 60
            while not any(e.token_ids[:32] == prompt[:32] for e in stored):
                assert time.monotonic() < deadline and sub.poll(30_000), f"no BlockStored of the prompt: {stored}"
                _, _, payload = sub.recv_multipart()
                stored += [e for e in BatchDecoder().decode(payload).events if isinstance(e, BlockStored)]
            event = next(e for e in stored if e.token_ids[:32] == prompt[:32])
            assert event.parent_block_hash is None and event.block_size == 16 and event.medium == "GPU"
            assert len(event.block_hashes) == 2 and all(
                isinstance(h, bytes) and len(h) == 16 for h in event.block_hashes
            )
        finally:
            ctx.destroy(linger=0)
