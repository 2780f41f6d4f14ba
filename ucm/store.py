"""`Store`: the in-process KV store (embedded mode, and the engine of the daemon) implementing `KVStore`.

    dump(layer) ─► pending (per key, per layer) ─commit(ok)─► DRAM tier ─write-behind─► disk tier (LMDB)
    load ◄─ DRAM (or a block still being written) ◄─ disk (verified, then promoted to DRAM)

With `DiskWrites.EVICTED` the write-behind takes a block only when DRAM evicts it (or could not admit it), so
the disk is a victim tier (`ucm.store_config.DiskWrites` says when each fits).

Eviction: each tier asks the policy built by `ucm.eviction.make_policy(config.policy, config.dram_bytes)` and
`make_policy(config.disk_policy, config.disk_bytes)` (admit/insert/touch/remove/evict(can_evict)); `can_evict`
is False for keys pinned by an in-flight load. DRAM eviction just drops (the block was written behind), or with
`DiskWrites.EVICTED` hands the block to the write-behind unless the disk has it; disk eviction deletes.
Lock order: `Store._lock` → disk tier lock → pin lock; nothing is taken the other way.
A disk block is promoted into DRAM once (the first load to read it; concurrent loads of other layers find it
there) and never after a removal started (`ucm.removal_clock`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from common.keys import KEY_NBYTES, BlockKey
from ucm.api import BlockRef, DumpsByLayers, StoreStats, Tier, check_dump_layers
from ucm.disk_tier import DiskTier
from ucm.dram_tier import DramTier
from ucm.eviction import EvictionPolicy, PolicyName, make_policy
from ucm.in_flight import InFlight
from ucm.pending_dumps import PendingDumps
from ucm.pins import PinTable
from ucm.record import BlockRecord, Buffer, as_bytes_view, checksum
from ucm.removal_clock import RemovalClock
from ucm.reuse_admission import ReuseAdmission
from ucm.store_config import DiskWrites, StoreConfig
from ucm.store_reader import BlockReader, StoreTiers
from ucm.task import Task
from ucm.tier_events import TierEvents
from ucm.write_behind import WriteBehind

__all__ = ["Store", "StoreConfig"]
log = logging.getLogger("ucm.store")
PolicyFactory = Callable[[PolicyName, int], EvictionPolicy]


def _normalized(ref: BlockRef) -> BlockRef:
    return ref if type(ref.token_ids) is tuple else BlockRef(ref.key, ref.parent, tuple(ref.token_ids))


class Store(DumpsByLayers):
    def __init__(
        self, config: StoreConfig, *, policy_factory: PolicyFactory = make_policy, events: TierEvents | None = None
    ) -> None:
        """`events`: what each tier stores and drops, as KV events (ucm/tier_events.py; the daemon publishes them)."""
        self.config = config
        self.events = events
        self._lock = threading.Lock()
        self._pins = PinTable()
        victim_tier = config.disk_writes is not DiskWrites.BEHIND and config.disk_path is not None
        demote = self._demote if victim_tier else None
        # DiskWrites.REUSED: a ghost of each declined block, for as many bytes as the disk holds.
        reused = victim_tier and config.disk_writes is DiskWrites.REUSED
        self._admission = ReuseAdmission(config.disk_bytes) if reused else None
        self._dram = DramTier(
            config.dram_bytes, policy_factory(config.policy, config.dram_bytes), self._pins.is_unpinned, demote, events
        )
        self._disk: DiskTier | None = None
        self._writer: WriteBehind | None = None
        if config.disk_path is not None:
            disk_policy = policy_factory(config.disk_policy, config.disk_bytes)
            self._disk = DiskTier(
                config.disk_path, config.disk_bytes, config.map_size, disk_policy, self._pins.is_unpinned, events
            )
            self._writer = WriteBehind(self._disk, config.write_queue_blocks, self._on_written)
        self._inflight = InFlight()  # committed, not yet on disk: still visible
        # Removed while in flight: hidden even if their disk write lands, until `_on_written` deletes it again.
        self._removed_inflight: set[BlockKey] = set()
        self._pending = PendingDumps()
        # The most bytes held outside the tiers at once, in `_pending` and `_inflight`: with DRAM's capacity this
        # bounds what the store holds (what a process keeping its freed memory, as the daemon does, grows to).
        self._transit_bytes_peak = 0
        self._removals = RemovalClock()  # a promotion from disk must not bring back what a removal deleted
        self._counters = StoreStats()
        self._last_sweep = time.monotonic()
        self._pool = ThreadPoolExecutor(config.load_threads, thread_name_prefix="ucm-load")
        self._reader = BlockReader(
            StoreTiers(
                self._lock,
                self._dram,
                self._disk,
                self._inflight,
                self._removals,
                self._counters,
                config.verify_dram_reads,
                config.promote_on_disk_hit,
            )
        )
        self._closed = False
        # Test-only: called in the load thread with the task's blocks pinned, before any byte is copied.
        self.load_hook: Callable[[Sequence[BlockRef]], None] | None = None

    # --- visibility -------------------------------------------------------------------------------------

    def _committed(self, key: BlockKey) -> bool:
        if key in self._dram or key in self._inflight:
            return True
        return self._disk is not None and key not in self._removed_inflight and key in self._disk

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            hit = 0
            for key in keys:
                if not self._committed(key):
                    break
                hit += 1
            if self._admission is not None:
                self._admission.looked_up(keys)
            self._counters.lookups += 1
            self._counters.lookup_blocks += len(keys)
            self._counters.lookup_hit_blocks += hit
            return hit

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [self._committed(key) for key in keys]

    # --- writes -----------------------------------------------------------------------------------------

    def dump_layers(
        self,
        blocks: Sequence[BlockRef],
        layers: Sequence[int],
        num_layers: int,
        data: Sequence[Sequence[memoryview | bytes]],
    ) -> Task:
        """Copy `layers` of each block now (the caller may reuse `data` once this returns). Each block is checked
        and looked up once for all its layers: a full cache's evicted blocks come with every layer at once."""
        self._check_open()
        check_dump_layers(blocks, layers, num_layers, data)
        for ref in blocks:
            if len(ref.key) != KEY_NBYTES or len(ref.parent) != KEY_NBYTES:
                raise ValueError(f"dump: keys and parents must be {KEY_NBYTES} bytes")
            if ref.token_ids and not 0 <= min(ref.token_ids) <= max(ref.token_ids) < 1 << 32:
                raise ValueError("dump: token ids must be in [0, 2**32)")
        start = time.perf_counter()
        with self._lock:
            done = [self._committed(ref.key) for ref in blocks]  # content-addressed: already stored = same bytes
        copies = []
        nbytes = 0
        for i, (ref, row) in enumerate(zip(blocks, data)):
            if not done[i]:
                payloads = [bytes(as_bytes_view(buf)) for buf in row]
                nbytes += sum(map(len, payloads))
                copies.append((i, _normalized(ref), payloads, [checksum(p) for p in payloads]))
        failed = []
        now = time.monotonic()
        with self._lock:
            for i, ref, payloads, digests in copies:
                pending = self._pending.get_or_start(ref, num_layers, now)
                if pending.ref != ref or len(pending.payloads) != num_layers:
                    log.warning("dump: %s is being dumped with different content; refusing", ref.key.hex())
                    failed.append(i)
                    continue
                for layer, payload, digest in zip(layers, payloads, digests):
                    self._pending.set_layer(pending, layer, payload, digest)
            self._note_transit_peak()
            self._sweep_pending(now)
            self._dram.stats.bytes_written += nbytes
            self._dram.stats.write_seconds += time.perf_counter() - start
        return Task.completed(len(blocks), failed)

    def _sweep_pending(self, now: float) -> None:
        if now - self._last_sweep < min(1.0, self.config.pending_timeout_s / 2):
            return
        self._last_sweep = now
        stale = [p for p in self._pending if now - p.created > self.config.pending_timeout_s]
        for pending in stale:
            log.warning(
                "dropping %s: dumped %.0f s ago and never committed", pending.ref.key.hex(), now - pending.created
            )
            self._pending.pop(pending.ref.key)

    def _note_transit_peak(self) -> None:
        """After bytes entered `_pending` or `_inflight` (under `_lock`)."""
        assert self._pending.nbytes >= 0, f"pending bytes went negative ({self._pending.nbytes})"
        self._transit_bytes_peak = max(self._transit_bytes_peak, self._pending.nbytes + self._inflight.nbytes)

    def commit(self, keys: Sequence[BlockKey], ok: bool) -> None:
        to_write: list[BlockRecord] = []
        with self._lock:
            records: list[BlockRecord] = []
            for key in keys:
                pending = self._pending.pop(key)
                if pending is None:
                    continue  # already committed by a concurrent writer, or never dumped
                missing = [i for i, p in enumerate(pending.payloads) if p is None]
                if not ok or missing:
                    log.debug("discarding %s (ok=%s, missing layers %s)", key.hex(), ok, missing[:8])
                    continue
                records.append(BlockRecord.build(pending.ref, pending.payloads, pending.checksums))  # type: ignore[arg-type]
            behind = self.config.disk_writes is DiskWrites.BEHIND
            for record, in_dram in zip(records, self._dram.put_many(records, "commit")):  # deepest first
                if self._writer is not None and (behind or (not in_dram and self._worth_disk(record, False))):
                    self._in_flight(record)
                    to_write.append(record)
                elif not in_dram:
                    log.debug("dropping %s at commit: no room in DRAM and no disk tier", record.key.hex())
        if to_write:
            assert self._writer is not None
            self._writer.submit(to_write)

    def _worth_disk(self, record: BlockRecord, was_read: bool) -> bool:
        """Whether a block leaving (or never entering) DRAM is written to disk (under `_lock`)."""
        return self._admission is None or self._admission.evicted(record.key, record.nbytes, was_read)

    def _demote(self, record: BlockRecord, was_read: bool) -> None:
        """DRAM evicted `record` (DiskWrites.EVICTED or REUSED; under `_lock`): to disk unless it is there already or
        not worth it. With the write queue full it is dropped, as a store without a disk tier drops what DRAM
        evicts."""
        assert self._writer is not None and self._disk is not None, "demotion needs a disk tier"
        if record.key in self._disk or not self._worth_disk(record, was_read):
            return
        if not self._writer.offer(record):
            log.debug("dram: evicted %s dropped: the disk write queue is full", record.key.hex())
            return
        self._in_flight(record)

    def _in_flight(self, record: BlockRecord) -> None:
        """`record` is handed to the write-behind (under `_lock`): visible from `_inflight` until written."""
        self._inflight.put(record)
        self._removed_inflight.discard(record.key)
        self._note_transit_peak()

    def _on_written(self, records: Sequence[BlockRecord], written: Sequence[BlockKey]) -> None:
        removed, settled = [], []
        with self._lock:
            for record in records:
                if self._inflight.get(record.key) is record:
                    self._inflight.pop(record.key)
                elif record.key in written:
                    removed.append(record.key)  # `remove` ran while it was being written
                if record.key in self._removed_inflight and record.key not in self._inflight:
                    settled.append(record.key)
        if removed and self._disk is not None:
            self._disk.remove(removed, purge=True)  # `remove` may have forgotten it just before the write landed
        if settled:
            with self._lock:
                self._removed_inflight.difference_update(k for k in settled if k not in self._inflight)

    def remove(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._removals.begin()
            for key in keys:
                self._pending.pop(key)
                if self._inflight.pop(key) is not None:
                    self._removed_inflight.add(key)
                self._dram.remove(key)
        try:
            if self._disk is not None:
                self._disk.remove(keys)
        finally:
            with self._lock:
                self._removals.end()

    # --- reads ------------------------------------------------------------------------------------------

    def load(self, blocks: Sequence[BlockRef], layers: Sequence[int], dst: Sequence[Sequence[memoryview]]) -> Task:
        """Copy `layers` of each block into `dst[i][j]` on a load thread; blocks stay pinned until done."""
        self._check_open()
        if len(dst) != len(blocks) or any(len(row) != len(layers) for row in dst):
            raise ValueError(f"load: dst must be {len(blocks)} rows of {len(layers)} buffers")
        if any(layer < 0 for layer in layers):
            raise ValueError(f"load: negative layer in {list(layers)}")
        views = [[as_bytes_view(buf) for buf in row] for row in dst]
        if any(view.readonly for row in views for view in row):
            raise ValueError("load: dst buffers must be writable")
        keys = [ref.key for ref in blocks]
        task = Task(len(blocks))
        self._pins.pin(keys)  # from now: nothing evicts them before the load thread reads them

        def run() -> None:
            failed: list[int] = list(range(len(blocks)))
            from_disk: list[int] = []
            try:
                if self.load_hook is not None:
                    self.load_hook(blocks)
                failed, from_disk = self.read_into(blocks, layers, views)
            except Exception:
                log.exception("load of %d blocks failed", len(blocks))
            finally:
                self._pins.unpin(keys)
                task.finish(failed, from_disk=from_disk)

        try:
            self._pool.submit(run)
        except RuntimeError:  # closed meanwhile
            self._pins.unpin(keys)
            return Task.all_failed(len(blocks), "store is closed")
        return task

    def read_into(
        self, blocks: Sequence[BlockRef], layers: Sequence[int], dst: Sequence[Sequence[memoryview]]
    ) -> tuple[list[int], list[int]]:
        """`load` on the calling thread: (failed blocks, blocks served from disk); the daemon writes a
        same-host client's shared memory with it."""
        self._check_open()
        keys = [ref.key for ref in blocks]
        self._pins.pin(keys)
        try:
            hits, _, from_disk = self._reader.read_many(blocks, layers, [list(row) for row in dst])
        finally:
            self._pins.unpin(keys)
        return [i for i, hit in enumerate(hits) if not hit], from_disk

    def read_payloads(
        self, blocks: Sequence[BlockRef], layers: Sequence[int]
    ) -> tuple[list[list[Buffer] | None], list[int]]:
        """Verified payload buffers per block (None = miss), owned by the caller, and the indices of the hits
        served from the disk tier; the daemon sends these."""
        self._check_open()
        keys = [ref.key for ref in blocks]
        self._pins.pin(keys)
        try:
            hits, rows, from_disk = self._reader.read_many(blocks, layers, None)
            return [row if hit else None for row, hit in zip(rows, hits)], from_disk
        finally:
            self._pins.unpin(keys)

    def staging_buffer(self, nbytes: int) -> memoryview:
        return memoryview(bytearray(nbytes))  # in process: any memory is as close as it gets

    def prefetch(self, keys: Sequence[BlockKey]) -> None:
        if self._disk is None or self._closed:
            return
        try:
            self._pool.submit(self._reader.promote, list(keys))
        except RuntimeError:  # closed meanwhile: a hint can be dropped
            pass

    # --- bookkeeping --------------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            stats = copy.deepcopy(self._counters)
            stats.tiers = {Tier.DRAM: copy.copy(self._dram.stats)}
            stats.pending_blocks = len(self._pending) + len(self._inflight)
            stats.transit_bytes = self._pending.nbytes + self._inflight.nbytes
            stats.transit_bytes_peak = self._transit_bytes_peak
        if self._disk is not None:
            stats.tiers[Tier.DISK] = self._disk.snapshot()
            if self._admission is not None:
                with self._lock:
                    stats.tiers[Tier.DISK].declined = self._admission.declined
        return stats

    def pending_count(self) -> int:
        """Blocks dumped and not yet committed (the daemon caps it; cheaper than `stats`)."""
        with self._lock:
            return len(self._pending)

    def flush(self) -> None:
        """Wait until every block handed to the disk tier has reached it (no-op without one): with DiskWrites.BEHIND
        every committed block, with EVICTED those DRAM evicted."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Finish loads, flush the write-behind queue and close LMDB; idempotent. (DiskWrites.EVICTED: what DRAM
        still holds is not written.)"""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
        if self._disk is not None:
            self._disk.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("store is closed")

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
