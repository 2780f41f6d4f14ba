"""A serving node: one engine behind a ZeroMQ DEALER connected to the router.

The loop never blocks on the socket while the engine has work: it drains every queued message (jobs, aborts)
with a zero-timeout poll, runs one engine step (continuous batching: new jobs join the running batch), sends
the step's outputs, and only when idle waits on the socket. Heartbeats run on their own thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from typing import Any

import msgspec
import zmq

from common.keys import KeyNamespace
from common.log_limit import LogLimiter
from node.config import NodeConfig
from node.heartbeat import HeartbeatThread, StoreStatsPoller
from node.job import RoleWorker
from node.key_cache import RecentKeys
from node.kv_events import NodeEvents
from node.openmp_env import openmp_wait
from node.runner import JobRunner
from protocol import messages as P
from protocol.peer_identity import Channel, PeerIdentity

log = logging.getLogger(__name__)

_IDLE_POLL_MS = 50
_MAX_DRAIN = 256  # messages taken per loop turn, so a flood of jobs cannot starve running requests
_bad = LogLimiter(log)  # a peer sending garbage in a loop must not make logging the bottleneck


def build_engine(config: NodeConfig, worker: RoleWorker) -> Any:
    """The node's EngineCore, with the KV connector its role runs (`worker.connector_role`)."""
    from engine import EngineCore
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    cache = CacheConfig(kv_cache_memory=config.kv_cache_memory, enable_prefix_caching=config.enable_prefix_caching)
    engine_config = EngineConfig(
        model=config.model,
        dtype=config.dtype,
        device=config.device,
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        ),
        kv_store=config.store_addr,
        kv_role=worker.connector_role.value if config.store_addr else None,
        kv_save_policy=config.kv_save_policy,
        enable_kv_cache_events=config.publishes_kv_events,
    )
    return EngineCore(engine_config)


