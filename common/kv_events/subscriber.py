"""`EventStream`: one publisher's KV event batches, each applied once and in sequence order, gaps repaired through
its replay socket (vLLM's protocol, publisher.py). `StreamPoller` runs any number of streams on one thread.

What a consumer must never do is keep a block whose BlockRemoved it missed. So whenever batches are lost for good
(the replay buffer no longer has them, there is no replay socket, the replay does not answer, a batch cannot be
read, or the sequence goes back: the publisher restarted), the stream calls `reset` (forget everything this
publisher announced) and applies from the next batch it has. Starting empty and applying any suffix of a
publisher's batches gives a subset of what it holds: a missed BlockStored costs a routing hint, never a stale one.

A publisher restarted on the same address is seen as such when its sequence goes back; one that got past the
sequence the stream expects before the stream reconnected looks like a gap and is replayed on top (the router's
index does not rely on this: a restarted node registers as a new incarnation and is subscribed to afresh).

On start the stream asks for a replay from sequence 0, so it learns what the publisher still buffers of its past
even if nothing new is published (and the SUB socket's slow join loses nothing); with `snapshot`, for the publisher's
snapshot instead (publisher.py: one batch of everything held, at the last sequence), so a consumer that starts late
(a restarted router) is whole at once, however far back the ring buffer reaches. A publisher without snapshots
(vLLM's) answers with the end marker alone, and the stream falls back to replaying from 0 at its first live batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from common.auth import CurveClientKeys
from common.kv_events.codec import BatchDecoder
from common.kv_events.events import KVEventBatch
from common.kv_events.publisher import END_SEQ, SEQ_BYTES, SNAPSHOT_SEQ, seq_bytes

log = logging.getLogger(__name__)

Apply = Callable[[int, KVEventBatch], None]  # (sequence, batch)
Reset = Callable[[str], None]  # why
REPLAY_TIMEOUT_S = 2.0


class Readable(Protocol):
    """What a `StreamPoller` drives: an `EventStream`, or its owner's own socket (a wake-up)."""

    @property
    def deadline(self) -> float | None: ...

    def readable(self, replay: bool) -> None: ...

    def tick(self, now: float) -> None: ...


