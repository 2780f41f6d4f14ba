"""`FakeEngine` and `FakeNode`: the real node runtime (engine/node: NodeServer, JobRunner, heartbeats, the wire
protocol) around an engine that needs no model, so router tests run real ZeroMQ traffic in a second.

The fake engine answers every request with token 1, up to 64 tokens per step, until max_tokens. Two cache salts steer
it, since a test cannot otherwise make a request slow or make a step fail:
    HOLD     the request gets no tokens until aborted (a request in flight for as long as the test needs)
    EXPLODE  the step that computes it raises (a bug or a poisoned batch inside the engine)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from common.keys import BlockKey, KeyNamespace, block_keys, root_key
from engine.outputs import CompletionOutput, EngineLoad, RequestOutput
from engine.stats import EngineStats
from protocol.messages import KVTransferParams

HOLD = "hold"
EXPLODE = "explode"
VOCAB = 49152


@dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    max_tokens: int
    salt: str | None
    produced: int = 0

    @property
    def parent_id(self) -> str:
        return self.request_id


@dataclass
class _Scheduler:
    running: list[_Seq] = field(default_factory=list)
    waiting: list[_Seq] = field(default_factory=list)

    @property
    def requests(self) -> dict[str, _Seq]:
        return {s.request_id: s for s in self.running + self.waiting}


class FakeEngine:
    def __init__(self, max_model_len: int = 2048, num_blocks: int = 256) -> None:
        self.namespace = KeyNamespace("fake-model", "float32", 16)
        self.max_model_len = max_model_len
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.kv_store = None
        self.scheduler = _Scheduler()
        self.num_blocks = num_blocks
        self._stats = EngineStats()
        self._pending: list[RequestOutput] = []
        self.lock = threading.Lock()  # tests read `added` / `aborted` from their own thread
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> list[BlockKey]:
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError("prompt too long")
        with self.lock:
            self.added.append(request_id)
        seq = _Seq(request_id, list(prompt_token_ids), params.max_tokens or 16, cache_salt)
        # Held requests wait (never in a step), like requests the real scheduler has not admitted yet.
        (self.scheduler.waiting if cache_salt == HOLD else self.scheduler.running).append(seq)
        self._stats.num_requests += 1
        ns = self.namespace
        return block_keys(root_key(ns, cache_salt), list(prompt_token_ids), ns.block_size)

    def abort_request(self, request_ids: Any) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for seq in [s for s in self.scheduler.running + self.scheduler.waiting if s.request_id in ids]:
            (self.scheduler.waiting if seq in self.scheduler.waiting else self.scheduler.running).remove(seq)
            with self.lock:
                self.aborted.append(seq.request_id)
            self._pending.append(self._output(seq, [], "abort"))

    def idle(self) -> None:
        """EngineCore.idle: the thread governor's idle decisions; this engine has none."""

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._pending)

    def stats(self) -> EngineStats:
        return EngineStats(**vars(self._stats))

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(len(s.running), len(s.waiting), self.num_blocks, self.num_blocks, self.stats())

    def running_request_ids(self) -> set[str]:
        return {s.request_id for s in self.scheduler.running}

    def unfinished_request_ids(self) -> set[str]:
        return set(self.scheduler.requests)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        live = list(self.scheduler.running)
        if not live:
            time.sleep(0.002)  # only held requests: the node loop would spin on empty steps
            return outputs
        self._stats.steps += 1
        if any(s.salt == EXPLODE for s in live):
            raise RuntimeError("Overflow when unpacking long (a poisoned batch)")
        for seq in live:
            n = min(64, seq.max_tokens - seq.produced)
            seq.produced += n
            done = seq.produced >= seq.max_tokens
            if done:
                self.scheduler.running.remove(seq)
            outputs.append(self._output(seq, [1] * n, "length" if done else None))
        return outputs

    @staticmethod
    def _output(seq: _Seq, tokens: list[int], reason: str | None) -> RequestOutput:
        comp = CompletionOutput(0, "", tokens, None, reason)
        return RequestOutput(seq.request_id, None, seq.prompt, [comp], reason is not None)


class FakeNode:
    """A NodeServer around a FakeEngine, serving on a thread until `stop()`."""

    def __init__(self, router_addr: str, node_id: str, role: Any = None, heartbeat_interval_s: float = 0.1) -> None:
        from decode_node.worker import DecodeWorker
        from node.config import NodeConfig
        from node.server import NodeServer
        from prefill_node.worker import PrefillWorker
        from protocol import messages as P

        self.engine = FakeEngine()
        role = role or P.NodeRole.DECODE
        worker = PrefillWorker() if role is P.NodeRole.PREFILL else DecodeWorker(colocated=role is P.NodeRole.BOTH)
        config = NodeConfig(
            role=role,
            router_addr=router_addr,
            store_addr=None,
            node_id=node_id,
            served_model_name="smollm2-135m",
            max_num_seqs=64,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        self.server = NodeServer(config, self.engine, worker)
        self.thread = threading.Thread(target=self.server.serve, name=f"fake-node-{node_id}", daemon=True)

    def start(self) -> FakeNode:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the fake node's loop did not stop"
