"""Issue 11, store side: hostile frames, sizes, forged keys and unauthenticated peers against a real daemon
process (real ZeroMQ sockets, real LMDB). No sleeps: every wait is a socket poll or a client timeout."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from common.auth import ClientAuth, generate_keys
from common.keys import chain_key
from tests.store_helpers import (
    BLOCK_SIZE,
    NUM_LAYERS,
    PAYLOAD,
    assert_loaded,
    dump_all,
    load_all,
    make_refs,
    payload,
    run_daemon,
)
from ucm import store_wire as p
from ucm.api import BlockRef, Tier
from ucm.client import StoreClient, StoreRequestError, StoreUnavailable
from ucm.daemon_cli import main as daemon_main
from ucm.shared_segment import shm_available

LAYOUT = p.Layout(NUM_LAYERS, PAYLOAD, BLOCK_SIZE)


def _exchange(address: str, messages: list[list[bytes]], timeout_ms: int = 5000) -> list[p.Reply]:
    """Send every message on one raw DEALER socket, then read one reply per message (in order)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for frames in messages:
            sock.send_multipart(frames)
        replies = []
        for _ in messages:
            assert sock.poll(timeout_ms), f"no reply after {len(replies)} of {len(messages)} messages"
            replies.append(p.reply_decoder.decode(sock.recv_multipart()[0]))
        return replies
    finally:
        sock.close()


def _settled_stats(client: StoreClient, timeout_s: float = 20.0):
    """Stats once earlier commits have reached LMDB (`pending_blocks` counts those still being written behind)."""
    deadline = time.monotonic() + timeout_s
    while (stats := client.stats()).pending_blocks and time.monotonic() < deadline:
        pass  # each round trip is the wait; the write-behind thread drains meanwhile
    assert stats.pending_blocks == 0, f"write-behind did not drain in {timeout_s} s: {stats}"
    return stats


def _error_codes(replies: list[p.Reply]) -> list[p.ErrorCode]:
    assert all(isinstance(r, p.ErrorReply) for r in replies), [r for r in replies if not isinstance(r, p.ErrorReply)][
        :3
    ]
    return [r.code for r in replies]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with run_daemon(tmp_path_factory.mktemp("secure") / "db", "--max-request-bytes", "1MiB", "--max-frames", "64") as d:
        yield d


def test_malformed_frames_never_end_the_loop(daemon) -> None:
    rng = random.Random(11)
    deep = b"\x91" * 5000 + b"\xc0"  # 5 kB of nested one-element arrays
    hostile = [
        [b"\xa1\xff"],  # a 1-char str holding invalid UTF-8
        [msgspec.msgpack.encode({"type": []})],
        [deep],
        [b"\x81\xa4type" + deep],  # {"type": <deep>}
        [b"\x82\xa4type\xa6lookup\xa6req_id" + deep],
        [msgspec.msgpack.encode({"type": {"a": 1}, "req_id": [1]})],
        [b""],
    ]
    hostile += [[rng.randbytes(rng.randint(1, 64))] for _ in range(200)]
    codes = _error_codes(_exchange(daemon.address, hostile))
    assert codes[:7] == [p.ErrorCode.MALFORMED] * 7, codes[:7]
    assert set(codes[7:]) <= {p.ErrorCode.MALFORMED, p.ErrorCode.UNKNOWN_TYPE}
    # Wrong frame counts, one exchange each (refusals come from worker threads, out of order with the above).
    wrong_counts = [
        ([p.encode(p.Lookup(1, [])), b"extra data frame"], p.ErrorCode.BAD_REQUEST),
        ([p.encode(p.Dump(2, [p.WireBlock(b"k" * 16, b"p" * 16, [1])], [0], 1))], p.ErrorCode.BAD_REQUEST),  # no data
        ([p.encode(p.Ping(3))] + [b""] * 70, p.ErrorCode.TOO_LARGE),  # over --max-frames 64
    ]
    for frames, code in wrong_counts:
        assert _error_codes(_exchange(daemon.address, [frames])) == [code]
    assert daemon.proc.poll() is None, "the daemon exited"
    with StoreClient(daemon.address) as client:  # and it still serves a normal dump, lookup and load
        refs = make_refs(list(range(1000, 1016)))
        dump_all(client, refs)
        assert client.lookup([r.key for r in refs]) == 4
        ok, _, dst = load_all(client, refs)
        assert ok
        assert_loaded(refs, dst)
        stats = client.stats()
    assert stats.bad_frames >= 200 + 7 + 1, stats  # undecodable + over the frame limit (+ earlier tests' frames)
    assert stats.refused_requests >= 2, stats  # the two well-formed requests with the wrong frame count


