"""`StoreClient`: the `KVStore` interface over ZeroMQ to a store daemon.

Never hangs on a dead store: every call polls with a timeout (`control_timeout_s` for the small calls, `timeout_s` for
dump/load). An unreachable store reads as a miss — `lookup` returns 0, `contains` all False, dump/load tasks fail
every block, `commit`/`remove`/`prefetch` are dropped (logged) — and `ping`/`stats` raise `StoreUnavailable`. After a
timeout the client fails fast for `retry_after_s` instead of waiting out every call; with `breaker=BreakerConfig()` it
fails fast until the store answers a background probe instead (ucm/circuit_breaker.py), and calls in flight give up at
once. Thread-safe: one DEALER socket per thread.

`auth=ClientAuth(...)` (or `ClientAuth.from_dir(DIR)` for a folder from `common.auth.generate_keys`) makes every socket a
CURVE client; without the right keys a CURVE daemon never answers (calls time out as above). Dumps go into a namespace
whose layout the daemon checks: `layout=` declares it up front; otherwise the first dump declares (num_layers, payload
bytes, tokens per block) of what it sends, under `namespace` or a name derived from that layout. The namespace is
(re)opened on the first dump and after a daemon restart.

Loads into and dumps from memory from `staging_buffer` skip the socket's payload frames when the daemon runs on this
host: the buffer is a shared-memory segment (ucm/shared_segment.py) the daemon attaches, and it writes a load's
payloads there or copies a dump's from there itself (no frames, no CURVE encryption of KV bytes). Where the daemon
cannot attach it (another host, another user, an older daemon) the payloads go as frames, from and into the same
buffer; after a daemon restart the segment is attached again.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import msgspec
import zmq

from common.auth import ClientAuth
from common.keys import BlockKey
from ucm import store_wire as p
from ucm.api import BlockRef, DumpsByLayers, StoreStats, StoreUnavailable, check_dump_layers
from ucm.circuit_breaker import BreakerConfig, BreakerStats, CircuitBreaker, CircuitOpen
from ucm.client_errors import StoreRequestError, log_unavailable, task_failed
from ucm.client_segments import ClientSegments
from ucm.load_frames import copy_frames
from ucm.record import as_bytes_view
from ucm.shared_segment import SharedSegment
from ucm.task import Outcome, Task, run_task

log = logging.getLogger("ucm.client")
R = TypeVar("R", bound=msgspec.Struct)  # a reply type
_DATA_CALLS = (p.Dump, p.Load)  # the calls that move KV bytes get `timeout_s`; the rest `control_timeout_s`
_BREAKER_POLL_S = 0.05  # with a breaker, a waiting call looks this often whether another call tripped it
__all__ = ["StoreClient", "StoreRequestError", "StoreUnavailable"]


class StoreClient(DumpsByLayers):
    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        retry_after_s: float = 1.0,
        io_threads: int = 2,
        *,
        auth: ClientAuth | None = None,
        namespace: str | None = None,
        layout: p.Layout | None = None,
        control_timeout_s: float | None = None,
        breaker: BreakerConfig | None = None,
        on_breaker_change: Callable[[BreakerStats], None] | None = None,
        shared_memory: bool = True,
    ) -> None:
        if timeout_s <= 0 or (control_timeout_s is not None and control_timeout_s <= 0):
            raise ValueError(f"timeouts must be positive, got {timeout_s}, {control_timeout_s}")
        if namespace is not None and not namespace:
            raise ValueError("namespace must be a non-empty name (or None to derive one from the layout)")
        self._curve = auth.load() if auth is not None else None  # key files read once, here
        self._namespace = namespace
        self._layout = layout
        self._opened: set[tuple[str, p.Layout]] = set()
        self.address = address
        self.timeout_s = timeout_s
        self.control_timeout_s = timeout_s if control_timeout_s is None else control_timeout_s
        self.retry_after_s = retry_after_s
        self.breaker = CircuitBreaker(self._probe, breaker, on_breaker_change) if breaker is not None else None
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._req_ids = itertools.count(1)
        self._down_until = 0.0
        self._closed = False
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="ucm-client")
        self._segments = ClientSegments(shared_memory)
        self.shared_loads = 0  # loads the daemon wrote into shared memory (the others came as frames)
        self.shared_dumps = 0  # dumps the daemon read from shared memory (the others went as frames)

    # --- transport ------------------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket[bytes]:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            with self._lock:
                if self._closed:
                    raise StoreUnavailable("client is closed")
                sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(self.address)
            self._local.sock = sock
        return sock

    def _drop_socket(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close(linger=0)  # stale replies die with it
            self._local.sock = None

    def _call(
        self,
        make: type,
        *fields: object,
        frames: Sequence[memoryview] = (),
        timeout_s: float | None = None,
        probe: bool = False,
    ) -> tuple[p.Reply, list[zmq.Frame]]:
        """Send one request and return (reply, data frames); raises StoreUnavailable / StoreRequestError.
        `probe`: the breaker's own ping, which goes through while the breaker is open."""
        with self._lock:
            req_id = next(self._req_ids)
            if self._closed:
                raise StoreUnavailable("client is closed")
            if time.monotonic() < self._down_until:
                raise StoreUnavailable(f"store at {self.address} did not answer recently; retrying later")
        breaker = None if probe else self.breaker
        if breaker is not None:
            breaker.check(make.__name__)
        if timeout_s is None:
            timeout_s = self.timeout_s if make in _DATA_CALLS else self.control_timeout_s
        sock = self._socket()
        try:
            sock.send_multipart([p.encode(make(req_id, *fields)), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            self._timed_out(breaker, probe)
            raise StoreUnavailable(f"cannot queue a request to {self.address}") from exc
        except zmq.ZMQError as exc:  # the client was closed by another thread
            raise StoreUnavailable(f"client socket unusable: {exc}") from exc
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            wait = min(remaining, _BREAKER_POLL_S) if breaker is not None else remaining
            if remaining <= 0 or not sock.poll(int(wait * 1000) + 1):
                if breaker is not None and breaker.is_open:  # another call found the store dead meanwhile
                    self._drop_socket()
                    breaker.cut_short()
                    raise CircuitOpen(f"{make.__name__} given up: the store did not answer another call")
                if time.monotonic() < deadline:
                    continue
                self._timed_out(breaker, probe)
                raise StoreUnavailable(f"store at {self.address} did not answer within {timeout_s} s")
            parts = sock.recv_multipart(copy=False)
            try:
                reply = p.reply_decoder.decode(parts[0].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._drop_socket()
                raise StoreRequestError(p.ErrorCode.MALFORMED, f"undecodable reply from {self.address}: {exc}") from exc
            if reply.req_id != req_id:
                continue  # a late answer to a request this thread already gave up on
            if isinstance(reply, p.ErrorReply):
                raise StoreRequestError(reply.code, reply.message)
            return reply, parts[1:]

    def _ask(
        self, expect: type[R], make: type, *fields: object, frames: Sequence[memoryview] = ()
    ) -> tuple[R, list[zmq.Frame]]:
        """`_call` for a request whose reply type is known; any other reply is a protocol error."""
        reply, data = self._call(make, *fields, frames=frames)
        if not isinstance(reply, expect):
            raise StoreRequestError(
                p.ErrorCode.MALFORMED, f"{make.__name__}: {self.address} answered {type(reply).__name__}"
            )
        return reply, data

    def _timed_out(self, breaker: CircuitBreaker | None, probe: bool) -> None:
        if probe:
            self._drop_socket()
        elif breaker is not None:
            self._drop_socket()
            breaker.timed_out()
        else:
            self._mark_down()

    def _probe(self, timeout_s: float) -> None:
        """The breaker's probe: any answer, even an error reply, means the store is back."""
        try:
            self._call(p.Ping, timeout_s=timeout_s, probe=True)
        except StoreRequestError:
            pass

    def _mark_down(self) -> None:
        self._drop_socket()
        with self._lock:
            self._down_until = time.monotonic() + self.retry_after_s

    # --- KVStore ----------------------------------------------------------------------------------------

    def ping(self, timeout_s: float | None = None) -> None:
        self._call(p.Ping, timeout_s=timeout_s)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        try:
            return self._ask(p.LookupReply, p.Lookup, list(keys))[0].hit
        except StoreUnavailable as exc:
            log_unavailable("lookup treated as a miss: %s", exc)
            return 0

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        try:
            return self._ask(p.ContainsReply, p.Contains, list(keys))[0].present
        except StoreUnavailable as exc:
            log_unavailable("contains treated as a miss: %s", exc)
            return [False] * len(keys)

    def dump_layers(
        self,
        blocks: Sequence[BlockRef],
        layers: Sequence[int],
        num_layers: int,
        data: Sequence[Sequence[memoryview | bytes]],
    ) -> Task:
        """`dump` of several layers in one request, sent on an I/O thread: `data[i][j]` is block i's layer
        `layers[j]`, and must stay unchanged until the task finishes."""
        check_dump_layers(blocks, layers, num_layers, data)
        if not blocks:
            return Task.completed(0)
        wire = [p.WireBlock.of(ref) for ref in blocks]
        views = [as_bytes_view(buf) for row in data for buf in row]
        layout = self._layout or p.Layout(num_layers, len(views[0]), len(wire[0].token_ids))
        name = self._namespace or f"auto-{layout.num_layers}x{layout.layer_nbytes}x{layout.block_tokens}"
        return self._run_task(len(blocks), self._dump, name, layout, wire, list(layers), num_layers, views)

    def open_namespace(self, name: str, layout: p.Layout) -> None:
        """Declare `name`'s layout to the daemon (idempotent); raises StoreRequestError if it refuses it."""
        self._call(p.OpenNamespace, name, layout)
        with self._lock:
            self._opened.add((name, layout))

    def _dump(
        self,
        name: str,
        layout: p.Layout,
        wire: list[p.WireBlock],
        layers: list[int],
        num_layers: int,
        views: list[memoryview],
    ) -> list[int]:
        with self._lock:
            opened = (name, layout) in self._opened
        if not opened:
            self.open_namespace(name, layout)
        try:
            return self._send_dump(wire, layers, num_layers, name, views)
        except StoreRequestError as exc:
            if exc.code is not p.ErrorCode.NO_NAMESPACE:
                raise
        # The daemon restarted since this client opened the namespace: reopen once, resend once.
        self.open_namespace(name, layout)
        return self._send_dump(wire, layers, num_layers, name, views)

    def _send_dump(
        self, wire: list[p.WireBlock], layers: list[int], num_layers: int, name: str, views: list[memoryview]
    ) -> list[int]:
        shared = self._segments.ranges([views])
        if shared is not None:
            reply = self._ask_shared(shared[0], p.DumpReply, p.Dump, wire, layers, num_layers, name, shared[1])
            if reply is not None:
                with self._lock:
                    self.shared_dumps += 1
                return reply.failed
        return self._ask(p.DumpReply, p.Dump, wire, layers, num_layers, name, frames=views)[0].failed

    def load(self, blocks: Sequence[BlockRef], layers: Sequence[int], dst: Sequence[Sequence[memoryview]]) -> Task:
        if len(dst) != len(blocks) or any(len(row) != len(layers) for row in dst):
            raise ValueError(f"load: dst must be {len(blocks)} rows of {len(layers)} buffers")
        views = [[as_bytes_view(buf) for buf in row] for row in dst]
        wire = [p.WireBlock.of(ref) for ref in blocks]
        return self._run_task(len(blocks), self._load, wire, list(layers), views)

    def staging_buffer(self, nbytes: int) -> memoryview:
        """Writable memory to load into: shared with the daemon where it runs on this host (see the module doc)."""
        if not self._segments.enabled:
            return memoryview(bytearray(nbytes))
        segment = self._segments.new(nbytes)
        try:
            self._attach(segment)
        except (StoreUnavailable, StoreRequestError) as exc:  # tried again on the first load into it
            log.debug("segment %s not attached yet: %s", segment.name, exc)
        return segment.payload()

    def _attach(self, segment: SharedSegment) -> bool:
        """Whether the daemon writes into `segment`; raises StoreUnavailable if it cannot be asked now."""
        try:
            self._ask(p.OkReply, p.AttachShm, segment.name, segment.nbytes, segment.token)
            attached = True
        except StoreRequestError as exc:
            log.info("store at %s cannot map shared memory (%s); payloads go over the socket", self.address, exc)
            attached = False
        self._segments.mark(segment.name, attached)
        return attached

    def _ask_shared(self, segment: SharedSegment, expect: type[R], make: type, *fields: object) -> R | None:
        """A request whose payloads the daemon reads or writes in `segment`; None if it will not attach it (then
        the caller sends frames)."""
        for attempt in range(2):
            if not self._segments.attached(segment.name) and not self._attach(segment):
                return None
            try:
                return self._ask(expect, make, *fields)[0]
            except StoreRequestError as exc:
                if exc.code is not p.ErrorCode.NO_SEGMENT or attempt:
                    raise
                self._segments.mark(segment.name, None)  # the daemon restarted or dropped it: attach again, once
        return None

    def _load(
        self, wire: list[p.WireBlock], layers: list[int], views: list[list[memoryview]]
    ) -> tuple[list[int], list[int]]:
        shared = self._segments.ranges(views)
        reply = None if shared is None else self._ask_shared(shared[0], p.LoadReply, p.Load, wire, layers, shared[1])
        frames: list[zmq.Frame] | None = None
        if reply is None:
            reply, frames = self._ask(p.LoadReply, p.Load, wire, layers)
        else:
            with self._lock:
                self.shared_loads += 1
        if any(not 0 <= i < len(wire) for i in (*reply.failed, *reply.from_disk)):
            raise StoreRequestError(p.ErrorCode.INTERNAL, "load reply names a block outside the request")
        if frames is None:  # the daemon wrote the payloads into the segment
            return sorted(set(reply.failed)), reply.from_disk
        failed = set(reply.failed)
        hits = [i for i in range(len(wire)) if i not in failed]
        if len(frames) != (want := len(hits) * len(layers)):
            raise StoreRequestError(p.ErrorCode.INTERNAL, f"load reply has {len(frames)} frames, expected {want}")
        failed |= copy_frames(frames, hits, layers, views)
        return sorted(failed), reply.from_disk  # Task.finish drops a failed block from from_disk

    def _run_task(self, num_blocks: int, fn: Callable[..., Outcome], *args: object) -> Task:
        return run_task(self._pool, num_blocks, lambda: fn(*args), task_failed)

    def commit(self, keys: Sequence[BlockKey], ok: bool) -> None:
        self._fire(p.Commit, list(keys), ok)

    def prefetch(self, keys: Sequence[BlockKey]) -> None:
        self._fire(p.Prefetch, list(keys))

    def remove(self, keys: Sequence[BlockKey]) -> None:
        self._fire(p.Remove, list(keys))

    def _fire(self, make: type, *fields: object) -> None:
        try:
            self._call(make, *fields)
        except StoreUnavailable as exc:
            log_unavailable(f"{make.__name__.lower()} dropped: %s", exc)

    def stats(self) -> StoreStats:
        return self._ask(p.StatsReply, p.GetStats)[0].stats

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
        for name in self._segments.attached_names():  # let the daemon unmap now rather than when its table is full
            try:
                self._call(p.DetachShm, name, timeout_s=min(self.control_timeout_s, 1.0))
            except (StoreUnavailable, StoreRequestError):
                break
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.breaker is not None:
            self.breaker.stop()
        self._pool.shutdown(wait=True)
        self._segments.unlink_all()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
