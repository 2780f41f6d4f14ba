"""`KVIndex`: the router's prefix index, fed by the nodes' KV events (vLLM's wire format, common/kv_events/).

Per node and per medium ("GPU": the node's device cache; "CPU", "STORAGE": store tiers) the set of block keys it
announced with BlockStored and has not taken back with BlockRemoved. `holders(keys)` answers "who holds how much of
this prefix": for each node, how many leading keys of the prompt it holds.

Each node announces its event endpoints in its Register; `track` subscribes (one thread, `StreamPoller`, owns every
SUB and replay socket), `forget` drops a node. Nothing is routed on a stale entry:
    - a node dropped (missed heartbeats, stalled) or restarted (a new incarnation registers) is forgotten at once,
      on the caller's thread, before its socket is even closed;
    - AllBlocksCleared forgets everything the node announced;
    - batches lost for good (gap beyond the replay buffer, publisher restart, unreadable batch) forget the node too
      and it is rebuilt from what follows (subscriber.py: a suffix of the events gives a subset of the truth).
A generation number per subscription keeps a batch that was in flight when its node was forgotten from landing.

A publisher whose hashes the router cannot compute from a prompt (a `vllm serve` instance; the store daemon behind
vLLM instances) is tracked with `rechain=True`: its blocks are re-keyed from their token ids as they arrive
(router/vllm_block_keys.py), and `holders` / `depth` then answer for `vllm_block_keys.prompt_keys`. Such a stream
starts from the publisher's replay ring, not its snapshot (which names blocks without their tokens).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from common.auth import CurveClientKeys, ServerAuth
from common.kv_events.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from common.kv_events.subscriber import REPLAY_TIMEOUT_S, EventStream, StreamPoller
from protocol import messages as P
from router.registry import Registry
from router.vllm_block_keys import Rechain

log = logging.getLogger(__name__)

# The id the store daemon's events are indexed under (`--store-kv-events`): every node with a store reads from it.
STORE_SOURCE = "<store>"
STORE_MEDIA = (MEDIUM_CPU, MEDIUM_STORAGE)


@dataclass
class _Node:
    instance: str
    endpoints: P.KVEventsEndpoint | None  # None: events handed over in process (`attach` / `ingest`)
    generation: int
    media: dict[str, set[BlockHash]] = field(default_factory=dict)  # medium -> keys held there
    rechain: Rechain | None = None  # the publisher's hashes -> the router's keys (None: its hashes are ours)


@dataclass(frozen=True)
class _Subscribe:
    node_id: str
    generation: int
    endpoints: P.KVEventsEndpoint
    keys: CurveClientKeys | None
    snapshot: bool  # start from the publisher's snapshot (it names blocks without their tokens: not to re-key)


@dataclass(frozen=True)
class _Unsubscribe:
    node_id: str


_STOP = None


class _Wake:
    """The index thread's command doorbell, polled beside the streams."""

    deadline = None

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._rung = False

    def readable(self, replay: bool) -> None:
        while True:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._rung = True

    def tick(self, now: float) -> None:
        pass

    def take(self) -> bool:
        rung, self._rung = self._rung, False
        return rung


