"""Loads a same-host daemon writes straight into the client's shared memory (ucm/shared_segment.py): the bytes,
the fallback to frames, re-attaching after the daemon dropped a mapping, and what a hostile peer cannot make the
daemon do. Real daemon processes, real /dev/shm, real ZeroMQ."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import numpy as np
import pytest
import zmq

from tests.store_helpers import BLOCK_SIZE, NUM_LAYERS, PAYLOAD, assert_loaded, dump_all, make_refs, payload, run_daemon
from ucm import store_wire as p
from ucm.client import StoreClient
from ucm.shared_segment import HEADER_NBYTES, SHM_DIR, SharedSegment, shm_available, sweep_dead_segments

pytestmark = pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")


def _load_into_staging(client: StoreClient, refs, staging: memoryview):
    """Load every layer of `refs` into consecutive PAYLOAD-sized slices of `staging`; (ok, failed, rows)."""
    rows = [
        [staging[(i * NUM_LAYERS + j) * PAYLOAD : (i * NUM_LAYERS + j + 1) * PAYLOAD] for j in range(NUM_LAYERS)]
        for i in range(len(refs))
    ]
    task = client.load(refs, list(range(NUM_LAYERS)), rows)
    return task.wait(10), task.failed_blocks, rows


def _segment_files() -> set[str]:
    return {f.name for f in SHM_DIR.glob(f"ucm-seg-{os.getpid()}-*")}


def test_shared_load_equals_stored_bytes_and_skips_frames() -> None:
    refs = make_refs(list(range(1, 1 + 4 * 16)))
    with run_daemon() as daemon, StoreClient(daemon.address, timeout_s=10) as client:
        dump_all(client, refs)
        staging = client.staging_buffer(len(refs) * NUM_LAYERS * PAYLOAD)
        ok, failed, rows = _load_into_staging(client, refs, staging)
        assert ok and failed == []
        assert_loaded(refs, rows)
        assert client.shared_loads == 1, "a same-host daemon writes the load into shared memory"
        assert client.stats().shared_memory_loads == 1
        # A miss in the middle: the block fails, the others still land, nothing counts it as loaded.
        ghost = make_refs(list(range(1000, 1000 + 16)))[0]
        ok, failed, rows = _load_into_staging(client, [refs[0], ghost], staging)
        assert not ok and failed == [1]
        assert_loaded([refs[0]], rows[:1])
        names = _segment_files()
        assert len(names) == 1
    assert _segment_files() == set(), "close() unlinks the client's segments"


def test_without_shared_memory_the_same_bytes_come_as_frames() -> None:
    refs = make_refs(list(range(1, 1 + 3 * 16)))
    with run_daemon() as daemon, StoreClient(daemon.address, timeout_s=10, shared_memory=False) as client:
        dump_all(client, refs)
        staging = client.staging_buffer(len(refs) * NUM_LAYERS * PAYLOAD)
        ok, _, rows = _load_into_staging(client, refs, staging)
        assert ok
        assert_loaded(refs, rows)
        assert client.shared_loads == 0 and _segment_files() == set()
        assert client.stats().shared_memory_loads == 0


def test_a_dropped_mapping_is_attached_again() -> None:
    """The daemon maps at most --max-segments: the second segment pushes the first out, whose next load gets
    NO_SEGMENT, attaches again and still lands in shared memory (a daemon restart looks the same to the client)."""
    refs = make_refs(list(range(1, 1 + 2 * 16)))
    nbytes = len(refs) * NUM_LAYERS * PAYLOAD
    with run_daemon(None, "--max-segments", "1") as daemon, StoreClient(daemon.address, timeout_s=10) as client:
        dump_all(client, refs)
        first = client.staging_buffer(nbytes)
        second = client.staging_buffer(nbytes)  # attaching it drops the first's mapping
        for staging in (first, second, first):
            ok, _, rows = _load_into_staging(client, refs, staging)
            assert ok
            assert_loaded(refs, rows)
        assert client.shared_loads == 3


def test_daemon_restart_then_load_reattaches(tmp_path) -> None:
    """The same client and segment across a daemon restart: the new daemon answers NO_SEGMENT, the client attaches
    the segment again and the load lands in it."""
    refs = make_refs(list(range(1, 1 + 2 * 16)))
    with run_daemon(tmp_path / "lmdb") as daemon:
        address = daemon.address
        client = StoreClient(address, timeout_s=10)
        try:
            dump_all(client, refs)
            staging = client.staging_buffer(len(refs) * NUM_LAYERS * PAYLOAD)
            assert _load_into_staging(client, refs, staging)[0]
            daemon.stop()
            with run_daemon(tmp_path / "lmdb", "--bind", address) as again:
                assert again.address == address
                ok, _, rows = _load_into_staging(client, refs, staging)
                assert ok, "the restarted daemon serves its LMDB blocks into the re-attached segment"
                assert_loaded(refs, rows)
                assert client.shared_loads == 2
        finally:
            client.close()


def test_dumps_from_shared_memory_store_the_same_bytes() -> None:
    """A dump from staging memory goes without frames; the daemon copies it before answering, so overwriting the
    staging afterwards changes nothing stored; a client without shared memory reads the same bytes back."""
    refs = make_refs(list(range(1, 1 + 3 * 16)))
    with run_daemon() as daemon, StoreClient(daemon.address, timeout_s=10) as client:
        staging = client.staging_buffer(len(refs) * PAYLOAD)
        for layer in range(NUM_LAYERS):
            views = [staging[i * PAYLOAD : (i + 1) * PAYLOAD] for i in range(len(refs))]
            for view, ref in zip(views, refs):
                view[:] = payload(ref, layer)
            assert client.dump(refs, layer, NUM_LAYERS, views).wait(10)
            staging[: len(refs) * PAYLOAD] = bytes(len(refs) * PAYLOAD)  # reused at once, as a connector does
        client.commit([r.key for r in refs], True)
        assert client.shared_dumps == NUM_LAYERS
        assert client.stats().shared_memory_dumps == NUM_LAYERS
        with StoreClient(daemon.address, timeout_s=10, shared_memory=False) as reader:
            rows = [[bytearray(PAYLOAD) for _ in range(NUM_LAYERS)] for _ in refs]
            assert reader.load(refs, list(range(NUM_LAYERS)), rows).wait(10)
            assert_loaded(refs, rows)
            assert reader.shared_dumps == 0 and reader.shared_loads == 0


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "frames"])
def test_dump_layers_sends_every_layer_in_one_request(shared: bool) -> None:
    refs = make_refs(list(range(1, 1 + 2 * 16)))
    with run_daemon() as daemon, StoreClient(daemon.address, timeout_s=10, shared_memory=shared) as client:
        staging = client.staging_buffer(len(refs) * NUM_LAYERS * PAYLOAD)
        rows = [
            [staging[(i * NUM_LAYERS + j) * PAYLOAD : (i * NUM_LAYERS + j + 1) * PAYLOAD] for j in range(NUM_LAYERS)]
            for i in range(len(refs))
        ]
        for ref, row in zip(refs, rows):
            for layer, view in enumerate(row):
                view[:] = payload(ref, layer)
        with pytest.raises(ValueError, match="distinct"):
            client.dump_layers(refs, [0, 0], NUM_LAYERS, [row[:2] for row in rows])
        assert client.dump_layers(refs, list(range(NUM_LAYERS)), NUM_LAYERS, rows).wait(10)
        client.commit([r.key for r in refs], True)
        assert client.shared_dumps == (1 if shared else 0)
        assert client.lookup([r.key for r in refs]) == len(refs), "every layer landed: the commit published them"
        ok, _, loaded = _load_into_staging(client, refs, client.staging_buffer(len(refs) * NUM_LAYERS * PAYLOAD))
        assert ok
        assert_loaded(refs, loaded)


# --- what a peer cannot make the daemon do ----------------------------------------------------------------


def _ask(address: str, msg: p.Request) -> p.Reply:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(p.encode(msg))
        assert sock.poll(5000), "the daemon did not answer"
        return p.reply_decoder.decode(sock.recv_multipart()[0])
    finally:
        sock.close()


def _code(reply: p.Reply) -> p.ErrorCode | None:
    return reply.code if isinstance(reply, p.ErrorReply) else None


def test_attach_checks_name_token_and_size(tmp_path) -> None:
    segment = SharedSegment(64 << 10)
    try:
        with run_daemon() as daemon:
            a = daemon.address
            assert _code(_ask(a, p.AttachShm(1, segment.name, segment.nbytes, secrets.token_bytes(16)))) is (
                p.ErrorCode.BAD_REQUEST
            ), "a peer that cannot read the file does not know its token"
            assert _code(_ask(a, p.AttachShm(2, segment.name, segment.nbytes + 4096, segment.token))) is (
                p.ErrorCode.BAD_REQUEST
            ), "the size must be the file's"
            for name in ("../../etc/passwd", "ucm-seg-1-" + "0" * 31 + "/", str(tmp_path)):
                assert _code(_ask(a, p.AttachShm(3, name, 8192, segment.token))) is p.ErrorCode.BAD_REQUEST
            link = SHM_DIR / f"ucm-seg-{os.getpid()}-{secrets.token_hex(16)}"
            link.symlink_to(segment.path)
            try:
                assert _code(_ask(a, p.AttachShm(4, link.name, segment.nbytes, segment.token))) is (
                    p.ErrorCode.BAD_REQUEST
                ), "links are not followed"
            finally:
                link.unlink()
            assert isinstance(_ask(a, p.AttachShm(5, segment.name, segment.nbytes, segment.token)), p.OkReply)
    finally:
        segment.unlink()


def test_loads_stay_inside_the_segment_payload() -> None:
    refs = make_refs(list(range(1, 1 + 16)))
    segment = SharedSegment(NUM_LAYERS * PAYLOAD)
    try:
        with run_daemon() as daemon, StoreClient(daemon.address, timeout_s=10) as client:
            dump_all(client, refs)
            wire = [p.WireBlock.of(refs[0])]
            assert isinstance(
                _ask(daemon.address, p.AttachShm(1, segment.name, segment.nbytes, segment.token)), p.OkReply
            )
            # Not into the header (the token), not past the end: refused, and nothing is written.
            for offsets in ([0], [segment.nbytes - PAYLOAD + 1], [-HEADER_NBYTES]):
                dest = p.ShmRanges(segment.name, offsets, [PAYLOAD])
                assert _code(_ask(daemon.address, p.Load(2, wire, [0], dest))) is p.ErrorCode.BAD_REQUEST
            assert segment.array[:16].tobytes() == segment.token
            assert not segment.array[HEADER_NBYTES:].any()
            # A segment this peer never attached (a DEALER is its own client only with CURVE; without it every
            # peer is one identity, so use a name no one attached).
            other = p.ShmRanges(f"ucm-seg-{os.getpid()}-{secrets.token_hex(16)}", [HEADER_NBYTES], [PAYLOAD])
            assert _code(_ask(daemon.address, p.Load(3, wire, [0], other))) is p.ErrorCode.NO_SEGMENT
            good = p.ShmRanges(segment.name, [HEADER_NBYTES], [PAYLOAD])
            reply = _ask(daemon.address, p.Load(4, wire, [0], good))
            assert isinstance(reply, p.LoadReply) and reply.failed == []
            got = segment.array[HEADER_NBYTES : HEADER_NBYTES + PAYLOAD].tobytes()
            assert_loaded(refs[:1], [[got]], layers=[0])
    finally:
        segment.unlink()


def test_dumps_read_only_inside_the_segment_payload() -> None:
    refs = make_refs(list(range(1, 1 + 16)))
    segment = SharedSegment(NUM_LAYERS * PAYLOAD)
    try:
        with run_daemon() as daemon:
            a = daemon.address
            layout = p.Layout(NUM_LAYERS, PAYLOAD, BLOCK_SIZE)
            assert isinstance(_ask(a, p.OpenNamespace(1, "ns", layout)), p.OkReply)
            assert isinstance(_ask(a, p.AttachShm(2, segment.name, segment.nbytes, segment.token)), p.OkReply)
            wire = [p.WireBlock.of(refs[0])]

            def dump(req_id: int, offsets: list[int], lengths: list[int], name: str = segment.name) -> p.Reply:
                return _ask(a, p.Dump(req_id, wire, [0], NUM_LAYERS, "ns", p.ShmRanges(name, offsets, lengths)))

            # Not out of the header (the token), not past the end, one range per block, the declared size.
            for req_id, offsets, lengths in (
                (3, [0], [PAYLOAD]),
                (4, [segment.nbytes - PAYLOAD + 1], [PAYLOAD]),
                (5, [HEADER_NBYTES, HEADER_NBYTES], [PAYLOAD, PAYLOAD]),
                (6, [HEADER_NBYTES], [PAYLOAD - 1]),
            ):
                assert _code(dump(req_id, offsets, lengths)) is p.ErrorCode.BAD_REQUEST, offsets
            for layers in ([0, 0], [NUM_LAYERS]):  # a layer twice, a layer that does not exist
                ranges = p.ShmRanges(segment.name, [HEADER_NBYTES] * len(layers), [PAYLOAD] * len(layers))
                reply = _ask(a, p.Dump(11, wire, layers, NUM_LAYERS, "ns", ranges))
                assert _code(reply) is p.ErrorCode.BAD_REQUEST, layers
            ghost = f"ucm-seg-{os.getpid()}-{secrets.token_hex(16)}"
            assert _code(dump(7, [HEADER_NBYTES], [PAYLOAD], ghost)) is p.ErrorCode.NO_SEGMENT
            assert _ask(a, p.GetStats(8)).stats.pending_blocks == 0, "a refused dump stores nothing"
            segment.array[HEADER_NBYTES : HEADER_NBYTES + PAYLOAD] = np.frombuffer(payload(refs[0], 0), np.uint8)
            reply = dump(9, [HEADER_NBYTES], [PAYLOAD])
            assert isinstance(reply, p.DumpReply) and reply.failed == []
            assert _ask(a, p.GetStats(10)).stats.pending_blocks == 1
    finally:
        segment.unlink()


def test_segments_of_dead_processes_are_swept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = SHM_DIR / f"ucm-seg-{pid}-{secrets.token_hex(16)}"
    stale.write_bytes(np.zeros(16, np.uint8).tobytes())
    mine = SharedSegment(4096)
    try:
        assert sweep_dead_segments() >= 1
        assert not stale.exists(), "a dead process's segment is removed"
        assert mine.path.exists(), "a live process's segment stays"
    finally:
        stale.unlink(missing_ok=True)
        mine.unlink()
