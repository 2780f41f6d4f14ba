"""The store daemon: one `Store` behind a ZeroMQ ROUTER, serving many clients at once.

The main thread owns the ROUTER: it checks limits, decodes the control frame and hands the request to a
worker pool; workers send replies back through an inproc PUSH/PULL pair (ZeroMQ sockets are single-thread)
which the main thread forwards to the client. Anything malformed, oversized or unknown gets an `ErrorReply`
and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import zmq

from ucm import protocol as p
from ucm.store import Store

log = logging.getLogger("ucm.daemon")


@dataclass(frozen=True)
class DaemonConfig:
    bind: str = "tcp://127.0.0.1:0"  # port 0: pick a free port (the ready line shows which)
    workers: int = 4
    max_frames: int = 1 + 65536
    max_request_bytes: int = 1 << 30
    max_control_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind address must be tcp://, ipc:// or inproc://, got {self.bind!r}")
        if self.workers <= 0 or self.max_frames < 2 or self.max_request_bytes <= 0 or self.max_control_bytes <= 0:
            raise ValueError("workers and limits must be positive (max_frames >= 2)")


class BadRequest(ValueError):
    pass


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
        bind = config.bind[:-2] + ":*" if config.bind.startswith("tcp://") and config.bind.endswith(":0") else config.bind
        self._router.bind(bind)
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replies_addr = f"inproc://ucm-replies-{uuid.uuid4().hex}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._replies_addr)
        self._local = threading.local()
        self._pushers: list[zmq.Socket] = []
        self._pushers_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="ucm-daemon")
        self._stop = threading.Event()

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
                        self._receive(self._router.recv_multipart(copy=False))
                    else:
                        self._router.send_multipart(self._replies.recv_multipart(copy=False), copy=False)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        log.info("daemon: stopping; finishing requests, flushing the write-behind queue, closing LMDB")
        self._pool.shutdown(wait=True)
        while self._replies.poll(0):  # deliver replies of requests that finished during shutdown
            self._router.send_multipart(self._replies.recv_multipart(copy=False), copy=False)
        self.store.close()
        for sock in self._pushers:
            sock.close(linger=0)
        self._replies.close(linger=0)
        self._router.close(linger=500)
        self._ctx.term()

    # --- main thread ----------------------------------------------------------------------------------

    def _receive(self, frames: list[zmq.Frame]) -> None:
        identity, parts = frames[0], frames[1:]
        if not parts:
            return  # an empty message carries nothing to answer
        if len(parts) > self.config.max_frames:
            return self._send_error(identity, 0, p.ErrorCode.TOO_LARGE, f"{len(parts)} frames > {self.config.max_frames}")
        total = sum(len(f.buffer) for f in parts)
        if total > self.config.max_request_bytes or len(parts[0].buffer) > self.config.max_control_bytes:
            return self._send_error(identity, 0, p.ErrorCode.TOO_LARGE, f"request of {total} bytes over the limit")
        try:
            request = p.request_decoder.decode(parts[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            code, req_id = p.classify_undecodable(parts[0].buffer)
            return self._send_error(identity, req_id, code, str(exc)[:200])
        self._pool.submit(self._handle, identity, request, parts[1:])

    def _send_error(self, identity: zmq.Frame, req_id: int, code: p.ErrorCode, message: str) -> None:
        log.warning("daemon: rejecting request %d: %s (%s)", req_id, code.value, message)
        self._router.send_multipart([identity, p.encode(p.ErrorReply(req_id, code, message))], copy=False)

    # --- worker threads -------------------------------------------------------------------------------

    def _pusher(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self._replies_addr)
            self._local.sock = sock
            with self._pushers_lock:
                self._pushers.append(sock)
        return sock

    def _handle(self, identity: zmq.Frame, request: p.Request, frames: Sequence[zmq.Frame]) -> None:
        try:
            reply, out = self._dispatch(request, frames)
        except BadRequest as exc:
            reply, out = p.ErrorReply(request.req_id, p.ErrorCode.BAD_REQUEST, str(exc)), []
        except ValueError as exc:  # the store refused the arguments
            reply, out = p.ErrorReply(request.req_id, p.ErrorCode.BAD_REQUEST, str(exc)), []
        except Exception as exc:
            log.exception("daemon: request %r failed", type(request).__name__)
            reply, out = p.ErrorReply(request.req_id, p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), []
        self._pusher().send_multipart([identity, p.encode(reply), *out], copy=False)

    def _dispatch(self, req: p.Request, frames: Sequence[zmq.Frame]) -> tuple[p.Reply, list]:
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
            case p.Dump(blocks=blocks, layer=layer, num_layers=num_layers):
                if len(frames) != len(blocks):
                    raise BadRequest(f"dump of {len(blocks)} blocks came with {len(frames)} data frames")
                task = store.dump([b.ref() for b in blocks], layer, num_layers, [f.buffer for f in frames])
                task.wait()
                return p.DumpReply(req.req_id, task.failed_blocks), []
            case p.Commit(keys=keys, ok=ok):
                store.commit(keys, ok)
                return p.OkReply(req.req_id), []
            case p.Load(blocks=blocks, layers=layers):
                rows = store.read_payloads([b.ref() for b in blocks], layers)
                failed = [i for i, row in enumerate(rows) if row is None]
                return p.LoadReply(req.req_id, failed), [buf for row in rows if row is not None for buf in row]
            case p.Prefetch(keys=keys):
                store.prefetch(keys)
                return p.OkReply(req.req_id), []
            case p.Remove(keys=keys):
                store.remove(keys)
                return p.OkReply(req.req_id), []
            case p.GetStats():
                return p.StatsReply(req.req_id, store.stats()), []
        raise BadRequest(f"unhandled request {type(req).__name__}")
