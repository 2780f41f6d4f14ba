"""KV events in vLLM's wire format (common/kv_events/), on real ZeroMQ sockets: the config, both encodings, the
frames a publisher sends, replay, gap repair, the resets that keep a consumer from keeping a removed block, CURVE."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from common.auth import ClientAuth, PublisherAuth, ServerAuth, generate_keys
from common.kv_events import endpoints
from common.kv_events.codec import BatchDecoder, encode_batch
from common.kv_events.config import KVEventsConfig, check_node_offsets, parse_kv_events_config
from common.kv_events.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_stored,
    medium_of,
)
from common.kv_events.publisher import END_SEQ, ZmqEventPublisher, seq_bytes
from common.kv_events.subscriber import EventStream, StreamPoller

KEY = [bytes([i]) * 16 for i in range(64)]


def _config(tmp_path, **fields) -> KVEventsConfig:
    fields.setdefault("endpoint", f"ipc://{tmp_path}/pub")
    fields.setdefault("replay_endpoint", f"ipc://{tmp_path}/replay")
    return KVEventsConfig(enable_kv_cache_events=True, **fields)


def _stored(i: int) -> BlockStored:
    return block_stored([KEY[i]], None, [i] * 4, 4)


class Collector:
    """An EventStream's apply/reset, recorded."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.batches: list[KVEventBatch] = []
        self.resets: list[str] = []

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        self.seqs.append(seq)
        self.batches.append(batch)

    def reset(self, why: str) -> None:
        self.resets.append(why)


def _pump(poller: StreamPoller, until, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "timed out"
        poller.poll(20)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# ------------------------------------------------------------------ config


def test_config_is_vllms_json_typed() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert cfg.enabled and cfg.publisher_kind == "zmq" and cfg.endpoint == "tcp://*:6000" and cfg.topic == "kv"
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.replay_endpoint) == (10_000, 100_000, 100_000, None)
    assert not parse_kv_events_config("{}").enabled  # vLLM: publisher "null" unless events are enabled
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert parse_kv_events_config(cfg.to_json()) == cfg
    for text, words in [
        ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}', ["unknown field `endpiont`", "endpoint"]),
        ('{"enable_kv_cache_events": tru', ["not a JSON object"]),
        ('["zmq"]', ["Expected `object`"]),
        ('{"publisher": "kafka"}', ["publisher"]),
        ('{"buffer_steps": 0}', ["buffer_steps must be >= 1"]),
        ('{"endpoint": "http://x:1"}', ["not a ZeroMQ address"]),
        ('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"}', ["must differ"]),
    ]:
        with pytest.raises(ValueError) as e:
            parse_kv_events_config(text)
        assert all(w in str(e.value) for w in words), (text, str(e.value))