class KVIndex:
    def __init__(self, auth: ServerAuth | None = None, replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        """`auth`: the router's node-socket keys; the router subscribes as a CURVE client of each node with its own
        pair and the node's authorized public key (None: plain sockets, `--insecure`)."""
        self._auth = auth
        self._replay_timeout_s = replay_timeout_s
        self._lock = threading.Lock()  # _nodes and _holders: written by the index thread, read by the event loop
        self._nodes: dict[str, _Node] = {}
        self._holders: dict[str, dict[BlockHash, set[str]]] = {}  # medium -> key -> node ids holding it
        self._generations = 0
        self.batches = 0  # batches applied, all nodes
        self.resets = 0  # nodes forgotten because their stream lost batches or they sent AllBlocksCleared
        self._commands: queue.SimpleQueue[_Subscribe | _Unsubscribe | None] = queue.SimpleQueue()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._wake_addr = f"inproc://kv-index-{id(self):x}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the event loop's side

    def track(
        self,
        node_id: str,
        instance: str,
        endpoints: P.KVEventsEndpoint | None,
        server_key: Path | None = None,
        rechain: bool = False,
        plain: bool = False,
    ) -> None:
        """A node registered: index its events (a new incarnation or new endpoints start from nothing). A node
        without events is forgotten. `server_key`: the publisher's public key file, where it is not the node's
        authorized key (the store daemon's server.key). `rechain`: re-key its blocks from their token ids. `plain`:
        the publisher has no CURVE keys (vLLM's own), whatever the router's auth."""
        if endpoints is None:
            self.forget(node_id)
            return
        keys = None
        if self._auth is not None and not plain:
            try:
                if server_key is not None:
                    keys = self._auth.client_keys_with(server_key)
                else:
                    keys = self._auth.client_keys_for(node_id)
            except ValueError as e:
                log.warning("node %s: cannot subscribe to its KV events: %s", node_id, e)
                self.forget(node_id)
                return
        with self._lock:
            node = self._nodes.get(node_id)
            if node is not None and node.instance == instance and node.endpoints == endpoints:
                return  # the same process registering again: its stream goes on
            self._drop_locked(node_id)
            self._generations += 1
            self._nodes[node_id] = _Node(instance, endpoints, self._generations, rechain=Rechain() if rechain else None)
            command = _Subscribe(node_id, self._generations, endpoints, keys, snapshot=not rechain)
        log.info("node %s: indexing KV events from %s", node_id, endpoints.endpoint)
        self._send(command)

    def attach(self, node_id: str, instance: str, rechain: bool = False) -> None:
        """Index a node whose events reach the router in process (`ingest`), not over a socket: a simulated
        cluster (benchmarks/cluster_sim.py) feeds the same state, under the same rules, as the nodes' streams."""
        with self._lock:
            self._drop_locked(node_id)
            self._generations += 1
            self._nodes[node_id] = _Node(instance, None, self._generations, rechain=Rechain() if rechain else None)

    def ingest(self, node_id: str, batch: KVEventBatch) -> None:
        """One batch of an `attach`ed node's events, applied now."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None or node.endpoints is not None:
                raise ValueError(f"node {node_id} is not attached for in-process events")
            generation = node.generation
        self._apply(node_id, generation, batch)

    def forget(self, node_id: str) -> None:
        """A node was dropped: nothing it announced counts from now on."""
        with self._lock:
            known = self._drop_locked(node_id)
        if known:
            self._send(_Unsubscribe(node_id))

    def indexed(self, node_id: str) -> bool:
        """Whether the node's holdings come from its KV events."""
        with self._lock:
            return node_id in self._nodes

    def holders(self, keys: Sequence[BlockHash], medium: str = MEDIUM_GPU) -> dict[str, int]:
        """node id -> how many leading `keys` it holds in `medium`, for every indexed node holding at least one."""
        out: dict[str, int] = {}
        with self._lock:
            by_key = self._holders.get(medium, {})
            live: set[str] | None = None
            for depth, key in enumerate(keys, 1):
                have = by_key.get(key)
                if not have:
                    break
                live = set(have) if live is None else live & have
                if not live:
                    break
                for node_id in live:
                    out[node_id] = depth
        return out

    def depth(self, source: str, keys: Sequence[BlockHash], media: Iterable[str]) -> int:
        """How many leading `keys` `source` holds, each in any of `media` (a store serves one prefix from DRAM and
        disk together)."""
        with self._lock:
            maps = [self._holders.get(medium, {}) for medium in media]
            held = 0
            for key in keys:
                if not any(source in m.get(key, ()) for m in maps):
                    break
                held += 1
            return held

    def prefix_hits(
        self, node_ids: Iterable[str], keys: Sequence[BlockHash], medium: str = MEDIUM_GPU
    ) -> dict[str, int]:
        """node id -> leading `keys` held in `medium`, for each of `node_ids` that is indexed (0 included); the
        pairing's `hits`."""
        held = self.holders(keys, medium) if keys else {}
        with self._lock:
            return {node_id: held.get(node_id, 0) for node_id in node_ids if node_id in self._nodes}

    def follow(self, registry: Registry) -> Callable[[str, str], None]:
        """A NodeClient.on_node_event callback: index a node when it registers, forget it when it is dropped."""

        def node_event(node_id: str, event: str) -> None:
            if event == "registered":
                node = registry.nodes.get(node_id)
                if node is not None:
                    self.track(node_id, node.info.instance, node.info.kv_events)
            elif event in ("dropped", "stalled"):
                self.forget(node_id)

        return node_event

    def sizes(self) -> dict[tuple[str, str], int]:
        """Blocks indexed per (node or the store's source, medium): what the router's /metrics shows."""
        with self._lock:
            return {(n, m): len(keys) for n, node in self._nodes.items() for m, keys in node.media.items()}

    def blocks(self, node_id: str, medium: str = MEDIUM_GPU) -> frozenset[BlockHash]:
        with self._lock:
            node = self._nodes.get(node_id)
            return frozenset(node.media.get(medium, ())) if node is not None else frozenset()

    def close(self) -> None:
        self._send(_STOP)
        self._thread.join(5)
        with self._wake_lock:
            self._wake_tx.close(0)
        self._ctx.destroy(linger=0)

    def _send(self, command: _Subscribe | _Unsubscribe | None) -> None:
        self._commands.put(command)
        with self._wake_lock:
            self._wake_tx.send(b"")

    # ------------------------------------------------------------------ state (under the lock)

    def _drop_locked(self, node_id: str) -> bool:
        node = self._nodes.pop(node_id, None)
        if node is None:
            return False
        self._clear_locked(node_id, node)
        return True

    def _clear_locked(self, node_id: str, node: _Node) -> None:
        for medium, keys in node.media.items():
            by_key = self._holders.get(medium, {})
            for key in keys:
                holders = by_key.get(key)
                if holders is not None:
                    holders.discard(node_id)
                    if not holders:
                        del by_key[key]
        node.media.clear()

    def _current(self, node_id: str, generation: int) -> _Node | None:
        node = self._nodes.get(node_id)
        return node if node is not None and node.generation == generation else None

    def _apply(self, node_id: str, generation: int, batch: KVEventBatch) -> None:
        with self._lock:
            node = self._current(node_id, generation)
            if node is None:
                return  # forgotten (or re-subscribed) while this batch was on its way
            self.batches += 1
            for theirs in batch.events:
                event = node.rechain.event(theirs) if node.rechain is not None else theirs
                if event is None:
                    continue
                if isinstance(event, AllBlocksCleared):
                    self._clear_locked(node_id, node)
                    continue
                medium = event.medium or MEDIUM_GPU  # vLLM before the medium field: its device cache
                held = node.media.setdefault(medium, set())
                by_key = self._holders.setdefault(medium, {})
                if isinstance(event, BlockStored):
                    self._add(node_id, held, by_key, event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    for key in event.block_hashes:
                        held.discard(key)
                        holders = by_key.get(key)
                        if holders is not None:
                            holders.discard(node_id)
                            if not holders:
                                del by_key[key]

    @staticmethod
    def _add(node_id: str, held: set[BlockHash], by_key: dict[BlockHash, set[str]], keys: Iterable[BlockHash]) -> None:
        for key in keys:
            held.add(key)
            by_key.setdefault(key, set()).add(node_id)

    def _reset(self, node_id: str, generation: int, why: str) -> None:
        with self._lock:
            node = self._current(node_id, generation)
            if node is not None:
                self.resets += 1
                self._clear_locked(node_id, node)
                if node.rechain is not None:
                    node.rechain = Rechain()

    # ------------------------------------------------------------------ the index thread

    def _run(self) -> None:
        poller = StreamPoller()
        streams: dict[str, EventStream] = {}
        wake = _Wake(self._wake_rx)
        poller.register(self._wake_rx, wake, replay=False)
        try:
            while True:
                poller.poll()
                if wake.take() and not self._run_commands(poller, streams):
                    return
        except zmq.ContextTerminated:
            return
        except Exception:
            log.exception("the KV event index thread failed")
        finally:
            for stream in streams.values():
                stream.close()
            self._wake_rx.close(0)

    def _run_commands(self, poller: StreamPoller, streams: dict[str, EventStream]) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            old = streams.pop(command.node_id, None)
            if old is not None:
                old.close()
            if isinstance(command, _Subscribe):
                streams[command.node_id] = self._subscribe(poller, command)

    def _subscribe(self, poller: StreamPoller, command: _Subscribe) -> EventStream:
        node_id, generation = command.node_id, command.generation
        return EventStream(
            self._ctx,
            poller,
            command.endpoints.endpoint,
            command.endpoints.replay_endpoint,
            lambda _seq, batch: self._apply(node_id, generation, batch),
            lambda why: self._reset(node_id, generation, why),
            topic=command.endpoints.topic,
            keys=command.keys,
            replay_timeout_s=self._replay_timeout_s,
            # whole at once from the publisher's snapshot, not from however much its ring still holds; a re-keyed
            # publisher replays its ring instead (vLLM's answers a snapshot request that way anyway)
            snapshot=command.snapshot,
        )