def test_sizes_checked_before_anything_is_allocated(daemon) -> None:
    ref = make_refs(list(range(2000, 2004)))[0]
    block = p.WireBlock.of(ref)
    with StoreClient(daemon.address) as client:
        client.open_namespace("sizes", LAYOUT)
        before = _settled_stats(client)
        replies = _exchange(
            daemon.address,
            [
                [p.encode(p.Dump(1, [block], [0], 10**8, "sizes")), b"x" * PAYLOAD],  # the 1.6 GB request
                [p.encode(p.Dump(2, [block], [0], NUM_LAYERS, "sizes")), b"x" * (PAYLOAD - 1)],
                [p.encode(p.Dump(3, [block], [0], NUM_LAYERS, "sizes")), b"x" * (PAYLOAD + 1)],
                [p.encode(p.Dump(4, [block], [0], NUM_LAYERS, "unopened")), b"x" * PAYLOAD],
                [p.encode(p.OpenNamespace(5, "huge", p.Layout(10**8, PAYLOAD, BLOCK_SIZE)))],
                [p.encode(p.OpenNamespace(6, "huge", p.Layout(NUM_LAYERS, 1 << 40, BLOCK_SIZE)))],
                [p.encode(p.OpenNamespace(7, "sizes", p.Layout(NUM_LAYERS, PAYLOAD * 2, BLOCK_SIZE)))],  # redeclared
                [p.encode(p.OpenNamespace(8, "old", LAYOUT, protocol=1))],
            ],
        )
        replies.sort(key=lambda r: r.req_id)  # answered by worker threads, in any order
        assert _error_codes(replies) == [p.ErrorCode.BAD_REQUEST] * 3 + [p.ErrorCode.NO_NAMESPACE] + [
            p.ErrorCode.BAD_REQUEST
        ] * 3 + [p.ErrorCode.VERSION]
        assert "10000000" in replies[0].message and "255 bytes" in replies[1].message
        # Through the client too: a payload of the wrong size fails the task, nothing becomes pending.
        sized = StoreClient(daemon.address, namespace="sizes", layout=LAYOUT)
        with sized:
            task = sized.dump([ref], 0, NUM_LAYERS, [b"x" * (PAYLOAD * 2)])
            assert not task.wait(5) and task.failed_blocks == [0]
            after = client.stats()
            # Nothing the refused requests named was kept: no pending block, not a byte more in DRAM.
            assert after.pending_blocks == before.pending_blocks == 0
            assert after.tiers[Tier.DRAM].bytes_used == before.tiers[Tier.DRAM].bytes_used
            assert after.refused_requests == before.refused_requests + 9  # 8 raw + the client's dump
            dump_all(sized, [ref])  # the declared size is accepted
            assert sized.lookup([ref.key]) == 1
    assert daemon.proc.poll() is None


def test_forged_keys_refused_and_never_served(daemon) -> None:
    real = make_refs(list(range(3000, 3008)))
    other_tokens = (7, 7, 7, 7)
    forged = [
        BlockRef(real[0].key, real[0].parent, other_tokens),  # a real prompt's key over other tokens
        BlockRef(chain_key(real[0].parent, other_tokens), real[0].parent, real[0].token_ids),  # key of other tokens
        BlockRef(bytes(16), real[0].parent, real[0].token_ids),  # any key at all
        BlockRef(real[1].key, real[0].key, real[0].token_ids),  # a correct link, moved one block down
    ]
    with StoreClient(daemon.address) as client:
        for ref in forged:
            for layer in range(NUM_LAYERS):
                task = client.dump([ref], layer, NUM_LAYERS, [payload(ref, layer)])
                assert not task.wait(5) and task.failed_blocks == [0]
            client.commit([ref.key], True)
        assert client.lookup([r.key for r in real]) == 0
        assert client.contains([r.key for r in forged]) == [False] * 4
        assert load_all(client, real[:1])[1] == [0]
        # A forged block inside an otherwise good dump refuses the whole request: nothing of it is kept.
        mixed = [real[0], forged[1]]
        assert not client.dump(mixed, 0, NUM_LAYERS, [payload(r, 0) for r in mixed]).wait(5)
        assert client.stats().pending_blocks == 0
        dump_all(client, real)  # the genuine chain is stored and served
        assert client.lookup([r.key for r in real]) == 2


def test_insecure_flags_conflict(tmp_path, capsys) -> None:
    assert daemon_main(["--insecure", "--curve-keys", str(tmp_path)]) == 2
    assert daemon_main(["--server-key", str(tmp_path / "server.key_secret")]) == 2
    assert "go together" in capsys.readouterr().err


