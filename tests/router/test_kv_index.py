"""The router's KV event index (router/kv_index.py) on real ZeroMQ: what each node holds per medium, forgotten at
once on AllBlocksCleared, a drop or a new incarnation; gaps repaired by replay and resets when batches are gone;
CURVE; the pairing's use of it; and the live router indexing a real node runtime from its Register."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import zmq

from common.auth import ClientAuth, PublisherAuth, generate_keys
from common.keys import KeyNamespace, block_keys, root_key
from common.kv_events.codec import encode_batch
from common.kv_events.config import KVEventsConfig
from common.kv_events.events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    KVEvent,
    KVEventBatch,
    block_stored,
)
from common.kv_events.publisher import END_SEQ, SNAPSHOT_SEQ, ZmqEventPublisher, seq_bytes
from protocol import messages as P
from router.kv_index import KVIndex
from router.pairing import pick_prefill
from router.registry import Registry
from tests.node_helpers import FakeEngine

NS = KeyNamespace("fp", "float32", 4)
PROMPT = list(range(24))
KEYS = block_keys(root_key(NS), PROMPT, 4)  # 6 blocks


def _until(what: str, condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _publisher(tmp_path, name: str, auth: PublisherAuth | None = None, **fields) -> ZmqEventPublisher:
    fields.setdefault("replay_endpoint", f"ipc://{tmp_path}/{name}-replay")
    return ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/{name}-pub", **fields), auth
    )


def _announce(pub: ZmqEventPublisher) -> P.KVEventsEndpoint:
    return P.KVEventsEndpoint(pub.endpoint, pub.replay_endpoint, pub.config.topic)


def _stored(keys, medium: str = "GPU") -> KVEvent:
    return block_stored(list(keys), None, [0] * 4 * len(keys), 4, medium)


@pytest.fixture
def index():
    idx = KVIndex(replay_timeout_s=0.5)
    yield idx
    idx.close()


def test_holders_per_node_and_medium(tmp_path, index) -> None:
    a, b = _publisher(tmp_path, "a"), _publisher(tmp_path, "b")
    try:
        a.publish([_stored(KEYS[:4])])  # before the index subscribes: learnt by replay
        index.track("a", "i", _announce(a))
        index.track("b", "i", _announce(b))
        b.publish([_stored(KEYS[:2]), _stored(KEYS[:6], MEDIUM_CPU)])
        _until("both nodes indexed", lambda: index.holders(KEYS) == {"a": 4, "b": 2})
        assert index.holders(KEYS, MEDIUM_CPU) == {"b": 6}
        assert index.holders([KEYS[0], bytes(16), KEYS[2]]) == {"a": 1, "b": 1}
        assert index.prefix_hits(["a", "b", "c"], KEYS) == {"a": 4, "b": 2}  # c: not indexed (heartbeats)
        assert index.prefix_hits(["a", "b"], [b"other" * 3]) == {"a": 0, "b": 0}
        a.publish([BlockRemoved([KEYS[1]], "GPU")])
        _until("a's removal", lambda: index.holders(KEYS) == {"a": 1, "b": 2})
        b.publish([AllBlocksCleared()])
        _until("b's clear", lambda: index.holders(KEYS) == {"a": 1})
        assert index.holders(KEYS, MEDIUM_CPU) == {} and index.blocks("b") == frozenset()
        assert index.indexed("b")  # still subscribed: what it stores next counts
    finally:
        a.close()
        b.close()


def test_a_dropped_node_is_forgotten_at_once_and_a_new_incarnation_starts_afresh(tmp_path, index) -> None:
    pub = _publisher(tmp_path, "n")
    try:
        index.track("n", "first", _announce(pub))
        pub.publish([_stored(KEYS[:3])])
        _until("indexed", lambda: index.holders(KEYS) == {"n": 3})
        index.track("n", "first", _announce(pub))  # the same process registering again: nothing changes
        assert index.holders(KEYS) == {"n": 3}
        index.forget("n")
        assert index.holders(KEYS) == {} and not index.indexed("n")  # before the thread has even heard of it
        pub.publish([_stored(KEYS[3:5])])
        time.sleep(0.3)
        assert index.holders(KEYS) == {}  # batches of a forgotten subscription never land
        index.track("n", "first", _announce(pub))  # back after missing heartbeats: rebuilt from the replay
        _until("rebuilt", lambda: index.blocks("n") == set(KEYS[:5]))
        index.track("n", "second", _announce(pub))  # restarted: a new incarnation starts from nothing
        assert index.blocks("n") == frozenset()
    finally:
        pub.close()


class ScriptedPublisher:
    """vLLM's sockets driven by hand: a test decides every sequence number and what the replay answers."""

    def __init__(self, ctx: zmq.Context, tmp_path) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"ipc://{tmp_path}/scripted-pub")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.bind(f"ipc://{tmp_path}/scripted-replay")
        self.endpoints = P.KVEventsEndpoint(f"ipc://{tmp_path}/scripted-pub", f"ipc://{tmp_path}/scripted-replay")

    def send(self, seq: int, events: list[KVEvent]) -> None:
        self.pub.send_multipart((b"", seq_bytes(seq), encode_batch(KVEventBatch(1.0, events, 0))))

    def answer_replay(self, batches: dict[int, list[KVEvent]]) -> int:
        """Answer one replay request with `batches` (those at or after its start); the start asked for."""
        assert self.replay.poll(10_000), "no replay request"
        client, _, start = self.replay.recv_multipart()
        for seq, events in sorted(batches.items()):
            if seq >= int.from_bytes(start, "big"):
                payload = encode_batch(KVEventBatch(1.0, events, 0))
                self.replay.send_multipart((client, b"", b"", seq_bytes(seq), payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))
        return int.from_bytes(start, "big")