def test_endpoints_bind_connect_offset_and_reach() -> None:
    assert (
        endpoints.is_bind("tcp://*:5557") and endpoints.is_bind("ipc:///tmp/x") and endpoints.is_bind("tcp://0.0.0.0:1")
    )
    assert not endpoints.is_bind("tcp://indexer:5557")  # vLLM connects to a consumer that binds
    assert endpoints.offset("tcp://*:5557", 2) == "tcp://*:5559" and endpoints.offset("tcp://*:0", 2) == "tcp://*:0"
    assert (
        endpoints.offset("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
        and endpoints.offset("ipc:///tmp/ev", 0) == "ipc:///tmp/ev"
    )
    assert endpoints.reachable("tcp://0.0.0.0:5557", "tcp://127.0.0.1:7000") == "tcp://127.0.0.1:5557"
    assert endpoints.reachable("tcp://10.1.2.3:5557", "tcp://127.0.0.1:7000") == "tcp://10.1.2.3:5557"
    cfg = parse_kv_events_config('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}')
    assert cfg.for_node(3).endpoint == "tcp://*:5560" and cfg.for_node(3).replay_endpoint == "tcp://*:5561"
    check_node_offsets(cfg, 1)
    with pytest.raises(ValueError, match="at least 2 apart"):
        check_node_offsets(cfg, 2)


def test_media_name_our_tiers_in_vllms_words() -> None:
    assert (medium_of("device"), medium_of("dram"), medium_of("disk")) == (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
    with pytest.raises(ValueError, match="tier 'tape'"):
        medium_of("tape")


# ------------------------------------------------------------------ encodings


def test_encoding_is_vllm_032s_maps_and_both_decode() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[block_stored(KEY[:2], None, list(range(8)), 4), BlockRemoved([KEY[0]], MEDIUM_GPU), AllBlocksCleared()],
        data_parallel_rank=0,
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": KEY[:2],
                "parent_block_hash": None,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [KEY[0]], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    decoder = BatchDecoder()
    assert decoder.decode(encode_batch(batch)) == batch
    # vLLM before 0.11: positional events, fields appended over versions (no medium, no lora_name, no rank)
    old = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [7, 8], 6, [1, 2, 3, 4, 5, 6, 7, 8], 4, None],
                ["BlockRemoved", [7]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    got = decoder.decode(old)
    assert got.ts == 2.0 and got.data_parallel_rank is None
    stored, removed, cleared = got.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [7, 8] and stored.parent_block_hash == 6
    assert stored.medium is None and stored.lora_name is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [7] and isinstance(cleared, AllBlocksCleared)
    newer = msgspec.msgpack.encode(
        [
            3.0,
            [
                ["BlockStored", [9], None, [1], 1, None, "CPU", None, None, 0, "full", None, None, None, "s", "extra!"],
                {"type": "BlockMoved", "block_hashes": [9]},  # a type from a vLLM newer than us
                {"type": "BlockRemoved", "block_hashes": [9], "medium": "CPU", "brand_new_field": 1},
                ["SomethingElse", 1],
            ],
            1,
        ]
    )
    got = decoder.decode(newer)
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockRemoved"] and decoder.unknown_events == 2
    assert got.events[0].medium == "CPU" and got.events[0].session_id == "s"
    for bad in (b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])):
        with pytest.raises(ValueError):
            decoder.decode(bad)


# ------------------------------------------------------------------ publisher and subscriber


def test_publisher_frames_and_replay_as_vllm_sends_them(tmp_path, ctx) -> None:
    pub = ZmqEventPublisher(_config(tmp_path, topic="kv", buffer_steps=3))
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        time.sleep(0.2)  # the slow joiner
        for i in range(5):
            pub.publish([_stored(i)], ts=float(i))
        for i in range(5):
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and seq == i.to_bytes(8, "big")
            assert BatchDecoder().decode(payload) == KVEventBatch(float(i), [_stored(i)], 0)
        replay = ctx.socket(zmq.REQ)  # vLLM's example subscriber asks with a REQ socket
        replay.connect(pub.replay_endpoint)
        replay.send((1).to_bytes(8, "big"))
        assert replay.poll(5000)
        topic, seq, payload = replay.recv_multipart()  # the ring holds 2, 3, 4: the first answer is 2
        assert (topic, seq) == (b"kv", seq_bytes(2)) and BatchDecoder().decode(payload).events == [_stored(2)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", seq_bytes(3)))
        frames = [dealer.recv_multipart() for _ in range(3)]
        assert [f[2] for f in frames] == [seq_bytes(3), seq_bytes(4), END_SEQ] and frames[2] == [b"", b"", END_SEQ, b""]
        assert pub.published == 5 and pub.replays == 2
    finally:
        pub.close()


def test_stream_catches_up_repairs_a_gap_and_skips_duplicates(tmp_path, ctx) -> None:
    pub = ZmqEventPublisher(_config(tmp_path))
    poller, got = StreamPoller(), Collector()
    try:
        for i in range(3):  # before anyone subscribes: learnt from the replay the stream asks for at start
            pub.publish([_stored(i)])
        stream = EventStream(ctx, poller, pub.endpoint, pub.replay_endpoint, got.apply, got.reset)
        _pump(poller, lambda: got.seqs == [0, 1, 2])
        # A gap: the SUB socket loses batches 3 and 4 (unsubscribed while they go out), then sees 5.
        stream.sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        time.sleep(0.2)
        pub.publish([_stored(3)])
        pub.publish([_stored(4)])
        time.sleep(0.2)
        stream.sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.2)
        pub.publish([_stored(5)])
        _pump(poller, lambda: got.seqs[-1:] == [5])
        assert got.seqs == [0, 1, 2, 3, 4, 5] and got.resets == [] and stream.replays == 2
        assert [b.events[0].block_hashes for b in got.batches] == [[KEY[i]] for i in range(6)]
        stream.close()
    finally:
        pub.close()


