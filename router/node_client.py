"""The router's ZeroMQ side: one ROUTER socket that nodes connect to, on the uvicorn event loop.

Registration and heartbeats update the Registry; job replies (PrefillDone, TokenBatch, JobFailed) are routed
to a per-request asyncio.Queue. When a node is dropped (missed heartbeats, no progress while it holds work, or
restarted as a new incarnation) every request outstanding on it receives a `NodeLost`: that, not a per-request
timeout, is the only way a caller stops waiting on a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from router import protocol as P
from router.registry import NodeState, Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeLost:
    node_id: str
    reason: str


class NodeUnavailable(Exception):
    """The node cannot be reached (not connected any more)."""


Reply = P.PrefillDone | P.TokenBatch | P.JobFailed | NodeLost


class NodeClient:
    def __init__(self, bind_addr: str, registry: Registry) -> None:
        self.registry = registry
        self._bind_addr = bind_addr
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished node raises instead of dropping
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted node may reuse its identity
        self._sock.bind(bind_addr)
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._streams: dict[str, tuple[str, asyncio.Queue[Reply]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.on_node_event: list = []  # callables(node_id, event) for metrics

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._expire_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._sock.close(0)
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
        try:
            await self._sock.send_multipart([node_id.encode(), P.encode(msg)])
        except zmq.ZMQError as e:
            raise NodeUnavailable(f"node {node_id} unreachable: {e}") from e

    async def abort(self, node_id: str, request_ids: list[str]) -> None:
        with contextlib.suppress(NodeUnavailable):
            await self.send(node_id, P.Abort(request_ids=request_ids))

    # ------------------------------------------------------------------ loops

    async def _reply(self, identity: bytes, msg: P.Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self._sock.send_multipart([identity, P.encode(msg)])

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                log.warning("dropping a %d-frame message", len(frames))
                continue
            identity, payload = frames[0].bytes, frames[1].buffer
            try:
                msg = P.decode(payload)
            except ValueError as e:
                log.warning("dropping a bad message from %r: %s", identity, e)
                continue
            try:
                await self._dispatch(identity, msg)
            except Exception:  # one bad message must not kill the router
                log.exception("failed to handle %s", type(msg).__name__)

    async def _dispatch(self, identity: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.Register):
            welcome, lost = self.registry.register(msg)
            if lost is not None:
                self._fail_node(lost, "node restarted")
            for callback in self.on_node_event:
                callback(msg.node_id, "registered" if welcome.accepted else "refused")
            await self._reply(identity, welcome)
        elif isinstance(msg, P.Heartbeat):
            answer = self.registry.heartbeat(msg)
            if answer is not None:
                await self._reply(identity, answer)
        elif isinstance(msg, (P.PrefillDone, P.TokenBatch, P.JobFailed)):
            entry = self._streams.get(msg.request_id)
            sender = identity.decode(errors="replace")
            if entry is None or entry[0] != sender:
                # A reply for a request the router gave up on: make sure the node frees its blocks.
                finished = isinstance(msg, P.JobFailed) or getattr(msg, "finished", False)
                if not finished and not isinstance(msg, P.PrefillDone):
                    await self._reply(identity, P.Abort(request_ids=[msg.request_id]))
                return
            entry[1].put_nowait(msg)
        else:
            log.warning("unexpected %s from a node", type(msg).__name__)

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