def test_gaps_are_repaired_by_replay_and_a_lost_removal_resets(tmp_path, index) -> None:
    ctx = zmq.Context()
    script = ScriptedPublisher(ctx, tmp_path)
    try:
        index.track("s", "i", script.endpoints)
        assert script.answer_replay({}) == SNAPSHOT_SEQ  # the snapshot asked for at start: nothing held yet
        time.sleep(0.3)  # the SUB socket joins
        script.send(0, [_stored(KEYS[:2])])
        _until("batch 0", lambda: index.holders(KEYS) == {"s": 2})
        script.send(2, [_stored(KEYS[2:4])])  # batch 1 never arrived: the index asks for it
        assert script.answer_replay({1: [BlockRemoved([KEYS[1]], "GPU")], 2: [_stored(KEYS[2:4])]}) == 1
        _until("1 and 2 applied in order", lambda: index.blocks("s") == {KEYS[0], KEYS[2], KEYS[3]})
        script.send(5, [_stored(KEYS[4:5])])  # 3 and 4 are gone from the buffer: one of them may have removed KEYS[0]
        assert script.answer_replay({5: [_stored(KEYS[4:5])]}) == 3
        _until("a reset, then batch 5", lambda: index.blocks("s") == {KEYS[4]})
        assert index.resets == 1 and index.holders(KEYS) == {}
    finally:
        ctx.destroy(linger=0)


def test_curve_subscriptions_with_the_routers_keys(tmp_path) -> None:
    keys = generate_keys(tmp_path / "keys", ("decode-0", "decode-1"))
    pub = _publisher(tmp_path, "n", PublisherAuth.from_client(ClientAuth.for_router(keys.dir, "decode-0")))
    index = KVIndex(keys.router_auth(), replay_timeout_s=0.5)
    try:
        index.track("decode-0", "i", _announce(pub))
        index.track("stranger", "i", _announce(pub))  # no key authorized under that name: not subscribed
        assert not index.indexed("stranger")
        time.sleep(0.3)
        pub.publish([_stored(KEYS[:2])])
        _until("indexed over CURVE", lambda: index.holders(KEYS) == {"decode-0": 2})
        index.track("decode-1", "i", _announce(pub))  # the wrong server key for this publisher: the handshake fails
        time.sleep(0.5)
        assert index.blocks("decode-1") == frozenset()
    finally:
        index.close()
        pub.close()