def test_stream_resets_when_batches_are_gone_for_good(tmp_path, ctx) -> None:
    pub = ZmqEventPublisher(_config(tmp_path, buffer_steps=2))
    poller, got = StreamPoller(), Collector()
    try:
        stream = EventStream(ctx, poller, pub.endpoint, pub.replay_endpoint, got.apply, got.reset)
        time.sleep(0.2)
        pub.publish([_stored(0)])
        _pump(poller, lambda: got.seqs == [0])
        stream.sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        time.sleep(0.2)
        for i in range(1, 5):  # 1..4 go out unseen
            pub.publish([_stored(i)])
        time.sleep(0.2)
        stream.sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.2)
        pub.publish([_stored(5)])
        _pump(poller, lambda: got.seqs[-1:] == [5])
        # The ring (2 batches) holds 4 and 5 when the replay is asked for: 1..3 (a BlockRemoved among them, maybe)
        # are lost, so forget the node and go on from what is left.
        assert len(got.resets) == 1 and "1..3" in got.resets[0] and got.seqs == [0, 4, 5]
        stream.close()
    finally:
        pub.close()


def test_stream_without_replay_resets_on_a_gap_and_on_a_publisher_restart(tmp_path, ctx) -> None:
    cfg = _config(tmp_path, replay_endpoint=None)
    pub = ZmqEventPublisher(cfg)
    poller, got = StreamPoller(), Collector()
    stream = EventStream(ctx, poller, pub.endpoint, None, got.apply, got.reset)
    time.sleep(0.2)
    pub.publish([_stored(0)])
    _pump(poller, lambda: got.seqs == [0])
    stream.sub.setsockopt(zmq.UNSUBSCRIBE, b"")
    time.sleep(0.2)
    pub.publish([_stored(1)])
    time.sleep(0.2)
    stream.sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.2)
    pub.publish([_stored(2)])
    _pump(poller, lambda: got.seqs == [0, 2])
    assert len(got.resets) == 1
    for _ in range(60):  # on to sequence 62, so a restarted publisher's first batches all come before it
        pub.publish([_stored(2)])
    _pump(poller, lambda: got.seqs[-1:] == [62])
    pub.close()
    pub = ZmqEventPublisher(cfg)  # restarted on the same address: its sequence starts at 0 again
    try:
        for _ in range(50):  # until the SUB socket has reconnected (nothing replays what it missed before)
            pub.publish([_stored(7)])
            poller.poll(100)
            if got.seqs[-1] < 62:
                break
        assert got.seqs[-1] < 62 and len(got.resets) == 2 and "restarted" in got.resets[1]
    finally:
        stream.close()
        pub.close()


def _recv(sock: zmq.Socket, poller: StreamPoller, timeout_s: float = 10.0) -> list[bytes]:
    """The test's own socket's next message, pumping the stream meanwhile (it sends when polled)."""
    deadline = time.monotonic() + timeout_s
    while not sock.poll(0):
        assert time.monotonic() < deadline, "timed out"
        poller.poll(20)
    return sock.recv_multipart()


