"""The router's ZeroMQ side: one ROUTER socket that nodes connect to, on the uvicorn event loop.

Registration and heartbeats update the Registry; job replies (PrefillDone, TokenBatch, JobFailed) are routed
to a per-request asyncio.Queue. When a node is dropped (missed heartbeats, no progress while it holds work, or
restarted as a new incarnation) every request outstanding on it receives a `NodeLost`: that, not a per-request
timeout, is the only way a caller stops waiting on a node.

Authentication: with a `ServerAuth` the socket is a CURVE server; ZAP refuses unknown keys at the handshake and
`NodeGate` drops (and counts) any message whose key, socket identity and node id do not agree. Jobs go to the job
socket identity learnt from the node's own authenticated Register (protocol/peer_identity.py), never to an identity
a peer merely claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from common import log_limit
from common.auth import ServerAuth
from common.log_limit import LogLimiter
from protocol import messages as P
from protocol.peer_identity import Channel, PeerIdentity
from router.node_gate import DropReason, NodeGate
from router.registry import NodeState, Registry

log = logging.getLogger(__name__)
INSECURE_WARNING = (
    "router node socket running without authentication (--insecure): anyone who reaches it can register as a node"
)


@dataclass(frozen=True)
class NodeLost:
    node_id: str
    reason: str


class NodeUnavailable(Exception):
    """The node cannot be reached (not connected any more)."""


Reply = P.PrefillDone | P.TokenBatch | P.JobFailed | NodeLost


def _user_id(frame: zmq.Frame) -> str | None:
    try:
        user_id = frame.get("User-Id")
        return str(user_id)
    except zmq.ZMQError:  # no such property: not a frame ZAP authenticated (the gate drops it as an unknown key)
        return None


class NodeClient:
    def __init__(self, bind_addr: str, registry: Registry, auth: ServerAuth | None = None) -> None:
        self.registry = registry
        self._bind_addr = bind_addr
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished node raises instead of dropping
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)  # larger frames: libzmq drops the peer unread
        # No handover: a second connection presenting an identity already connected is ignored, so even a peer that
        # learnt a node's identity cannot take its jobs over. A restarted node has a new identity (new instance),
        # and ZMTP heartbeats free the identity of a connection that died without closing.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # Generous: answered by libzmq's I/O thread, but a starved machine must not cut a live node's connection.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 20000)
        self._authenticator = None
        if auth is not None:
            self.gate = NodeGate(auth.peer_names())
            self._authenticator = auth.apply(self._ctx, self._sock)
        else:
            self.gate = NodeGate(None)
            log.warning(INSECURE_WARNING)
        self._sock.bind(bind_addr)
        self.address: str = bytes(self._sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self._streams: dict[str, tuple[str, asyncio.Queue[Reply]]] = {}
        # node id -> job socket identities of its current and previous incarnation (an Abort may be for either)
        self._routes: dict[str, tuple[bytes, bytes | None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.loop_errors = 0  # messages whose handling raised out of the receive loop (/metrics)
        self._bad_log = log_limit.LogLimiter(log)
        self._drop_log = LogLimiter(log)
        self._undecodable = 0
        self.on_node_event: list[Callable[[str, str], None]] = []  # callables(node_id, event) for metrics

    @property
    def bad_messages(self) -> int:
        """Messages dropped unread: undecodable, or refused by the gate (wrong key, identity or node id)."""
        return self._undecodable + sum(self.gate.dropped.values())

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_forever()), asyncio.create_task(self._expire_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._sock.close(0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()

    # ------------------------------------------------------------------ requests

    def open(self, request_id: str, node: NodeState) -> asyncio.Queue[Reply]:
        """Route replies for `request_id` from `node` into a fresh queue (replacing any earlier stage's)."""
        self.close_stream(request_id)
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._streams[request_id] = (node.node_id, queue)
        node.inflight.add(request_id)
        node.progress.work_started(time.monotonic())
        return queue

    def close_stream(self, request_id: str) -> None:
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            node = self.registry.nodes.get(entry[0])
            if node is not None:
                node.inflight.discard(request_id)
                if not node.inflight:
                    node.progress.work_ended()

    async def send(self, node_id: str, msg: P.Message) -> None:
        route = self._routes.get(node_id)
        if route is None:
            raise NodeUnavailable(f"node {node_id} never registered")
        try:
            await self._sock.send_multipart([route[0], P.encode(msg)])
        except zmq.ZMQError as e:
            raise NodeUnavailable(f"node {node_id} unreachable: {e}") from e

    async def abort(self, node_id: str, request_ids: list[str]) -> None:
        for identity in self._routes.get(node_id, ()):
            if identity is not None:
                await self._reply(identity, P.Abort(request_ids=request_ids))

    # ------------------------------------------------------------------ loops

    async def _reply(self, identity: bytes, msg: P.Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self._sock.send_multipart([identity, P.encode(msg)])

    def _bad_message(self, what: str) -> None:
        self.loop_errors += 1
        self._bad_log.warning("dropping %s", what)

    async def _receive_forever(self) -> None:
        """The receive loop, restarted after any error one message raises outside its own handling
        (RecursionError from deep nesting, a TypeError, UnicodeDecodeError...): that message is dropped and
        counted, the next one is read. Only closing the socket ends it."""
        while True:
            try:
                await self._recv_loop()
            except zmq.ZMQError as e:
                if self._sock.closed:
                    return
                self._bad_message(f"a message (socket error: {e})")
            except Exception as e:
                self._bad_message(f"a message ({type(e).__name__}: {str(e)[:200]})")
            await asyncio.sleep(0)  # an error that repeats must not starve the event loop

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                log.warning("dropping a %d-frame message", len(frames))
                continue
            identity, payload = frames[0].bytes, frames[1].buffer
            # ZAP's User-Id: the z85 public key the peer authenticated with (only a CURVE socket has one).
            user_id = _user_id(frames[1]) if self.gate.secure else None
            peer = self.gate.peer(identity, user_id)
            if isinstance(peer, DropReason):
                self._dropped(peer, identity, user_id)
                continue
            try:
                msg = P.decode(payload)
            except ValueError as e:
                self._undecodable += 1
                self._drop_log.warning("dropping a bad message from %r: %s", identity[:64], e)
                continue
            refused = self.gate.check(peer, msg)
            if refused is not None:
                self._dropped(refused, identity, user_id)
                continue
            try:
                await self._dispatch(identity, peer, msg)
            except Exception as e:  # one bad message must not kill the router; counted, logged rate-limited
                log.debug("handling %s raised", type(msg).__name__, exc_info=True)
                self._bad_message(f"a {type(msg).__name__} whose handling raised {type(e).__name__}: {str(e)[:200]}")

    def _dropped(self, reason: DropReason, identity: bytes, user_id: str | None) -> None:
        name = self.gate.key_name(user_id)
        self._drop_log.warning("dropped a message from %r (key %s): %s", identity[:64], name or "unknown", reason.value)
        if name is not None:  # a metric label only from an authorized key's name: bounded by the key folder
            for callback in self.on_node_event:
                callback(name, "unauthorized")

    async def _dispatch(self, identity: bytes, peer: PeerIdentity, msg: P.Message) -> None:
        if isinstance(msg, P.Register):
            welcome, lost = self.registry.register(msg)
            if lost is not None:
                self._fail_node(lost, "node restarted")
            if welcome.accepted:
                job = PeerIdentity(peer.node_id, Channel.JOB, peer.instance).encode()
                current = self._routes.get(peer.node_id)
                if current is None or current[0] != job:
                    self._routes[peer.node_id] = (job, current[0] if current is not None else None)
            for callback in self.on_node_event:
                callback(msg.node_id, "registered" if welcome.accepted else "refused")
            await self._reply(identity, welcome)
        elif isinstance(msg, P.Heartbeat):
            node = self.registry.nodes.get(msg.node_id)
            if node is not None and node.info.instance != peer.instance:
                return  # a previous incarnation (paused, then resumed) must not keep the new one's entry alive
            answer = self.registry.heartbeat(msg)
            if answer is not None:
                await self._reply(identity, answer)
        elif isinstance(msg, P.JOB_REPLIES):
            await self._job_reply(identity, peer, msg)
        elif isinstance(msg, P.StepReplies):
            for reply in P.job_replies(msg):
                if isinstance(reply, ValueError):
                    self._undecodable += 1
                    self._drop_log.warning("dropping a bad reply in a step from %r: %s", identity[:64], reply)
                else:
                    await self._job_reply(identity, peer, reply)
        else:
            log.warning("unexpected %s from a node", type(msg).__name__)

    async def _job_reply(self, identity: bytes, peer: PeerIdentity, msg: P.JobReply) -> None:
        entry = self._streams.get(msg.request_id)
        if entry is None or entry[0] != peer.node_id:
            # A reply for a request the router gave up on: make sure the node frees its blocks.
            finished = isinstance(msg, P.JobFailed) or msg.finished
            if not finished and not isinstance(msg, P.PrefillDone):
                await self._reply(identity, P.Abort(request_ids=[msg.request_id]))
            return
        entry[1].put_nowait(msg)

    def _fail_node(self, node: NodeState, reason: str) -> None:
        for request_id in list(node.inflight):
            entry = self._streams.get(request_id)
            if entry is not None and entry[0] == node.node_id:
                entry[1].put_nowait(NodeLost(node.node_id, reason))
        node.inflight.clear()
        node.progress.work_ended()

    async def _expire_loop(self) -> None:
        period = max(0.05, self.registry.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for node in self.registry.expire(now):
                self._fail_node(node, "missed heartbeats")
                for callback in self.on_node_event:
                    callback(node.node_id, "dropped")
            for node in self.registry.drop_stalled(now):
                self._fail_node(node, f"no progress for {node.progress.stalled_for(now):.0f}s")
                for callback in self.on_node_event:
                    callback(node.node_id, "stalled")