def _reg(node_id: str) -> P.Register:
    return P.Register(node_id, P.NodeRole.PREFILL, "m", "fp", "float32", 4, 1024, 8, 100, True, instance="a")


def test_pairing_trusts_the_index_over_a_stale_heartbeat(tmp_path, index) -> None:
    reg = Registry("m")
    for node_id in ("p0", "p1", "p2"):
        reg.register(_reg(node_id))
    # p1's heartbeat still lists the prefix, but its events said AllBlocksCleared; p2 has no events at all.
    reg.heartbeat(P.Heartbeat("p1", 0, 0, 90, cached_keys=KEYS[:4]))
    reg.heartbeat(P.Heartbeat("p2", 0, 0, 90, cached_keys=KEYS[:2]))
    pubs = {n: _publisher(tmp_path, n) for n in ("p0", "p1")}
    try:
        for node_id, pub in pubs.items():
            index.track(node_id, "a", _announce(pub))
        time.sleep(0.3)
        pubs["p0"].publish([_stored(KEYS[:3])])
        pubs["p1"].publish([_stored(KEYS[:4]), AllBlocksCleared()])
        _until("indexed", lambda: index.holders(KEYS) == {"p0": 3})
        alive = reg.alive(P.NodeRole.PREFILL)
        hits = index.prefix_hits([n.node_id for n in alive], KEYS)
        assert hits == {"p0": 3, "p1": 0}
        choice = pick_prefill(alive, KEYS, hits=hits)
        assert choice is not None and (choice.node.node_id, choice.prefix_hit_blocks) == ("p0", 3)
        heartbeat_only = pick_prefill(alive, KEYS)  # the policy before events, still selectable
        assert heartbeat_only is not None and heartbeat_only.node.node_id == "p1"
    finally:
        for pub in pubs.values():
            pub.close()


# ------------------------------------------------------------------ the live router and a real node runtime


class EventfulEngine(FakeEngine):
    """The fake engine, with KV events a test injects (the node loop publishes them after its next step)."""

    def __init__(self) -> None:
        super().__init__()
        self._events: list[KVEvent] = []

    def emit(self, events: list[KVEvent]) -> None:
        with self.lock:
            self._events.extend(events)

    def take_kv_events(self) -> list[KVEvent]:
        with self.lock:
            out, self._events = self._events, []
        return out


def test_the_live_router_indexes_what_a_node_announces(tmp_path) -> None:
    from decode_node.worker import DecodeWorker
    from launch.ports import free_port
    from node.config import NodeConfig
    from node.server import NodeServer
    from router.config import RouterConfig
    from tests.router.hostile_live import live_router

    with live_router(RouterConfig(port=free_port(), node_timeout_s=1.0)) as (app, _):
        events = KVEventsConfig(
            enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay"
        )

        def start_node() -> tuple[NodeServer, EventfulEngine, threading.Thread]:
            node_config = NodeConfig(
                role=P.NodeRole.DECODE,
                router_addr=app.state.nodes_address,
                store_addr=None,
                node_id="d0",
                served_model_name="smollm2-135m",
                heartbeat_interval_s=0.1,
                kv_events=events,
            )
            engine = EventfulEngine()
            node = NodeServer(node_config, engine, DecodeWorker())
            node_thread = threading.Thread(target=node.serve, daemon=True)
            node_thread.start()
            return node, engine, node_thread

        index: KVIndex = app.state.kv_index
        registry: Registry = app.state.registry
        node, engine, node_thread = start_node()
        try:
            _until("registered and indexed", lambda: "d0" in registry.nodes and index.indexed("d0"))
            announced = registry.nodes["d0"].info.kv_events
            assert announced == P.KVEventsEndpoint(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "")
            keys = registry.prompt_keys(list(range(64)), None)
            engine.emit([block_stored(keys[:3], None, list(range(48)), 16)])
            _until("the node's blocks", lambda: index.holders(keys) == {"d0": 3})
            engine.emit([AllBlocksCleared()])
            _until("AllBlocksCleared", lambda: index.holders(keys) == {})
            engine.emit([block_stored(keys[:2], None, list(range(32)), 16)])
            _until("stored again", lambda: index.holders(keys) == {"d0": 2})
            node.stop()
            node_thread.join(10)
            _until("dropped after missed heartbeats, and forgotten", lambda: not index.indexed("d0"))
            assert index.holders(keys) == {}
            node, engine, node_thread = start_node()  # a new incarnation on the same addresses
            _until("indexed again", lambda: index.indexed("d0"))
            engine.emit([block_stored(keys[:1], None, list(range(16)), 16)])
            _until("the new incarnation's blocks alone", lambda: index.blocks("d0") == {keys[0]})
        finally:
            node.stop()
            node_thread.join(10)