def test_curve_only_authorized_clients_and_owners(tmp_path) -> None:
    assert daemon_main(["keys", str(tmp_path / "keys"), "--clients", "alice,bob"]) == 0
    stranger = generate_keys(tmp_path / "other")  # a valid pair the daemon does not know
    alice_auth, bob_auth = (
        ClientAuth.from_dir(tmp_path / "keys", "alice"),
        ClientAuth.from_dir(tmp_path / "keys", "bob"),
    )
    refs = make_refs(list(range(4000, 4016)))
    keys = [r.key for r in refs]
    with (
        run_daemon(tmp_path / "db", "--curve-keys", str(tmp_path / "keys")) as d,
        StoreClient(d.address, auth=alice_auth) as alice,
        StoreClient(d.address, auth=bob_auth) as bob,
    ):
        dump_all(alice, refs)
        assert alice.lookup(keys) == 4 and bob.lookup(keys) == 4  # reads are shared

        for outsider in (
            StoreClient(d.address, timeout_s=0.5),
            StoreClient(d.address, timeout_s=0.5, auth=stranger.client_auth()),
        ):
            with outsider:
                with pytest.raises(StoreUnavailable):
                    outsider.ping()
                assert outsider.lookup(keys) == 0  # an unreachable store reads as a miss
                outsider.remove(keys)  # dropped: never reaches the daemon
        ok, _, dst = load_all(bob, refs)  # the daemon kept serving authorized clients throughout
        assert ok
        assert_loaded(refs, dst)

        with pytest.raises(StoreRequestError) as refused:
            bob.remove(keys[1:2])
        assert refused.value.code is p.ErrorCode.FORBIDDEN
        assert alice.lookup(keys) == 4

        # Bob cannot add layers to (or commit) a block Alice is still dumping.
        more = make_refs(list(range(4000, 4020)))[4:]
        assert alice.dump(more, 0, NUM_LAYERS, [payload(r, 0) for r in more]).wait(5)
        task = bob.dump(more, 1, NUM_LAYERS, [b"\0" * PAYLOAD])
        assert not task.wait(5) and task.failed_blocks == [0]
        bob.commit([more[0].key], True)
        for layer in range(1, NUM_LAYERS):
            assert alice.dump(more, layer, NUM_LAYERS, [payload(r, layer) for r in more]).wait(5)
        alice.commit([more[0].key], True)
        ok, _, dst = load_all(bob, more)
        assert ok
        assert_loaded(more, dst)  # Alice's bytes, not Bob's zeros

        alice.remove(keys[3:4])  # the owner may
        assert bob.lookup(keys) == 3
        assert bob.stats().refused_requests >= 1

        # What a node gets from its `kv_store` string (the way cluster launchers will pass the keys).
        from connector.factory import open_store
        from connector.store_spec import StoreSpec

        spec = StoreSpec.parse(f"{d.address}?timeout_s=5&curve_keys={tmp_path / 'keys'}&curve_client=alice")
        with open_store(spec) as node_client:
            assert node_client.lookup(keys) == 3


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_curve_dumps_from_shared_memory_read_only_the_clients_own_segment(tmp_path) -> None:
    """With CURVE a same-host client's dumps still skip the frames (and their encryption), and the daemon reads a
    segment only for the client that attached it."""
    assert daemon_main(["keys", str(tmp_path / "keys"), "--clients", "alice,bob"]) == 0
    refs = make_refs(list(range(5000, 5016)))
    with (
        run_daemon(None, "--curve-keys", str(tmp_path / "keys")) as d,
        StoreClient(d.address, auth=ClientAuth.from_dir(tmp_path / "keys", "alice")) as alice,
        StoreClient(d.address, auth=ClientAuth.from_dir(tmp_path / "keys", "bob")) as bob,
    ):
        staging = alice.staging_buffer(len(refs) * PAYLOAD)
        views = [staging[i * PAYLOAD : (i + 1) * PAYLOAD] for i in range(len(refs))]
        for layer in range(NUM_LAYERS):
            for view, ref in zip(views, refs):
                view[:] = payload(ref, layer)
            assert alice.dump(refs, layer, NUM_LAYERS, views).wait(10)
        alice.commit([r.key for r in refs], True)
        assert alice.shared_dumps == NUM_LAYERS
        ok, _, dst = load_all(bob, refs)
        assert ok
        assert_loaded(refs, dst)

        shared = alice._segments.ranges([[views[0]]])
        assert shared is not None
        layout = p.Layout(NUM_LAYERS, PAYLOAD, len(refs[0].token_ids))
        bob.open_namespace("bob", layout)
        more = make_refs(list(range(5000, 5020)))[4:]
        with pytest.raises(StoreRequestError) as refused:
            bob._ask(p.DumpReply, p.Dump, [p.WireBlock.of(more[0])], [0], NUM_LAYERS, "bob", shared[1])
        assert refused.value.code is p.ErrorCode.NO_SEGMENT, "Bob cannot make the daemon read Alice's staging"
        assert bob.stats().pending_blocks == 0
