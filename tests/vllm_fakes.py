"""A fake vLLM for the plugin's cores (no tests here): requests, a block allocator, paged per-layer caches and
the per-step call order of vLLM-CPU's scheduler and model runner, without vllm installed.

The order mirrors vLLM 0.32: admission (track -> num_new_matched_tokens -> allocate -> after_alloc), then per
step build_plan -> bind -> start_load (before the forward when a load is synchronous, after it otherwise) ->
for each layer: write the new tokens' K/V, wait_layer, attention, save_layer -> wait_for_save ->
take_load_errors -> clear. vLLM-CPU writes a layer's K/V *before* its wait_for_layer_load, which is why a
block that also holds a freshly computed token must arrive before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from connector.base import KVConnectorRole
from connector.metadata import ConnectorStats
from connector.vllm.key_scope import VllmKeyScope
from connector.vllm.scheduler_core import VllmSchedulerCore
from connector.vllm.step import ScheduledRequest, StepDelta, StepPlan
from connector.vllm.worker_core import VllmWorkerCore

BS = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 4
SCOPE = VllmKeyScope("folder:test-model", "float32", BS, "vllm-test/CPU_ATTN/vec")


def kv_value(token: int, pos: int, layer: int) -> float:
    """What 'the model' computes for a token at a position in a layer (deterministic, distinct)."""
    return float((token * 31 + pos * 7 + layer * 3) % 997)


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None = None


@dataclass
class StepResult:
    plan: StepPlan
    load_errors: set[int]
    calls: list[str] = field(default_factory=list)


class FakeVllm:
    def __init__(
        self,
        store,
        *,
        num_blocks: int = 32,
        role: KVConnectorRole = KVConnectorRole.BOTH,
        save_decode_blocks: bool = False,
        scope: VllmKeyScope = SCOPE,
    ) -> None:
        self.stats = ConnectorStats()
        self.sched = VllmSchedulerCore(store, scope, role, self.stats, save_decode_blocks=save_decode_blocks)
        self.worker = VllmWorkerCore(store, role, self.stats, task_timeout_s=10.0)
        self.caches = [torch.zeros(num_blocks, HEADS, BS, 2 * HEAD_DIM) for _ in range(LAYERS)]
        self.worker.register(self.caches, num_blocks)
        self.free = list(range(num_blocks))
        self.requests: dict[str, FakeRequest] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.fresh_bias: dict[tuple[str, int], float] = {}  # (request, pos) -> offset the forward adds
        self._new: set[str] = set()  # admitted since the last step: their table goes out whole
        self._preempted: set[str] = set()

    # ---- scheduler ---------------------------------------------------------------------------------------

    def admit(self, req: FakeRequest, local_hit: int = 0) -> int:
        """Admit (or resume) a request; returns the external tokens vLLM takes."""
        self.requests[req.request_id] = req
        self.sched.track(req.request_id, lambda: req.all_token_ids, req.num_prompt_tokens, req.cache_salt)
        ext = self.sched.num_new_matched_tokens(req.request_id, local_hit)
        need = -(-len(req.all_token_ids) // BS)
        table = [self.free.pop(0) for _ in range(need)]
        self.tables[req.request_id] = table
        self.sched.after_alloc(req.request_id, table, ext)
        self.computed[req.request_id] = local_hit + ext
        self._new.add(req.request_id)
        return ext

    def preempt(self, request_id: str) -> None:
        self.free.extend(self.tables.pop(request_id))
        self.computed[request_id] = 0
        self._preempted.add(request_id)

    def finish(self, request_id: str) -> None:
        self.sched.finished(request_id)
        self.free.extend(self.tables.pop(request_id, []))
        self.requests.pop(request_id, None)

    # ---- one step ------------------------------------------------------------------------------------------

    def step(self, tokens: dict[str, int] | None = None) -> StepResult:
        """Run one step: `tokens` request -> tokens to compute (default: every running request, to its end)."""
        if tokens is None:
            tokens = {rid: len(self.requests[rid].all_token_ids) - self.computed[rid] for rid in self.tables}
        scheduled = []
        for rid, n in tokens.items():
            new = rid in self._new
            scheduled.append(ScheduledRequest(rid, tuple(self.tables[rid]) if new else (), new, self.computed[rid], n))
        delta = StepDelta(tuple(scheduled), frozenset(self._preempted))
        self._new.clear()
        self._preempted.clear()
        plan = self.sched.build_plan(delta)
        calls = ["build_plan"]
        self.worker.bind(plan)
        calls.append("bind")
        sync = bool(plan.loads)
        if sync:
            self.worker.start_load()
            calls.append("start_load")
        for layer in range(LAYERS):
            for rid, n in tokens.items():
                self._write_kv(rid, layer, self.computed[rid], self.computed[rid] + n)
            self.worker.wait_layer(layer)
            self.worker.save_layer(layer)
            calls += [f"wait_layer:{layer}", f"save_layer:{layer}"]
        if not sync:
            self.worker.start_load()
            calls.append("start_load")
        self.worker.wait_for_save()
        errors = self.worker.take_load_errors()
        self.worker.clear()
        calls += ["wait_for_save", "load_errors", "clear"]
        for rid, n in tokens.items():
            self.computed[rid] += n
        return StepResult(plan, errors, calls)

    def _write_kv(self, rid: str, layer: int, start: int, stop: int) -> None:
        req, table = self.requests[rid], self.tables[rid]
        for pos in range(start, stop):
            value = kv_value(req.all_token_ids[pos], pos, layer) + self.fresh_bias.get((rid, pos), 0.0)
            self.caches[layer][table[pos // BS], :, pos % BS, :] = value

    # ---- checks --------------------------------------------------------------------------------------------

    def slot(self, rid: str, pos: int, layer: int) -> float:
        values = self.caches[layer][self.tables[rid][pos // BS], :, pos % BS, :]
        assert bool((values == values.flatten()[0]).all()), "a slot is written whole"
        return float(values.flatten()[0])

    def expected(self, rid: str, pos: int, layer: int) -> float:
        return kv_value(self.requests[rid].all_token_ids[pos], pos, layer)
