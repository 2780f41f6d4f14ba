"""The store daemon: one `Store` behind a ZeroMQ ROUTER, serving many clients at once.

The main thread owns the ROUTER: it checks limits, decodes the control frame and hands the request to a
worker pool; workers send replies back through an inproc PUSH/PULL pair (ZeroMQ sockets are single-thread)
which the main thread forwards to the client. No frame can end the loop: whatever goes wrong with one
message (malformed, oversized, unknown, or an unexpected error) gets an `ErrorReply` where it can, is counted
(`bad_frames` in the stats), logged (rate-limited) and dropped.

What a client may do (docs/security.md):
- With `DaemonConfig.auth` the socket is a CURVE server: only clients whose public key is in the authorized
  folder complete the handshake; each request is attributed to that key (ZAP User-Id).
- A dump names a namespace the client opened with its layout; the blocks are admitted only if every size
  matches it and every key chains from its parent and token ids (`ucm.dump_check`).
- With CURVE, a client commits only what it dumped and removes only what it owns (`ucm.ownership`); without,
  all peers are one identity and no ownership is tracked.
- A client on the same host may attach shared memory (`AttachShm`, checks in ucm/shared_segment.py) and have
  its loads written there; a segment serves only the client that attached it (`ucm.segment_table`).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from common.auth import INSECURE_WARNING, PublisherAuth, ServerAuth
from common.kv_events.config import KVEventsConfig
from common.kv_events.publisher import ZmqEventPublisher
from common.log_limit import LogLimiter
from ucm import store_wire as p
from ucm.dump_check import checked_dump
from ucm.namespaces import NamespaceRegistry
from ucm.ownership import OwnerTable
from ucm.record import Buffer
from ucm.refusal import Refused
from ucm.segment_table import SegmentTable
from ucm.store import Store
from ucm.wire_limits import MAX_LOAD_FRAMES, LayoutCaps

log = logging.getLogger("ucm.daemon")
ANONYMOUS = ""  # the one identity of every peer of a daemon without CURVE


@dataclass(frozen=True)
class DaemonConfig:
    bind: str = "tcp://127.0.0.1:0"  # port 0: pick a free port (the ready line shows which)
    workers: int = 4
    max_frames: int = 1 + 65536
    max_request_bytes: int = 1 << 30
    max_control_bytes: int = 16 << 20
    caps: LayoutCaps = field(default_factory=LayoutCaps)
    max_segments: int = 1024  # attached shared-memory segments, all clients together (a vLLM worker: one per layer)
    max_segment_bytes: int = 1 << 40
    auth: ServerAuth | None = None  # None: no authentication (logs INSECURE_WARNING)
    # vLLM's --kv-events-config: the tiers' KV events (medium CPU for DRAM, STORAGE for disk) published as a node
    # publishes its device cache's; the store must have been built with a TierEvents. `events_auth`: CURVE on them.
    kv_events: KVEventsConfig | None = None
    events_auth: PublisherAuth | None = None

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind address must be tcp://, ipc:// or inproc://, got {self.bind!r}")
        if self.workers <= 0 or self.max_frames < 2 or self.max_request_bytes <= 0 or self.max_control_bytes <= 0:
            raise ValueError("workers and limits must be positive (max_frames >= 2)")
        if self.max_segments <= 0 or self.max_segment_bytes <= 0:
            raise ValueError("segment limits must be positive")


class BadRequest(Refused):
    def __init__(self, message: str) -> None:
        super().__init__(p.ErrorCode.BAD_REQUEST, message)


class StoreDaemon:
    def __init__(self, store: Store, config: DaemonConfig) -> None:
        self.store = store
        self.config = config
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 1000)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client's reply is dropped, not an error
        # Hard cap per frame, far above the soft per-request limit (which gets a TOO_LARGE reply): a frame over
        # it makes ZeroMQ drop the peer's connection without reading it into memory; the daemon serves on.
        self._router.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_request_bytes)
        self._authenticator = None
        if config.auth is not None:
            self._authenticator = config.auth.apply(self._ctx, self._router)
        else:
            log.warning(INSECURE_WARNING)
        bind = (
            config.bind[:-2] + ":*" if config.bind.startswith("tcp://") and config.bind.endswith(":0") else config.bind
        )
        self._router.bind(bind)
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replies_addr = f"inproc://ucm-replies-{uuid.uuid4().hex}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._replies_addr)
        self._local = threading.local()
        self._pushers: list[zmq.Socket[bytes]] = []
        self._pushers_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="ucm-daemon")
        self._stop = threading.Event()
        self._namespaces = NamespaceRegistry(config.caps)
        self._owners = OwnerTable(store.config.pending_timeout_s)
        self._segments = SegmentTable(config.max_segments, config.max_segment_bytes)
        self._counts_lock = threading.Lock()
        self._bad_frames = 0
        self._refused = 0
        self._shared_loads = 0
        self._shared_dumps = 0
        self._bad_log = LogLimiter(log)
        self._events: ZmqEventPublisher | None = None
        self.events_endpoint: str | None = None
        self.events_replay_endpoint: str | None = None
        if config.kv_events is not None and config.kv_events.enabled:
            if store.events is None:
                raise ValueError("KV events need a store built with a TierEvents (Store(config, events=...))")
            self._events = ZmqEventPublisher(config.kv_events, config.events_auth)
            self.events_endpoint = self._events.endpoint
            self.events_replay_endpoint = self._events.replay_endpoint

    @property
    def authenticated(self) -> bool:
        return self.config.auth is not None

    def stop(self) -> None:
        """Ask `serve_forever` to return (safe from a signal handler or another thread)."""
        self._stop.set()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock is self._router:
                        self._receive_guarded(self._router.recv_multipart(copy=False))
                    else:
                        self._forward_reply(self._replies.recv_multipart(copy=False))
                self._publish_events()  # at least every poll timeout: what the tiers did meanwhile
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        log.info("daemon: stopping; finishing requests, flushing the write-behind queue, closing LMDB")
        self._pool.shutdown(wait=True)
        while self._replies.poll(0):  # deliver replies of requests that finished during shutdown
            self._forward_reply(self._replies.recv_multipart(copy=False))
        self.store.close()
        if self._events is not None:
            self._publish_events()
            self._events.close()
        for sock in self._pushers:
            sock.close(linger=0)
        self._replies.close(linger=0)
        self._router.close(linger=500)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()

    # --- main thread ----------------------------------------------------------------------------------

    def _publish_events(self) -> None:
        if self._events is not None and self.store.events is not None:
            events = self.store.events.take()
            if events:
                self._events.publish(events)

    def _receive_guarded(self, frames: list[zmq.Frame]) -> None:
        try:
            self._receive(frames)
        except Exception as exc:
            self._count_bad(f"{type(exc).__name__} while receiving: {str(exc)[:200]}")

    def _forward_reply(self, frames: Sequence[zmq.Frame | bytes]) -> None:
        try:
            self._router.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:  # e.g. the peer's queue is full: its reply is lost, the loop goes on
            self._bad_log.warning("daemon: reply dropped: %s", exc)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        identity, parts = frames[0], frames[1:]
        if not parts:
            return self._count_bad("empty message")
        if len(parts) > self.config.max_frames:
            return self._send_error(
                identity, 0, p.ErrorCode.TOO_LARGE, f"{len(parts)} frames > {self.config.max_frames}"
            )
        total = sum(len(f.buffer) for f in parts)
        if total > self.config.max_request_bytes or len(parts[0].buffer) > self.config.max_control_bytes:
            return self._send_error(identity, 0, p.ErrorCode.TOO_LARGE, f"request of {total} bytes over the limit")
        try:
            request = p.request_decoder.decode(parts[0].buffer)
        except Exception as exc:
            code, req_id = p.classify_undecodable(parts[0].buffer)
            return self._send_error(identity, req_id, code, str(exc)[:200])
        # With CURVE, ZAP stamped every frame with the peer's public key (z85): the identity ownership uses.
        client = str(parts[0].get("User-Id")) if self.authenticated else ANONYMOUS
        self._pool.submit(self._handle, identity, client, request, parts[1:])

    def _count_bad(self, why: str) -> None:
        with self._counts_lock:
            self._bad_frames += 1
        self._bad_log.warning("daemon: bad frame: %s", why)

    def _send_error(self, identity: zmq.Frame, req_id: int, code: p.ErrorCode, message: str) -> None:
        self._count_bad(f"request {req_id}: {code.value} ({message})")
        self._forward_reply([identity, p.encode(p.ErrorReply(req_id, code, message))])

    # --- worker threads -------------------------------------------------------------------------------

    def _pusher(self) -> zmq.Socket[bytes]:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self._replies_addr)
            self._local.sock = sock
            with self._pushers_lock:
                self._pushers.append(sock)
        return sock

    def _handle(self, identity: zmq.Frame, client: str, request: p.Request, frames: Sequence[zmq.Frame]) -> None:
        try:
            reply, out = self._dispatch(client, request, frames)
        except Refused as exc:
            reply, out = self._refuse(request, exc.code, str(exc))
        except ValueError as exc:  # the store refused the arguments
            reply, out = self._refuse(request, p.ErrorCode.BAD_REQUEST, str(exc))
        except Exception as exc:
            log.exception("daemon: request %r failed", type(request).__name__)
            reply, out = p.ErrorReply(request.req_id, p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), []
        self._pusher().send_multipart([identity, p.encode(reply), *out], copy=False)

    def _refuse(self, request: p.Request, code: p.ErrorCode, message: str) -> tuple[p.Reply, list[Buffer]]:
        with self._counts_lock:
            self._refused += 1
        self._bad_log.warning(
            "daemon: refused %s %d: %s (%s)", type(request).__name__, request.req_id, code.value, message[:200]
        )
        return p.ErrorReply(request.req_id, code, message), []

    def _dispatch(self, client: str, req: p.Request, frames: Sequence[zmq.Frame]) -> tuple[p.Reply, list[Buffer]]:
        store = self.store
        if not isinstance(req, p.Dump) and frames:
            raise BadRequest(f"{type(req).__name__} takes no data frames, got {len(frames)}")
        match req:
            case p.Ping():
                return p.OkReply(req.req_id), []
            case p.Lookup(keys=keys):
                return p.LookupReply(req.req_id, store.lookup(keys)), []
            case p.Contains(keys=keys):
                return p.ContainsReply(req.req_id, store.contains(keys)), []
            case p.OpenNamespace(name=name, layout=layout, protocol=version):
                if version != p.PROTOCOL_VERSION:
                    raise Refused(p.ErrorCode.VERSION, f"protocol {version} != the daemon's {p.PROTOCOL_VERSION}")
                self._namespaces.open(client, name, layout)
                return p.OkReply(req.req_id), []
            case p.Dump():
                return p.DumpReply(req.req_id, self._dump(client, req, frames)), []
            case p.Commit(keys=keys, ok=ok):
                # With CURVE, only what this client dumped; without, one identity owns everything (no table).
                store.commit(self._owners.settle(keys, client, ok) if self.authenticated else keys, ok)
                return p.OkReply(req.req_id), []
            case p.Load(blocks=blocks, layers=layers, shm=shm):
                if len(blocks) * len(layers) > MAX_LOAD_FRAMES:
                    raise BadRequest(
                        f"load of {len(blocks)} blocks x {len(layers)} layers: reply over {MAX_LOAD_FRAMES} frames"
                    )
                if shm is not None:
                    return self._load_into_segment(client, req, shm), []
                rows, from_disk = store.read_payloads([b.ref() for b in blocks], layers)
                failed = [i for i, row in enumerate(rows) if row is None]
                return p.LoadReply(req.req_id, failed, from_disk), [
                    buf for row in rows if row is not None for buf in row
                ]
            case p.Prefetch(keys=keys):
                store.prefetch(keys)
                return p.OkReply(req.req_id), []
            case p.Remove(keys=keys):
                if self.authenticated:
                    foreign = self._owners.foreign(keys, client, store.contains)
                    if foreign:
                        raise Refused(
                            p.ErrorCode.FORBIDDEN,
                            f"{len(foreign)} of {len(keys)} keys belong to another client "
                            f"(first {foreign[0].hex()}); nothing removed",
                        )
                store.remove(keys)
                if self.authenticated:
                    self._owners.forget(keys)
                return p.OkReply(req.req_id), []
            case p.AttachShm(name=name, nbytes=nbytes, token=token):
                self._segments.attach(client, name, nbytes, token)
                return p.OkReply(req.req_id), []
            case p.DetachShm(name=name):
                self._segments.detach(client, name)
                return p.OkReply(req.req_id), []
            case p.GetStats():
                stats = store.stats()
                with self._counts_lock:
                    stats.bad_frames, stats.refused_requests = self._bad_frames, self._refused
                    stats.shared_memory_loads, stats.shared_memory_dumps = self._shared_loads, self._shared_dumps
                return p.StatsReply(req.req_id, stats), []
        raise BadRequest(f"unhandled request {type(req).__name__}")

    def _load_into_segment(self, client: str, req: p.Load, shm: p.ShmRanges) -> p.LoadReply:
        width = len(req.layers)
        if len(shm.offsets) != len(req.blocks) * width:
            raise BadRequest(f"shm load: {len(shm.offsets)} offsets for {len(req.blocks)} blocks x {width} layers")
        views = self._segments.get(client, shm.name).views(shm.offsets, shm.lengths)
        dst = [views[i * width : (i + 1) * width] for i in range(len(req.blocks))]
        failed, from_disk = self.store.read_into([b.ref() for b in req.blocks], req.layers, dst)
        with self._counts_lock:
            self._shared_loads += 1
        return p.LoadReply(req.req_id, failed, from_disk)

    def _dump(self, client: str, req: p.Dump, frames: Sequence[zmq.Frame]) -> list[int]:
        """Indices of the blocks not stored; Refused (nothing stored) if the request is inconsistent."""
        payloads = self._dump_payloads(client, req, frames)
        refs = checked_dump(req, [len(v) for v in payloads], lambda name: self._namespaces.get(client, name))
        present = self.store.contains([r.key for r in refs])
        new = [i for i, have in enumerate(present) if not have]  # stored blocks are skipped by the store anyway
        cap = self.config.caps.max_pending_blocks
        # Soft cap (one request may go over it): the same blocks come once per layer, so "new" ones may
        # already be pending; pending memory stays under about cap x the largest declared block.
        if new and self.store.pending_count() >= cap:
            raise Refused(p.ErrorCode.BUSY, f"{cap} blocks already pending; commit or retry later")
        taken: list[int] = []
        if self.authenticated:
            allowed = self._owners.claim_pending([refs[i].key for i in new], client)
            taken = [i for i, ok in zip(new, allowed) if not ok]  # being dumped by another client
        keep = sorted(set(range(len(refs))) - set(taken))
        width = len(req.layers)
        rows = [payloads[i * width : (i + 1) * width] for i in keep]
        task = self.store.dump_layers([refs[i] for i in keep], req.layers, req.num_layers, rows)
        task.wait()
        return sorted(taken + [keep[j] for j in task.failed_blocks])

    def _dump_payloads(self, client: str, req: p.Dump, frames: Sequence[zmq.Frame]) -> list[memoryview]:
        """The dump's payloads: its frames, or its ranges of a segment this client attached (the store copies them
        before the reply, so the client may reuse the memory once answered)."""
        if req.shm is None:
            return [memoryview(f.buffer) for f in frames]
        if frames:
            raise BadRequest(f"a dump from shared memory takes no data frames, got {len(frames)}")
        if len(req.shm.offsets) != len(req.blocks) * len(req.layers):
            raise BadRequest(
                f"shm dump: {len(req.shm.offsets)} ranges for {len(req.blocks)} blocks x {len(req.layers)} layers"
            )
        views = self._segments.get(client, req.shm.name).views(req.shm.offsets, req.shm.lengths)
        with self._counts_lock:
            self._shared_dumps += 1
        return views