class NodeServer:
    def __init__(self, config: NodeConfig, engine: Any, worker: RoleWorker) -> None:
        assert worker.role is config.role, f"a {worker.role.value} worker on a {config.role.value} node"
        self.config = config
        self.engine = engine
        self.node_id = config.resolved_node_id
        self.namespace: KeyNamespace = engine.namespace
        self.recent_keys = RecentKeys(config.cached_keys_cap)
        self.runner = JobRunner(engine, worker, self.recent_keys, config.step_delay_s)
        self.register_msg = P.Register(
            node_id=self.node_id,
            role=config.role,
            model=config.model_name,
            model_fingerprint=self.namespace.model_fingerprint,
            dtype=self.namespace.dtype,
            block_size=self.namespace.block_size,
            max_model_len=engine.max_model_len,
            capacity=config.max_num_seqs,
            num_blocks=engine.load().num_blocks,
            has_store=config.store_addr is not None,
            instance=uuid.uuid4().hex,
        )
        self._stop = threading.Event()
        self.bad_messages = 0  # messages from the router that could not be decoded or handled (heartbeat stat)
        self.reset_pending = False  # the router asked for ResetPrefixCache: done once no request holds blocks
        self._store_stats: StoreStatsPoller | None = None

    def stop(self) -> None:
        self._stop.set()

    def serve(self) -> None:
        ctx = zmq.Context()
        keys = self.config.router_auth.load() if self.config.router_auth is not None else None
        if keys is None:
            log.warning("node %s: router link without authentication (--insecure)", self.node_id)
        sock = ctx.socket(zmq.DEALER)
        # The instance in the identity is what keeps other peers from taking over our jobs (protocol/peer_identity.py).
        sock.setsockopt(zmq.IDENTITY, PeerIdentity(self.node_id, Channel.JOB, self.register_msg.instance).encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)  # larger frames are refused by libzmq unread
        if keys is not None:
            keys.apply(sock)
        sock.connect(self.config.router_addr)
        events = NodeEvents(self.config, self.engine) if self.config.publishes_kv_events else None
        if events is not None:  # announced in the Register, which the heartbeat thread sends
            self.register_msg = msgspec.structs.replace(self.register_msg, kv_events=events.announcement)
        heartbeat = HeartbeatThread(
            ctx, self.config.router_addr, self.register_msg, self.config.heartbeat_interval_s, self.recent_keys, keys
        )
        heartbeat.start()
        store = self.engine.kv_store
        poller = StoreStatsPoller(store) if store is not None else None
        if poller is not None:
            poller.start()
        self._store_stats = poller
        print(
            f"ucm-serve {self.config.role.value} node {self.node_id} ready: router {self.config.router_addr}, "
            f"store {self.config.store_addr or 'none'}, OpenMP wait {openmp_wait(os.environ)}",
            flush=True,
        )
        try:
            while not self._stop.is_set():
                if self._drain(sock, 0 if self.runner.busy else _IDLE_POLL_MS):
                    heartbeat.update_load(self._load())  # new jobs are visible before a long step, not after it
                frames = [frame for msg in self.runner.step() if (frame := self._encode(msg)) is not None]
                for frame in P.step_replies(frames):  # one frame a step, not one a request
                    sock.send(frame)
                if self.reset_pending and self.engine.reset_prefix_cache():
                    self.reset_pending = False
                    self.recent_keys.clear()  # the heartbeat summary forgets them too
                    log.info("device prefix cache reset")
                if events is not None:
                    events.after_step()  # one batch per step, as vLLM's scheduler publishes
                heartbeat.update_load(self._load())
        finally:
            if events is not None:
                events.close()
            if poller is not None:
                poller.stop()
            heartbeat.stop()
            heartbeat.join(timeout=2)
            sock.close(0)
            ctx.term()

    def _drain(self, sock: zmq.Socket, timeout_ms: int) -> int:
        """Take up to _MAX_DRAIN queued messages; how many were taken."""
        taken = 0
        for _ in range(_MAX_DRAIN):
            if not sock.poll(timeout_ms):
                return taken
            timeout_ms = 0
            taken += 1
            raw = sock.recv()
            try:
                self._handle(sock, raw)
            except Exception as e:  # whatever is wrong with one message, the loop goes on (RecursionError too)
                self.bad_messages += 1
                _bad.warning("dropping a message from the router (%d bytes): %r", len(raw), e)
        return taken

    def _handle(self, sock: zmq.Socket, raw: bytes) -> None:
        try:
            msg = P.decode(raw)
        except ValueError:
            rid = P.job_request_id(raw)
            if rid is not None:  # a job we cannot read still gets an answer, so its request fails fast
                self.runner.counters.refused += 1
                self._send(sock, P.JobFailed(rid, "bad job: not a valid job message"))
            raise
        if isinstance(msg, (P.PrefillJob, P.DecodeJob)):
            for reply in self.runner.submit(msg):
                self._send(sock, reply)
        elif isinstance(msg, P.Abort):
            self.runner.abort(msg.request_ids)
        elif isinstance(msg, P.ResetPrefixCache):
            self.reset_pending = True
        else:
            _bad.warning("unexpected %s from the router", type(msg).__name__)

    def _send(self, sock: zmq.Socket, msg: P.Message) -> None:
        frame = self._encode(msg)
        if frame is not None:
            sock.send(frame)

    def _encode(self, msg: P.Message) -> bytes | None:
        try:
            return P.encode(msg)
        except Exception as e:  # e.g. connector data msgpack cannot carry: fail that request, not the node
            rid = getattr(msg, "request_id", None)
            _bad.warning("cannot encode %s for %s: %r", type(msg).__name__, rid, e)
            if rid is None:
                return None
            return P.encode(P.JobFailed(rid, f"reply could not be encoded: {type(e).__name__}"))

    def _load(self) -> P.Heartbeat:
        load = self.engine.load()
        stats = {k: float(v) for k, v in vars(load.stats).items() if isinstance(v, (int, float))}
        stats.update(self.runner.counters.as_stats())
        stats["bad_messages"] = float(self.bad_messages)
        if load.connector is not None:
            stats.update(
                {f"connector_{k}": float(v) for k, v in vars(load.connector).items() if isinstance(v, (int, float))}
            )
        if self._store_stats is not None:
            stats.update(self._store_stats.latest)
        return P.Heartbeat(
            node_id=self.node_id,
            running=load.running,
            waiting=load.waiting,
            free_blocks=load.free_blocks,
            steps=load.stats.steps,
            stats=stats,
        )


def run_node(config: NodeConfig, worker: RoleWorker) -> int:
    t0 = time.monotonic()
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    engine = build_engine(config, worker)
    from engine.warmup import warm_up

    warmup = warm_up(engine)  # before the node registers: its first requests find everything built and measured
    log.info("engine ready in %.1fs (%s)", time.monotonic() - t0, warmup.line())
    server = NodeServer(config, engine, worker)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    server.serve()
    return 0
