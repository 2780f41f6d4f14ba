"""`ZmqEventPublisher`: KV event batches out on ZeroMQ exactly as vLLM's publisher sends them.

    PUB      multipart (topic, sequence: 8 bytes big-endian, payload: the msgpack batch); sequence 0, 1, 2, ...
             from the publisher's start, one per batch (a node publishes one batch per engine step with events)
    replay   ROUTER, always bound: a client sends (empty frame, start sequence: 8 bytes big-endian), as a REQ
             socket or a DEALER with an empty first frame does; it gets every batch still in the ring buffer from
             that sequence on as (empty, topic, sequence, payload), then the end marker (empty, empty, -1 as 8
             bytes signed big-endian, empty)

    snapshot a replay request for sequence SNAPSHOT_SEQ (ours; vLLM's publisher answers it with the end marker
             alone) gets one batch instead: AllBlocksCleared, then a BlockStored per medium of every block the
             published events leave held, under the sequence of the last batch they include; then the end marker.
             A subscriber that starts (a restarted router) rebuilds from it and goes on from the next sequence,
             however long the publisher has run, instead of replaying the ring buffer (which may no longer
             reach back to the start).

The ring buffer keeps the last `buffer_steps` batches. `publish` encodes on the caller's thread and hands the bytes
to the publisher's thread over an inproc socket; that thread owns the PUB and replay sockets, so a replay is served
while the engine is in a long step. A publisher thread that cannot keep up for a second loses that batch and
counts it; its next batch starts with AllBlocksCleared, so no subscriber keeps a block whose removal was lost.

With a `PublisherAuth` both sockets are CURVE servers (the node's pair; subscribers: the router's key and the
authorized folder's keys).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

import zmq

from common.auth import PublisherAuth
from common.kv_events import endpoints
from common.kv_events.codec import encode_batch
from common.kv_events.config import KVEventsConfig
from common.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, block_stored

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
SEQ_BYTES = 8
SNAPSHOT_SEQ = (1 << 64) - 2  # a replay request for this start sequence asks for the snapshot
_HANDOFF_TIMEOUT_MS = 1000  # `publish` waits this long for the publisher thread before dropping the batch
_STOP = b""  # the inbox's stop sentinel (a payload is never empty)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, auth: PublisherAuth | None = None, data_parallel_rank: int = 0) -> None:
        """Binds (or connects) now: a taken port fails here, in the caller, as a ZMQError."""
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._authenticator = auth.start(self._ctx) if auth is not None else None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # the inbox's sending side: `publish` may be called from several threads
        self._lost = False  # a batch was dropped: the next one starts with AllBlocksCleared
        # Each batch's events, in publish order, for the publisher thread to fold into `_held` as it sends the batch
        # (so the snapshot matches a sequence number); deque ends are thread-safe.
        self._pending: collections.deque[list[KVEvent]] = collections.deque()
        self._held: dict[str, dict[bytes | int, None]] = {}  # medium -> held keys, oldest first (publisher thread)
        self._last_seq: int | None = None
        self.published = 0  # batches sent on the PUB socket
        self.dropped = 0  # batches `publish` gave up on (the publisher thread stalled)
        self.replays = 0  # replay requests served
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._replay: zmq.Socket[bytes] | None = None
            if auth is not None:
                auth.serve(self._pub)
            self.endpoint = self._attach(self._pub, config.endpoint, endpoints.is_bind(config.endpoint))
            self.bound = endpoints.is_bind(config.endpoint)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)  # a whole replay fits, end marker too
                self._replay.setsockopt(zmq.MAXMSGSIZE, 4096)  # a request is 8 bytes (CURVE's handshake: ~300)
                if auth is not None:
                    auth.serve(self._replay)
                self.replay_endpoint = self._attach(self._replay, config.replay_endpoint, bind=True)
            inbox = f"inproc://kv-events-{id(self):x}"
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.RCVHWM, config.max_queue_size)
            self._pull.bind(inbox)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, config.max_queue_size)
            self._push.setsockopt(zmq.SNDTIMEO, _HANDOFF_TIMEOUT_MS)
            self._push.setsockopt(zmq.LINGER, -1)  # close() flushes what was published
            self._push.connect(inbox)
        except BaseException:
            if self._authenticator is not None:
                self._authenticator.stop()
            self._ctx.destroy(linger=0)
            raise
        # The thread owns PUB, replay and PULL from here on (Thread.start is the memory barrier pyzmq asks for).
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> str:
        if "::" in endpoint or "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return bytes(sock.getsockopt(zmq.LAST_ENDPOINT)).decode()

    # ------------------------------------------------------------------ the caller's side

    def publish(self, events: list[KVEvent], ts: float | None = None) -> None:
        """One batch (one engine step's events) out, in order after every earlier one."""
        with self._lock:
            if self._lost:
                events = [AllBlocksCleared(), *events]
            when = time.time() if ts is None else ts
            batch = KVEventBatch(ts=when, events=events, data_parallel_rank=self.data_parallel_rank)
            self._pending.append(batch.events)
            try:
                self._push.send(encode_batch(batch))
            except zmq.Again:
                self._pending.pop()  # never reached the thread: it will not look for these events
                self.dropped += 1
                self._lost = True
                log.warning("KV event publisher stalled: a batch of %d events dropped", len(events))
                return
            self._lost = False

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what was published, then close the sockets."""
        with self._lock:
            try:
                self._push.send(_STOP)
            except zmq.Again:
                pass
            self._push.close(linger=int(timeout_s * 1000))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV event publisher thread did not stop within %.1fs", timeout_s)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ the publisher's thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                if self._pull in ready and not self._send_queued():
                    return
        except zmq.ContextTerminated:
            return
        except Exception:
            log.exception("KV event publisher thread failed")
        finally:
            for sock in (self._pub, self._replay, self._pull):
                if sock is not None:
                    sock.close(linger=0)

    def _send_queued(self) -> bool:
        """Send every queued batch; False once the stop sentinel is reached."""
        while True:
            try:
                payload = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if payload == _STOP:
                return False
            seq = next(self._seq)
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))  # PUB never blocks: drops at the HWM
            self._buffer.append((seq, payload))
            self._fold(self._pending.popleft())
            self._last_seq = seq
            self.published += 1

    def _fold(self, events: list[KVEvent]) -> None:
        """What a batch leaves held, per medium (the snapshot's state)."""
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._held.clear()
            elif isinstance(event, BlockStored):
                held = self._held.setdefault(event.medium or "GPU", {})
                for key in event.block_hashes:
                    held[key] = None
            elif isinstance(event, BlockRemoved):
                held = self._held.setdefault(event.medium or "GPU", {})
                for key in event.block_hashes:
                    held.pop(key, None)

    def _snapshot(self) -> bytes:
        events: list[KVEvent] = [AllBlocksCleared()]
        for medium, keys in self._held.items():
            if keys:
                events.append(block_stored(list(keys), None, [], 0, medium))  # type: ignore[arg-type]
        return encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank))

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
                log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays += 1
            if start == SNAPSHOT_SEQ:
                if self._last_seq is not None:
                    snapshot = self._snapshot()
                    self._replay.send_multipart((client, b"", self._topic, seq_bytes(self._last_seq), snapshot))
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
