"""A test connector: forwards every call to an inner connector pair and records the call sequence.

`check_lifecycle(log.events, num_layers)` checks a recorded run against the order documented in
`connector/base.py`; it returns the list of violations (empty = conforming).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.base import ConnectorMetadata, ConnectorPair, KVConnectorScheduler, KVConnectorWorker
from connector.request_view import ConnectorRequest, ConnectorSchedulerOutput
from protocol.messages import KVTransferParams
from ucm.api import Tier

if TYPE_CHECKING:
    import torch

    from ucm_kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class Call:
    method: str
    request_id: str | None = None
    layer: int | None = None


@dataclass
class CallLog:
    events: list[Call] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, call: Call) -> None:
        with self._lock:
            self.events.append(call)

    def steps(self) -> list[list[Call]]:
        """Events cut into steps, each starting at build_connector_meta (scheduler calls before it go with it)."""
        out: list[list[Call]] = [[]]
        for ev in self.events:
            out[-1].append(ev)
            if ev.method == "clear_connector_metadata":
                out.append([])
        return [s for s in out if s]


class RecordingScheduler(KVConnectorScheduler):
    def __init__(self, inner: KVConnectorScheduler, log: CallLog) -> None:
        self.inner, self.log = inner, log

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self.log.add(Call("get_num_new_matched_tokens", request.request_id))
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.log.add(Call("update_state_after_alloc", request.request_id))
        self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: ConnectorSchedulerOutput) -> ConnectorMetadata:
        self.log.add(Call("build_connector_meta"))
        return self.inner.build_connector_meta(scheduler_output)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        self.log.add(Call("request_finished", request.request_id))
        return self.inner.request_finished(request, block_ids)

    def __getattr__(self, name: str) -> Any:  # counters and extras of the inner connector
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class RecordingWorker(KVConnectorWorker):
    def __init__(self, inner: KVConnectorWorker, log: CallLog) -> None:
        super().__init__()
        self.inner, self.log = inner, log

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self.log.add(Call("bind_connector_metadata"))
        super().bind_connector_metadata(metadata)
        self.inner.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self.log.add(Call("clear_connector_metadata"))
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.log.add(Call("register_kv_caches"))
        self.inner.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        self.log.add(Call("start_load_kv"))
        self.inner.start_load_kv()

    def needs_layer_hooks(self) -> bool:
        return self.inner.needs_layer_hooks()  # a question, not a lifecycle call: not logged

    def wait_for_layer_load(self, layer: int) -> None:
        self.log.add(Call("wait_for_layer_load", layer=layer))
        self.inner.wait_for_layer_load(layer)

    def save_kv_layer(
        self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        self.log.add(Call("save_kv_layer", layer=layer))
        self.inner.save_kv_layer(layer, k_cache, v_cache, attn_metadata)

    def wait_for_save(self) -> None:
        self.log.add(Call("wait_for_save"))
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.log.add(Call("get_finished"))
        return self.inner.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.log.add(Call("get_block_ids_with_load_errors"))
        return self.inner.get_block_ids_with_load_errors()

    def take_loaded_by_tier(self) -> dict[str, dict[Tier, int]]:
        return self.inner.take_loaded_by_tier()  # bookkeeping, not a lifecycle call: not logged

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_recording_connector(inner: ConnectorPair, log: CallLog | None = None) -> ConnectorPair:
    log = log if log is not None else CallLog()
    return ConnectorPair(RecordingScheduler(inner.scheduler, log), RecordingWorker(inner.worker, log))


_SCHEDULING = {"get_num_new_matched_tokens", "update_state_after_alloc"}
_STEP_TAIL = ["wait_for_save", "get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata"]


def check_lifecycle(events: list[Call], num_layers: int) -> list[str]:
    """Violations of base.py's documented order in a recorded run (empty list = conforming)."""
    problems: list[str] = []
    names = [ev.method for ev in events]
    if not names or names[0] != "register_kv_caches" or names.count("register_kv_caches") != 1:
        problems.append("register_kv_caches must come first, exactly once")
    i, step, forward_steps = 1, 0, 0
    asked: set[str] = set()  # requests looked up in the scheduling phase of the current step
    while i < len(events):
        ev = events[i]
        if ev.method == "request_finished":  # scheduler side, whenever a request ends (outside a forward pass)
            i += 1
            continue
        if ev.method == "get_num_new_matched_tokens":
            asked.add(str(ev.request_id))
            i += 1
            continue
        if ev.method == "update_state_after_alloc":
            if ev.request_id not in asked:
                problems.append(f"step {step}: update_state_after_alloc({ev.request_id}) without a lookup first")
            i += 1
            continue
        head = ["build_connector_meta", "bind_connector_metadata", "start_load_kv"]
        layers: list[str] = []
        if i + len(head) < len(events) and events[i + len(head)].layer is not None:  # a step with a forward pass
            for layer in range(num_layers):
                layers += [f"wait_for_layer_load:{layer}", f"save_kv_layer:{layer}"]
        expected = head + layers + _STEP_TAIL
        got = [e.method if e.layer is None else f"{e.method}:{e.layer}" for e in events[i : i + len(expected)]]
        if got != expected:
            bad = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            problems.append(f"step {step}: at call {bad} expected {expected[bad : bad + 3]}, got {got[bad : bad + 3]}")
            return problems
        forward_steps += bool(layers)
        i += len(expected)
        step += 1
        asked.clear()
    if forward_steps == 0:
        problems.append("no step with a forward pass was recorded")
    return problems