class StreamPoller:
    """One thread's poller over many streams' sockets: sleeps until a socket is readable or a replay is due."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._owners: dict[zmq.Socket[bytes], tuple[Readable, bool]] = {}  # socket -> (owner, is a replay socket)

    def register(self, sock: zmq.Socket[bytes], owner: Readable, replay: bool) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._owners[sock] = (owner, replay)

    def unregister(self, sock: zmq.Socket[bytes]) -> None:
        if self._owners.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def poll(self, timeout_ms: int | None = None) -> int:
        """Handle what arrives within `timeout_ms` (None: until something does, or the next replay deadline), then
        the replay deadlines; how many sockets were ready."""
        owners = {owner for owner, _ in self._owners.values()}
        deadlines = [d for owner in owners if (d := owner.deadline) is not None]
        if deadlines:
            due_ms = max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)
            timeout_ms = due_ms if timeout_ms is None else min(timeout_ms, due_ms)
        events = self._poller.poll(timeout_ms) if self._owners else []
        if not self._owners and timeout_ms:
            time.sleep(timeout_ms / 1000)
        for sock, _ in events:
            entry = self._owners.get(sock)
            if entry is not None:
                entry[0].readable(replay=entry[1])
        now = time.monotonic()
        for owner in owners:
            owner.tick(now)
        return len(events)


class EventStream:
    def __init__(
        self,
        ctx: zmq.Context[Any],
        poller: StreamPoller,
        endpoint: str,
        replay_endpoint: str | None,
        apply: Apply,
        reset: Reset,
        *,
        topic: str = "",
        keys: CurveClientKeys | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        snapshot: bool = False,
    ) -> None:
        self._ctx = ctx
        self._poller = poller
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._apply = apply
        self._reset = reset
        self._topic = topic.encode()
        self._keys = keys
        self._replay_timeout_s = replay_timeout_s
        self.decoder = BatchDecoder()
        self.next_seq: int | None = None  # the sequence the next applied batch must have; None: none applied yet
        self._held: list[tuple[int, KVEventBatch | None]] = []  # live batches that came during a replay
        self._deadline: float | None = None  # a replay is in flight until its end marker or this time
        self._brought = False  # the replay in flight has applied a batch (so another may bring more)
        self.applied = 0
        self.replays = 0
        self.resets = 0
        self.bad_frames = 0
        self.sub: zmq.Socket[bytes] = self._socket(zmq.SUB, endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        poller.register(self.sub, self, replay=False)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._open_replay()
            self._request_replay(SNAPSHOT_SEQ if snapshot else 0)

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        if self._keys is not None:
            self._keys.apply(sock)
        sock.connect(endpoint)
        return sock

    def _open_replay(self) -> None:
        assert self.replay_endpoint is not None
        self._replay = self._socket(zmq.DEALER, self.replay_endpoint)
        self._poller.register(self._replay, self, replay=True)

    def close(self) -> None:
        for sock in (self.sub, self._replay):
            if sock is not None:
                self._poller.unregister(sock)
                sock.close(0)
        self._replay = None

    # ------------------------------------------------------------------ what the poller calls

    @property
    def deadline(self) -> float | None:
        """When the replay in flight is given up on (None: none in flight)."""
        return self._deadline

    @property
    def held(self) -> int:
        """Live batches held until the replay in flight ends."""
        return len(self._held)

    def readable(self, replay: bool) -> None:
        sock = self._replay if replay else self.sub
        while sock is not None:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if replay:
                self._on_replay(frames)
                sock = self._replay  # a finished or abandoned replay may have replaced it
            else:
                self._on_live(frames)

    def tick(self, now: float) -> None:
        if self._deadline is not None and now > self._deadline:
            log.warning("KV events %s: no replay answer within %.1fs", self.endpoint, self._replay_timeout_s)
            assert self._replay is not None
            self._poller.unregister(self._replay)
            self._replay.close(0)  # a late answer must not be taken for the next replay's
            self._open_replay()
            self._end_replay()

    # ------------------------------------------------------------------ ordering

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            return self.decoder.decode(payload)
        except ValueError as e:
            self.bad_frames += 1
            log.warning("KV events %s: unreadable batch: %s", self.endpoint, str(e)[:200])
            return None

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self.bad_frames += 1
            return
        seq, batch = int.from_bytes(frames[1], "big"), self._decode(frames[2])
        if self._deadline is not None:
            self._held.append((seq, batch))
            return
        if self.next_seq is not None and seq < self.next_seq:
            self._lost(f"sequence went back from {self.next_seq} to {seq} (publisher restarted)")
            self.next_seq = None
        behind = seq != 0 if self.next_seq is None else seq > self.next_seq
        if behind and self._replay is not None:  # a gap (or a start past 0): ask for it, hold this one until then
            self._held.append((seq, batch))
            self._request_replay(self.next_seq or 0)
            return
        self._take(seq, batch)

    def _on_replay(self, frames: list[bytes]) -> None:
        if len(frames) == 4 and frames[2] == END_SEQ:
            self._end_replay()
            return
        if len(frames) != 4 or len(frames[2]) != SEQ_BYTES:
            self.bad_frames += 1
            return
        seq = int.from_bytes(frames[2], "big")
        self._brought |= self.next_seq is None or seq >= self.next_seq
        self._take(seq, self._decode(frames[3]))

    def _request_replay(self, start: int) -> None:
        assert self._replay is not None
        self._replay.send_multipart((b"", seq_bytes(start)))
        self._deadline = time.monotonic() + self._replay_timeout_s
        self._brought = False
        self.replays += 1

    def _end_replay(self) -> None:
        self._deadline = None
        held, self._held = sorted(self._held, key=lambda item: item[0]), []
        nxt = self.next_seq
        ahead = [seq for seq, _ in held if nxt is not None and seq >= nxt]  # not applied by the replay
        if ahead and self._brought and self._replay is not None and nxt is not None and ahead[0] > nxt:
            # A live batch overtook the replay, past what it brought: the batches between may be in the publisher's
            # buffer by now. Asked for once more; a replay that brings nothing ends in the reset below.
            self._held = held
            self._request_replay(nxt)
            return
        for seq, batch in held:  # what the replay did not bring is gone: `_take` resets on the gap
            self._take(seq, batch)

    def _take(self, seq: int, batch: KVEventBatch | None) -> None:
        """Apply the batch if it is the next one; skip one already applied; after a gap that can no longer be
        filled, reset and go on from here."""
        if self.next_seq is not None and seq < self.next_seq:
            return  # a replayed or held batch already applied
        if self.next_seq is not None and seq > self.next_seq:
            self._lost(f"batches {self.next_seq}..{seq - 1} are gone")
        self.next_seq = seq + 1
        if batch is None:
            self._lost(f"batch {seq} unreadable")
            return
        self._apply(seq, batch)
        self.applied += 1

    def _lost(self, why: str) -> None:
        self.resets += 1
        log.warning("KV events %s: %s; forgetting what it announced", self.endpoint, why)
        self._reset(why)