def test_a_live_batch_that_overtakes_the_replay_asks_for_the_gap_again(tmp_path, ctx) -> None:
    """The order the network may choose, forced: a live batch past the replay's last one arrives before the replay's
    end marker. The stream asks for the batches between once more rather than resetting; a replay that brings
    nothing then ends in the reset, so it cannot ask forever."""
    pub, replay = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)  # the publisher's two sockets, driven by the test
    pub.bind(f"ipc://{tmp_path}/pub")
    replay.bind(f"ipc://{tmp_path}/replay")
    poller, got = StreamPoller(), Collector()
    stream = EventStream(ctx, poller, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", got.apply, got.reset)

    def ask() -> tuple[bytes, int]:  # the stream's next replay request: (its client id, start)
        client, _, start = _recv(replay, poller)
        return client, int.from_bytes(start, "big")

    def payload(seq: int) -> bytes:
        return encode_batch(KVEventBatch(0.0, [_stored(seq)]))

    def answer(client: bytes, seqs: list[int], end: bool = True) -> None:
        for seq in seqs:
            replay.send_multipart((client, b"", b"", seq_bytes(seq), payload(seq)))
        if end:
            replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def live_held(seq: int) -> None:  # live batch `seq`, sent and held by the stream (a replay is in flight)
        before = stream.held
        pub.send_multipart((b"", seq_bytes(seq), payload(seq)))
        _pump(poller, lambda: stream.held == before + 1)

    try:
        assert _recv(pub, poller)[0] == b"\x01"  # subscribed: live batches reach it from here on
        client, start = ask()
        assert start == 0
        answer(client, [0, 1], end=False)
        _pump(poller, lambda: got.seqs == [0, 1])
        live_held(3)  # overtakes the replay, which has not brought 2 (yet)
        answer(client, [])
        client, start = ask()
        assert start == 2 and got.resets == [] and got.seqs == [0, 1]
        answer(client, [2, 3])
        _pump(poller, lambda: stream.deadline is None)  # the replay's end
        assert got.seqs == [0, 1, 2, 3] and got.resets == [] and stream.replays == 2

        # Once more where the batch between is gone for good: the second replay brings nothing, so the stream resets
        # and goes on from the held batch.
        pub.send_multipart((b"", seq_bytes(6), payload(6)))  # 4 and 5 never reach it
        client, start = ask()
        assert start == 4
        live_held(8)
        answer(client, [4, 5, 6])  # 7 is not in the buffer any more
        client, start = ask()
        assert start == 7 and got.seqs == [0, 1, 2, 3, 4, 5, 6] and got.resets == []
        answer(client, [])
        _pump(poller, lambda: got.seqs[-1:] == [8])
        assert len(got.resets) == 1 and "7..7" in got.resets[0] and stream.replays == 4
    finally:
        stream.close()
        pub.close(0)
        replay.close(0)


def test_a_replay_nobody_answers_is_given_up(tmp_path, ctx) -> None:
    pub = ZmqEventPublisher(_config(tmp_path, replay_endpoint=None))
    poller, got = StreamPoller(), Collector()
    try:  # a replay address where nothing answers
        silent = ctx.socket(zmq.ROUTER)
        silent.bind(f"ipc://{tmp_path}/silent")
        stream = EventStream(
            ctx, poller, pub.endpoint, f"ipc://{tmp_path}/silent", got.apply, got.reset, replay_timeout_s=0.3
        )
        time.sleep(0.2)
        pub.publish([_stored(0)])
        pub.publish([_stored(1)])
        _pump(poller, lambda: got.seqs == [0, 1])  # held during the replay, applied once it is given up
        assert stream.deadline is None and got.resets == []
        stream.close()
    finally:
        pub.close()


def test_curve_publisher_refuses_unknown_keys(tmp_path, ctx) -> None:
    keys = generate_keys(tmp_path / "keys", ("decode-0", "indexer"))
    auth = PublisherAuth.from_client(ClientAuth.for_router(keys.dir, "decode-0"))  # the node's pair
    pub = ZmqEventPublisher(_config(tmp_path), auth)
    try:
        router = keys.router_auth().client_keys_for("decode-0")  # the router's pair, decode-0's public key
        indexer = ServerAuth(keys.dir / "indexer.key_secret", keys.authorized).client_keys_for("decode-0")
        stranger_public, stranger_secret = zmq.curve_keypair()
        poller = StreamPoller()
        seen: dict[str, Collector] = {}
        for name, curve in (("router", router), ("indexer", indexer)):
            seen[name] = Collector()
            EventStream(ctx, poller, pub.endpoint, pub.replay_endpoint, seen[name].apply, seen[name].reset, keys=curve)
        plain = ctx.socket(zmq.SUB)
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        plain.connect(pub.endpoint)
        stranger = ctx.socket(zmq.SUB)
        stranger.setsockopt(zmq.SUBSCRIBE, b"")
        stranger.curve_publickey, stranger.curve_secretkey = stranger_public, stranger_secret
        stranger.curve_serverkey = router.server_public
        stranger.connect(pub.endpoint)
        time.sleep(0.5)
        pub.publish([_stored(0)])
        _pump(poller, lambda: all(c.seqs == [0] for c in seen.values()))
        assert not plain.poll(300) and not stranger.poll(300)
    finally:
        pub.close()
