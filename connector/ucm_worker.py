"""UCMDirectConnector, worker side: moves KV between the paged cache and the store, layer by layer.

Loads: `start_load_kv` issues one store load per layer into host staging buffers and returns; the
attention of layer L waits only for layer L's load (`wait_for_layer_load`), then scatters it into the cache.
Saves: `save_kv_layer` copies layer L's newly full blocks into staging (so the cache may be overwritten) and
dumps them asynchronously; `wait_for_save` waits for every dump and commits the blocks whose every layer landed.
Write-back saves (blocks the device prefix cache evicted this step) are copied whole, every layer, in
`start_load_kv`, before anything of the step writes the cache, and dumped in one request.
A failed load fails that block and every later block of its request (a prefix is all attention can use);
those device blocks are reported through `get_block_ids_with_load_errors` and never counted as loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from connector.base import ConnectorMetadata, KVConnectorRole, KVConnectorWorker
from connector.kv_layout import KVLayout, StagingBuffer, pack_blocks, unpack_blocks
from connector.metadata import BlockSpec, ConnectorStats, UCMConnectorMetadata, commit_saves, failed_rows, store_failed
from connector.step_loads import StepLoads
from ucm.api import BlockRef, KVStore, StoreTask, Tier

log = logging.getLogger(__name__)

# A task still running after this long is treated as failed (a stuck daemon must not hang the engine).
TASK_TIMEOUT_S = 60.0
# A step whose save is at most this many bytes per layer goes to the store in one request after the last layer,
# not one per layer: a decode step's few newly full blocks would otherwise cost a round trip to the daemon per
# layer (30 on the embedded model), each waking threads that take the engine's cores. Bigger saves (prefill
# chunks) still stream layer by layer, overlapping the forward.
SMALL_SAVE_LAYER_BYTES = 1 << 20


@dataclass
class _Dump:
    """One store request of this step's saves: the layers it carries, and whether it came from the small-save
    buffer (else from `layers[0]`'s own staging)."""

    layers: list[int]
    task: StoreTask | None
    small: bool = False


@dataclass(kw_only=True)
class _StepLoads(StepLoads):
    specs: list[BlockSpec]
    row_of_spec: list[int]  # first row of each spec
    device_ids: torch.Tensor  # [rows] destination block id of each row


class UCMWorkerConnector(KVConnectorWorker):
    def __init__(
        self,
        store: KVStore,
        role: KVConnectorRole,
        stats: ConnectorStats,
        *,
        owns_store: bool = False,
        task_timeout_s: float = TASK_TIMEOUT_S,
        small_save_layer_bytes: int = SMALL_SAVE_LAYER_BYTES,
    ) -> None:
        """`owns_store`: close the store with the connector (a daemon client; embedded stores are shared)."""
        super().__init__()
        self.store = store
        self.owns_store = owns_store
        self.role = role
        self.stats = stats
        self.task_timeout_s = task_timeout_s
        self.small_save_layer_bytes = small_save_layer_bytes
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._layout: KVLayout | None = None
        self._load_bufs: list[StagingBuffer] = []
        self._save_bufs: list[StagingBuffer] = []
        self._loads: _StepLoads | None = None
        self._saves: list[_Dump] = []  # this step's store requests
        self._small_layers: list[int] = []  # layers of this step's small save packed and not yet sent
        self._small_saves: StagingBuffer | None = None
        self._evicted_buf: StagingBuffer | None = None  # layer L of an evicted save in rows [L * n, (L + 1) * n)
        self._evicted_dump: _Dump | None = None
        self._load_errors: set[int] = set()
        self._errored_requests: set[str] = set()  # this step's requests with a failed load
        # request id -> blocks it loaded, by the store tier they came from: for the per-tier prompt-token split
        self._loaded_by_tier: dict[str, dict[Tier, int]] = {}
        self._h2d_done: torch.cuda.Event | None = None  # CUDA event after the last staging -> cache copy
        self._warn_at = 0.0  # when the last store-failure warning was logged

    @property
    def layout(self) -> KVLayout:
        assert self._layout is not None, "register_kv_caches was not called"
        return self._layout

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._layout = KVLayout.from_caches(kv_caches)
        self._caches = list(kv_caches)
        self._load_bufs = [self._staging() for _ in kv_caches]
        self._save_bufs = [self._staging() for _ in kv_caches]
        self._small_saves = self._staging()  # layer L of a small save in rows [L * n, (L + 1) * n)
        self._evicted_buf = self._staging()

    def _staging(self) -> StagingBuffer:
        """Staging in the store's fastest memory: a daemon on this host maps it (no payload frames)."""
        return StagingBuffer(self.layout, self.store.staging_buffer)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, UCMConnectorMetadata), f"expected UCMConnectorMetadata, got {type(metadata)}"
        super().bind_connector_metadata(metadata)
        assert self._loads is None and not self._saves and not self._small_layers, "previous step's saves are open"
        assert self._evicted_dump is None, "previous step's write-back save is open"
        self._errored_requests = set()

    @property
    def _meta(self) -> UCMConnectorMetadata:
        meta = self.metadata
        assert isinstance(meta, UCMConnectorMetadata), f"expected UCMConnectorMetadata, got {type(meta).__name__}"
        return meta

    # ---- 5. loads ------------------------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        self._save_evicted()  # first: this step's loads, copies and forward overwrite those slots
        self._loads = None
        specs = [spec for spec in self._meta.loads if spec.blocks]
        if not specs:
            return
        if self._h2d_done is not None:  # last step's host-to-device copies may still read the staging buffers
            self._h2d_done.synchronize()
            self._h2d_done = None
        rows = 0
        first_rows: list[int] = []
        ids: list[int] = []
        for spec in specs:
            first_rows.append(rows)
            rows += len(spec.blocks)
            ids.extend(spec.block_ids)
        loads = _StepLoads(
            specs=specs,
            row_of_spec=first_rows,
            device_ids=torch.tensor(ids, dtype=torch.long),
            blocks=[ref for spec in specs for ref in spec.blocks],
        )
        # Every layer at once: the store serves them in parallel. (Issuing layer 0 alone first, so that a disk
        # hit is read and promoted once, measured slower: the duplicate reads run on otherwise idle workers.)
        for layer in range(len(self._caches)):
            self._issue_load(loads, layer)
        self._loads = loads

    def _issue_load(self, loads: _StepLoads, layer: int) -> None:
        buf = self._load_bufs[layer]
        buf.reserve(loads.num_rows)
        dst = [[view] for view in buf.memoryviews(loads.num_rows)]
        try:
            loads.tasks[layer] = self.store.load(loads.blocks, [layer], dst)
        except Exception as exc:
            self._store_failed("load", exc)
            loads.tasks[layer] = None

    def needs_layer_hooks(self) -> bool:
        """Loads in flight, or full blocks to save as each layer is computed (write-back saves are whole-block,
        before and after the forward)."""
        loads = self._loads
        return (loads is not None and bool(loads.tasks)) or (self.role.saves and bool(self._meta.saves))

    def wait_for_layer_load(self, layer: int) -> None:
        loads = self._loads
        t0 = time.perf_counter()
        if loads is None or (arrived := loads.arrive(layer, self.task_timeout_s)) is None:
            return
        if arrived.stuck:  # leave the buffer to the straggler; later steps get a new one
            self._load_bufs[layer] = self._staging()
        good = arrived.good
        if good:
            k_cache, v_cache = self._caches[layer]
            rows = torch.tensor(good, dtype=torch.long)
            unpack_blocks(
                self._load_bufs[layer], rows, loads.num_rows, k_cache, v_cache, loads.device_ids.index_select(0, rows)
            )
            if k_cache.device.type == "cuda":
                self._h2d_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._h2d_done.record()
        self.stats.load_wait_seconds += time.perf_counter() - t0

    def _finish_loads(self) -> None:
        """Account this step's loads once every layer was waited for; prefix semantics per request."""
        loads = self._loads
        if loads is None:
            return
        while loads.tasks:  # a layer the model never waited for (should not happen) still counts
            self.wait_for_layer_load(min(loads.tasks))
        nbytes = self.layout.payload_nbytes * self.layout.num_layers
        for spec, first in zip(loads.specs, loads.row_of_spec):
            ok = loads.loaded_prefix(first, len(spec.blocks))
            # Only the loaded prefix counts; a block is a disk hit if any of its layers came off disk.
            disk = sum(1 for i in range(ok) if first + i in loads.disk_rows)
            if ok:
                tiers = self._loaded_by_tier.setdefault(spec.request_id, {})
                tiers[Tier.DRAM] = tiers.get(Tier.DRAM, 0) + ok - disk
                tiers[Tier.DISK] = tiers.get(Tier.DISK, 0) + disk
            self.stats.blocks_loaded += ok
            self.stats.blocks_loaded_disk += disk
            self.stats.bytes_loaded += ok * nbytes
            self.stats.blocks_load_failed += len(spec.blocks) - ok
            self._load_errors.update(spec.block_ids[ok:])
            if ok < len(spec.blocks):
                self._errored_requests.add(spec.request_id)
                log.warning(
                    "request %s: load failed for %d of %d external blocks (from block %d); recomputing",
                    spec.request_id,
                    sum(first + i in loads.failed_rows for i in range(len(spec.blocks))),
                    len(spec.blocks),
                    ok,
                )
        self._loads = None

    # ---- 6. saves ------------------------------------------------------------------------------------------

    def save_kv_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata: object) -> None:
        if not self.role.saves or self._metadata is None:
            return
        saves = self._meta.saves
        if not saves:
            return
        t0 = time.perf_counter()
        ids = torch.tensor([b for spec in saves for b in spec.block_ids], dtype=torch.long, device=k_cache.device)
        n = int(ids.numel())
        if n * self.layout.payload_nbytes <= self.small_save_layer_bytes:
            assert self._small_saves is not None, "register_kv_caches was not called"
            self._small_saves.reserve(self.layout.num_layers * n)  # all layers' rows now: growing drops the rows
            pack_blocks(k_cache, v_cache, ids, self._small_saves, first_row=layer * n)
            self._small_layers.append(layer)  # sent by wait_for_save, with the other layers
        else:
            buf = self._save_bufs[layer]
            pack_blocks(k_cache, v_cache, ids, buf)
            self._sync_host(k_cache)
            blocks = [ref for spec in saves for ref in spec.blocks]
            self._saves.append(_Dump([layer], self._dump(blocks, [layer], [buf.memoryviews(n)])))
        self.stats.save_seconds += time.perf_counter() - t0

    def _dump(self, blocks: list[BlockRef], layers: list[int], views: list[list[memoryview]]) -> StoreTask | None:
        """`views[j][i]`: block i's payload of `layers[j]`."""
        try:
            if len(layers) == 1:
                return self.store.dump(blocks, layers[0], self.layout.num_layers, views[0])
            data = [[views[j][i] for j in range(len(layers))] for i in range(len(blocks))]
            return self.store.dump_layers(blocks, layers, self.layout.num_layers, data)
        except Exception as exc:
            self._store_failed("dump", exc)
            return None

    def _send_small_saves(self, blocks: list[BlockRef]) -> None:
        layers, self._small_layers = self._small_layers, []
        if not layers:
            return
        assert self._small_saves is not None, "register_kv_caches was not called"
        self._saves.append(_Dump(layers, self._dump_layer_rows(self._small_saves, blocks, layers), small=True))

    def _dump_layer_rows(self, buf: StagingBuffer, blocks: list[BlockRef], layers: list[int]) -> StoreTask | None:
        """One request for `layers` of `blocks`, staged in `buf` with layer L's n rows at [L * n, (L + 1) * n)."""
        n = len(blocks)
        views = buf.memoryviews((max(layers) + 1) * n)
        return self._dump(blocks, layers, [views[layer * n : (layer + 1) * n] for layer in layers])

    def _save_evicted(self) -> None:
        evicted = self._meta.evicted_saves
        if not self.role.saves or not evicted:
            return
        t0 = time.perf_counter()
        assert self._evicted_buf is not None, "register_kv_caches was not called"
        blocks = [ref for spec in evicted for ref in spec.blocks]
        n = len(blocks)
        ids = torch.tensor([b for spec in evicted for b in spec.block_ids], dtype=torch.long)
        num_layers = self.layout.num_layers
        self._evicted_buf.reserve(num_layers * n)  # all layers' rows now: growing drops the rows
        for layer, (k_cache, v_cache) in enumerate(self._caches):
            pack_blocks(k_cache, v_cache, ids.to(k_cache.device), self._evicted_buf, first_row=layer * n)
        self._sync_host(self._caches[0][0])
        layers = list(range(num_layers))
        self._evicted_dump = _Dump(layers, self._dump_layer_rows(self._evicted_buf, blocks, layers))
        self.stats.save_seconds += time.perf_counter() - t0

    def _commit_evicted(self) -> None:
        dump, self._evicted_dump = self._evicted_dump, None
        if dump is None:
            return
        t0 = time.perf_counter()
        evicted = self._meta.evicted_saves
        failed, stuck = failed_rows(dump.task, sum(len(spec.blocks) for spec in evicted), self.task_timeout_s)
        if stuck:  # leave the buffer to the straggler
            self._evicted_buf = self._staging()
        nbytes = self.layout.payload_nbytes * self.layout.num_layers
        # Their KV was computed by earlier steps, so no failed load of this step taints them.
        self._warn_at = commit_saves(self.store, evicted, failed, set(), self.stats, nbytes, self._warn_at)
        self.stats.save_seconds += time.perf_counter() - t0

    @staticmethod
    def _sync_host(cache: torch.Tensor) -> None:
        if cache.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the dump reads host staging from another thread

    def wait_for_save(self) -> None:
        self._finish_loads()  # after the last layer: every load is known before deciding what to commit
        if self._metadata is None:
            return
        self._commit_evicted()
        saves = self._meta.saves
        if self._small_layers:
            self._sync_host(self._caches[0][0])
            self._send_small_saves([ref for spec in saves for ref in spec.blocks])
        dumps, self._saves = self._saves, []
        if not saves:
            return
        t0 = time.perf_counter()
        num_rows = sum(len(spec.blocks) for spec in saves)
        failed: set[int] = set()
        for dump in dumps:
            bad_rows, stuck = failed_rows(dump.task, num_rows, self.task_timeout_s)
            failed |= bad_rows
            if stuck and dump.small:
                self._small_saves = self._staging()
            elif stuck:
                self._save_bufs[dump.layers[0]] = self._staging()
        if len({layer for dump in dumps for layer in dump.layers}) != self.layout.num_layers:
            failed = set(range(num_rows))  # a layer never dumped: the block would be incomplete
        nbytes = self.layout.payload_nbytes * self.layout.num_layers
        self._warn_at = commit_saves(
            self.store, saves, failed, self._errored_requests, self.stats, nbytes, self._warn_at
        )
        self.stats.save_seconds += time.perf_counter() - t0

    # ---- 8. results ----------------------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing is asynchronous beyond its step

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_loaded_by_tier(self) -> dict[str, dict[Tier, int]]:
        """Blocks each request loaded since the last call, by the store tier they came from (loaded and verified
        only: a failed block and every later one of its request count nothing)."""
        self._finish_loads()
        out, self._loaded_by_tier = self._loaded_by_tier, {}
        return out

    def close(self) -> None:
        if self.owns_store:
            self.owns_store = False
            self.store.close()

    def _store_failed(self, what: str, exc: Exception) -> None:
        self._warn_at = store_failed(self.stats, what, exc, self._warn_at)
