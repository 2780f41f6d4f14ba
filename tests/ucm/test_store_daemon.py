"""The store daemon in a subprocess and StoreClient over real ZeroMQ sockets."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
import zmq

from tests.store_helpers import (
    NUM_LAYERS,
    PAYLOAD,
    assert_loaded,
    dump_all,
    dump_load_rounds,
    load_all,
    make_refs,
    payload,
    run_daemon,
    run_threads,
)
from ucm import store_wire as p
from ucm.api import Tier
from ucm.client import StoreClient, StoreUnavailable


def _raw_request(address: str, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "no reply from the daemon"
        return sock.recv_multipart()
    finally:
        sock.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with run_daemon(tmp_path_factory.mktemp("daemon") / "db", "--max-request-bytes", "1MiB", "--max-frames", "16") as d:
        yield d


@pytest.fixture
def client(daemon):
    with StoreClient(daemon.address, timeout_s=5.0) as c:
        yield c


def test_round_trip_and_prefix_lookup(client) -> None:
    refs = make_refs(list(range(100, 124)))
    keys = [r.key for r in refs]
    dump_all(client, refs[:4], commit=False)
    assert client.lookup(keys) == 0  # dumped, not committed
    client.commit(keys[:4], True)
    assert client.lookup(keys) == 4 and client.contains(keys[3:5]) == [True, False]
    ok, failed, dst = load_all(client, refs)
    assert not ok and failed == [4, 5]
    assert_loaded(refs[:4], dst[:4])
    ok, _, dst = load_all(client, refs[1:3], layers=[2])
    assert ok
    assert_loaded(refs[1:3], dst, layers=[2])
    stats = client.stats()
    assert stats.tiers[Tier.DRAM].hits >= 6 and Tier.DISK in stats.tiers
    client.prefetch(keys)  # a hint: harmless for blocks already in DRAM or absent
    client.remove(keys[2:3])
    assert client.lookup(keys) == 2 and client.contains(keys[:4]) == [True, True, False, True]


def test_partial_dump_invisible(client) -> None:
    refs = make_refs(list(range(200, 208)))
    client.dump(refs, 0, NUM_LAYERS, [payload(r, 0) for r in refs]).wait(5)
    client.commit([r.key for r in refs], True)
    assert client.lookup([r.key for r in refs]) == 0
    assert load_all(client, refs)[1] == [0, 1]


def test_garbage_oversized_and_unknown_get_error_replies(daemon, client) -> None:
    cases = [
        ([b"\xc1\xff garbage"], p.ErrorCode.MALFORMED),
        ([msgspec.msgpack.encode([1, 2, 3])], p.ErrorCode.MALFORMED),
        ([msgspec.msgpack.encode({"type": "explode", "req_id": 7})], p.ErrorCode.UNKNOWN_TYPE),
        ([msgspec.msgpack.encode({"type": "lookup", "req_id": 8, "keys": "not a list"})], p.ErrorCode.MALFORMED),
        ([p.encode(p.Lookup(9, [])), b"unexpected data frame"], p.ErrorCode.BAD_REQUEST),
        ([p.encode(p.Dump(10, [], [0], 1)), b"x" * (2 << 20)], p.ErrorCode.TOO_LARGE),  # limit is 1MiB
        ([p.encode(p.Dump(11, [p.WireBlock(b"k" * 16, b"p" * 16, [1])], [0], 1))], p.ErrorCode.BAD_REQUEST),
        ([p.encode(p.Dump(12, [p.WireBlock(b"k" * 16, b"p" * 16, [-1])], [0], 1)), b"x"], p.ErrorCode.BAD_REQUEST),
        ([p.encode(p.Lookup(13, []))] + [b""] * 20, p.ErrorCode.TOO_LARGE),  # over --max-frames 16
        ([p.encode(p.Dump(14, [p.WireBlock(b"short", b"p" * 16, [1])], [0], 1)), b"x"], p.ErrorCode.BAD_REQUEST),
    ]
    for frames, code in cases:
        reply = p.reply_decoder.decode(_raw_request(daemon.address, frames)[0])
        assert isinstance(reply, p.ErrorReply) and reply.code == code, (frames[0][:20], reply)
    assert reply.req_id == 14
    # Over the hard per-frame cap (4x the limit): ZeroMQ drops that connection unread; nobody else notices.
    with pytest.raises(AssertionError, match="no reply"):
        _raw_request(daemon.address, [p.encode(p.Ping(15)), b"x" * (5 << 20)], timeout_ms=500)
    assert daemon.proc.poll() is None
    client.ping()  # still serving
    refs = make_refs(list(range(300, 304)))
    dump_all(client, refs)
    assert load_all(client, refs)[0]


def test_concurrent_clients_same_keys(daemon) -> None:
    refs = make_refs(list(range(400, 432)))  # 8 blocks, dumped and loaded by every thread
    shared = StoreClient(daemon.address, timeout_s=10.0)

    def worker(n: int) -> None:
        if n % 2 == 0:
            dump_load_rounds(shared, refs, 5)
            return
        with StoreClient(daemon.address, timeout_s=10.0) as own:
            dump_load_rounds(own, refs, 5)

    errors = run_threads(worker, 6)
    shared.close()
    assert not errors, errors


def test_unreachable_store_fails_fast_never_hangs(monkeypatch) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    refs = make_refs(list(range(8)))
    with StoreClient(address, timeout_s=0.3, retry_after_s=5.0) as client:
        waited_out: list[str] = []  # calls that waited their whole timeout (a spy: the timeouts are real)
        timed_out = client._timed_out

        def count(breaker, probe: bool) -> None:
            waited_out.append("timeout")
            timed_out(breaker, probe)

        monkeypatch.setattr(client, "_timed_out", count)
        assert client.lookup([r.key for r in refs]) == 0
        assert client.contains([r.key for r in refs]) == [False, False]
        task = client.dump(refs, 0, 1, [b"x", b"y"])
        assert not task.wait(5) and task.failed_blocks == [0, 1]
        ok, failed, _ = load_all(client, refs)
        assert not ok and failed == [0, 1]
        client.commit([r.key for r in refs], True)  # dropped with a warning, no exception
        with pytest.raises(StoreUnavailable):
            client.stats()
        assert waited_out == ["timeout"]  # the first call paid one timeout; every later one failed at once


def test_restart_persistence_and_stats_cli(tmp_path) -> None:
    refs = make_refs(list(range(500, 520)))
    with run_daemon(tmp_path / "db") as d:
        with StoreClient(d.address) as client:
            dump_all(client, refs)
        assert d.stop() == 0  # SIGTERM: flush the write-behind queue, close LMDB
    with run_daemon(tmp_path / "db") as d:
        with StoreClient(d.address) as client:
            assert client.lookup([r.key for r in refs]) == 5
            ok, _, dst = load_all(client, refs)
            assert ok
            assert_loaded(refs, dst)
            assert client.stats().tiers[Tier.DISK].hits == 5
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from ucm.daemon_cli import stats_main; sys.exit(stats_main(sys.argv[1:]))",
                "--connect",
                d.address,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0 and "disk" in out.stdout and "lookups 1: 5/5" in out.stdout, out.stdout
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from ucm.daemon_cli import stats_main; sys.exit(stats_main(sys.argv[1:]))",
                "--connect",
                d.address,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["tiers"]["disk"]["hits"] == 5


def test_dram_only_daemon_payload_sizes() -> None:
    with run_daemon(None) as d, StoreClient(d.address) as client:
        refs = make_refs(list(range(600, 608)))
        dump_all(client, refs, size=PAYLOAD * 64)
        ok, _, dst = load_all(client, refs, size=PAYLOAD * 64)
        assert ok
        assert_loaded(refs, dst)
        assert Tier.DISK not in client.stats().tiers