def test_attached_nodes_take_in_process_batches_under_the_same_rules(index) -> None:
    """`attach` / `ingest` (a simulated cluster's nodes): the same state and rules as a subscribed stream."""
    with pytest.raises(ValueError):
        index.ingest("sim0", KVEventBatch(ts=0.0, events=[_stored(KEYS)]))  # never attached
    index.attach("sim0", "a")
    index.ingest("sim0", KVEventBatch(ts=0.0, events=[_stored(KEYS[:4]), _stored(KEYS[:2], MEDIUM_CPU)]))
    assert index.holders(KEYS) == {"sim0": 4} and index.holders(KEYS, MEDIUM_CPU) == {"sim0": 2}
    index.ingest("sim0", KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[KEYS[1]], medium="GPU")]))
    assert index.holders(KEYS) == {"sim0": 1}
    index.ingest("sim0", KVEventBatch(ts=2.0, events=[AllBlocksCleared()]))
    assert index.holders(KEYS) == {} and index.holders(KEYS, MEDIUM_CPU) == {}
    index.ingest("sim0", KVEventBatch(ts=3.0, events=[_stored(KEYS[:3])]))
    index.attach("sim0", "b")  # a new incarnation starts from nothing
    assert index.holders(KEYS) == {}
    index.forget("sim0")
    with pytest.raises(ValueError):
        index.ingest("sim0", KVEventBatch(ts=4.0, events=[_stored(KEYS)]))


def test_a_late_subscriber_is_whole_from_the_snapshot_past_the_ring_buffer(tmp_path) -> None:
    """A router (re)started after 16 publishers ran past their ring buffers: each one's snapshot gives the index what
    the publisher holds now, removals included, and the live stream goes on from there."""
    pubs = [_publisher(tmp_path, f"n{i}", buffer_steps=4) for i in range(16)]
    keys = [block_keys(root_key(NS, f"node-{i}"), list(range(4 * 40)), 4) for i in range(16)]
    index = KVIndex(replay_timeout_s=2.0)
    try:
        for pub, mine in zip(pubs, keys, strict=True):
            for j in range(0, 40, 2):  # 20 batches, far past the 4 the ring keeps
                pub.publish([_stored(mine[j : j + 2])])
            pub.publish([BlockRemoved(block_hashes=list[bytes | int](mine[:2]), medium="GPU")])
        _until("every batch sent", lambda: all(pub.published == 21 for pub in pubs))
        for i, pub in enumerate(pubs):
            index.track(f"n{i}", "a", _announce(pub))
        for i in range(16):
            _until(f"n{i}'s snapshot", lambda i=i: index.blocks(f"n{i}") == frozenset(keys[i][2:]))
        pubs[0].publish([_stored([KEYS[0]])])  # live from the snapshot's sequence on
        _until("the next live batch", lambda: KEYS[0] in index.blocks("n0"))
        assert index.resets == 0
    finally:
        index.close()
        for pub in pubs:
            pub.close()
