"""The store's read path: find blocks in DRAM, in the write-behind map or on disk; verify; hand out bytes.

A block is served only if its header names the caller's key, parent and token ids (no collision can return
wrong KV) and every requested payload's checksum verifies; otherwise it is a miss and the entry is dropped.
One call handles a whole load request: one lock round for the DRAM lookups, one LMDB read snapshot (shared
with the calls around it, `ucm.read_snapshot`: the connector asks for one layer per call, and each record is
looked up and its header parsed once, not once per layer). The per-payload loops are kept flat on purpose,
with a flatter one still for one-layer calls: with 16-64 KiB payloads, Python call overhead would otherwise
cost as much as the copy itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from xxhash import xxh3_64_intdigest as xxh3_64

from common.keys import BlockKey
from ucm.api import BlockRef, StoreStats
from ucm.disk_tier import DiskTier
from ucm.dram_tier import DramTier
from ucm.in_flight import InFlight
from ucm.read_snapshot import StoredRecord
from ucm.record import BlockRecord, Buffer, RecordError, RecordMismatch, decode_record
from ucm.removal_clock import RemovalClock

log = logging.getLogger("ucm.store")
# Below this a plain memoryview copy (GIL held, ~0.1 us overhead) beats numpy's GIL-free copy (~1.5 us).
_GIL_FREE_COPY_BYTES = 64 << 10
# Where payloads go: dst[i][j] a writable byte view to copy layers[j] of block i into, or None to have the
# reader return the buffers themselves (owned by the caller: DRAM buffers are immutable, disk ones copied).
Dest = list[list[memoryview]] | None
Payload = Buffer  # a DRAM record's payload, or a view into the disk tier's memory map
Rows = list[list[Payload]]
Rejects = list[tuple[BlockKey, str]]  # (key, why): entries that failed verification, dropped after the read


@dataclass(frozen=True)
class StoreTiers:
    """What the read path shares with the store (ucm/store.py builds it once). Every mutable field is guarded by
    `lock`, except `disk`, which has its own lock (taken after `lock`, never the other way)."""

    lock: threading.Lock
    dram: DramTier
    disk: DiskTier | None
    inflight: InFlight  # committed, not yet on disk: served like DRAM
    removals: RemovalClock  # a promotion from disk must not bring back what a removal deleted
    counters: StoreStats  # the reader counts corrupt entries it dropped
    verify_dram_reads: bool
    promote_on_disk_hit: bool


class BlockReader:
    def __init__(self, tiers: StoreTiers) -> None:
        self._tiers = tiers

    def read_many(
        self, refs: Sequence[BlockRef], layers: Sequence[int], dst: Dest
    ) -> tuple[list[bool], Rows, list[int]]:
        """Serve `layers` of each block into `dst` (or as returned rows); per block, whether it hit, and which
        of the hits were served from the disk tier (the rest came from DRAM or the write-behind map)."""
        tiers = self._tiers
        n = len(refs)
        if any(layer < 0 for layer in layers):
            raise ValueError(f"negative layer in {list(layers)}")
        top = max(layers, default=-1)
        rows: Rows = [[b""] * len(layers) for _ in range(n)] if dst is None else []
        # A load reading layer 0 is a use of its blocks for the policies; the connector loads one layer per call,
        # and counting each call would make every loaded block look num_layers times as hot.
        use = 0 in layers
        with tiers.lock:
            records = tiers.dram.get_many([ref.key for ref in refs], tiers.inflight, use)
            removals = tiers.removals.mark()  # before any disk read: see `promoted` below
        ok = [False] * n
        bad: Rejects = []
        verify = tiers.verify_dram_reads
        start, nbytes = time.perf_counter(), 0
        general: list[BlockRecord | None] = records
        if len(layers) == 1 and dst is not None and not verify:  # the connector's pattern: one layer per call
            nbytes = self._serve_layer(refs, records, layers[0], dst, ok, bad)
            general = []
        for i, record in enumerate(general):
            if record is None:
                continue
            ref, header = refs[i], record.header
            if not header.matches(ref):
                bad.append((ref.key, "DRAM entry is another block (hash collision or stale entry)"))
                continue
            if top >= header.num_layers:
                log.warning("load of %s: layer %d outside the block's %d", ref.key.hex(), top, header.num_layers)
                continue
            payloads, sums, sizes = record.payloads, header.checksums, header.payload_sizes
            # One flat loop for both destinations (a hot path): rows to return, or the caller's writable views.
            row: list[Any] = rows[i] if dst is None else dst[i]
            block_bytes, why = 0, None
            for j, layer in enumerate(layers):  # a failed block's dst bytes are unspecified
                buf = payloads[layer]
                if verify and xxh3_64(buf) != sums[layer]:
                    why = f"DRAM entry failed its checksum in layer {layer}"
                    bad.append((ref.key, why))
                    break
                if dst is None:
                    row[j] = buf
                elif len(row[j]) != sizes[layer]:
                    why = f"dst holds {len(row[j])} bytes, layer {layer} has {sizes[layer]}"
                    log.warning("load of %s failed: %s", ref.key.hex(), why)
                    break
                elif sizes[layer] < _GIL_FREE_COPY_BYTES:
                    row[j][:] = buf
                else:  # numpy releases the GIL while copying: load threads copy in parallel
                    np.copyto(np.frombuffer(row[j], np.uint8), np.frombuffer(buf, np.uint8))
                block_bytes += sizes[layer]
            if why is None:
                ok[i] = True
                nbytes += block_bytes
        with tiers.lock:
            tiers.dram.stats.bytes_read += nbytes
            tiers.dram.stats.read_seconds += time.perf_counter() - start
        disk = tiers.disk
        on_disk = [i for i, record in enumerate(records) if record is None]
        if on_disk and disk is not None:
            promote = tiers.promote_on_disk_hit
            one_layer = layers[0] if len(layers) == 1 and dst is not None and not promote else None

            def visit(i: int, stored: StoredRecord) -> bool:
                ref = refs[i]
                if one_layer is not None:  # the connector's pattern, flattened: same checks, fewer steps
                    try:
                        layout = stored.layout()
                        if stored.matched is not ref:  # the caller passes the same BlockRef for every layer
                            layout.check(ref)
                            stored.matched = ref if type(ref.token_ids) is tuple else None  # immutable refs only
                    except RecordError as exc:
                        bad.append((ref.key, f"disk entry rejected: {exc}"))
                        return False
                    if one_layer >= layout.num_layers:
                        log.warning(
                            "load of %s: layer %d outside the block's %d", ref.key.hex(), one_layer, layout.num_layers
                        )
                        return False
                    start, size = layout.offsets[one_layer], layout.sizes[one_layer]
                    payload = stored.view[start : start + size]
                    if xxh3_64(payload) != layout.sums[one_layer]:
                        bad.append((ref.key, f"disk entry rejected: checksum mismatch in layer {one_layer}"))
                        return False
                    out = dst[i][0]  # type: ignore[index]
                    if len(out) != size:
                        log.warning("load of %s: dst holds %d bytes, payload has %d", ref.key.hex(), len(out), size)
                        return False
                    if size < _GIL_FREE_COPY_BYTES:
                        out[:] = payload
                    else:  # numpy releases the GIL while copying: load threads copy in parallel
                        np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(payload, np.uint8))
                    return True
                decoded = None  # read from disk here: to promote into DRAM
                try:
                    payloads: list[Payload]
                    if promote:
                        with tiers.lock:  # promoted meanwhile by a concurrent load of other layers?
                            found = tiers.dram.peek(ref.key)
                        if found is None or not found.header.matches(ref):
                            found = decoded = decode_record(bytes(stored.view))  # one copy out of the map
                            self._check(ref, found)
                        payloads = [found.payloads[layer] for layer in layers]
                    else:  # serve straight out of the memory map; the header was parsed by the first layer's read
                        layout, view = stored.layout(), stored.view
                        layout.check(ref)
                        payloads = [layout.payload(view, layer) for layer in layers]
                except RecordError as exc:
                    bad.append((ref.key, f"disk entry rejected: {exc}"))
                    return False
                except ValueError as exc:  # the caller's layers do not fit this block
                    log.warning("load of %s failed: %s", ref.key.hex(), exc)
                    return False
                if dst is None:
                    rows[i] = payloads if promote else [bytes(p) for p in payloads]
                elif not self._copy(ref, payloads, dst[i]):
                    return False
                if decoded is not None:  # at once, so concurrent loads of the same blocks (other layers) hit DRAM
                    with tiers.lock:
                        # Once: another load may have promoted it since our peek (a second put would count as a
                        # use). Never after a removal: it deleted the block from both tiers after we read it.
                        if ref.key not in tiers.dram and tiers.removals.quiet_since(removals):
                            tiers.dram.put(decoded, "promoted after a disk hit")
                return True

            for i, hit in zip(on_disk, disk.read_many([refs[i].key for i in on_disk], on_disk, visit, use)):
                ok[i] = hit
        for key, why in bad:
            self._drop(key, why)
        # Not in DRAM at the lookup and verified now: it came off disk (a block that failed is in no tier).
        return ok, rows, [i for i in on_disk if ok[i]] if disk is not None else []

    @staticmethod
    def _serve_layer(
        refs: Sequence[BlockRef],
        records: list[BlockRecord | None],
        layer: int,
        dst: list[list[memoryview]],
        ok: list[bool],
        bad: Rejects,
    ) -> int:
        """`read_many`'s DRAM loop for one layer without verification, flattened: the same checks, fewer steps
        per block (this is most of a load's cost besides the copy). Returns the bytes copied."""
        nbytes = 0
        for i, record in enumerate(records):
            if record is None:
                continue
            ref, header = refs[i], record.header
            if not header.matches(ref):
                bad.append((ref.key, "DRAM entry is another block (hash collision or stale entry)"))
                continue
            sizes = header.payload_sizes
            if layer >= len(sizes):
                log.warning("load of %s: layer %d outside the block's %d", ref.key.hex(), layer, len(sizes))
                continue
            size, out = sizes[layer], dst[i][0]
            if len(out) != size:
                log.warning(
                    "load of %s failed: dst holds %d bytes, layer %d has %d", ref.key.hex(), len(out), layer, size
                )
                continue
            if size < _GIL_FREE_COPY_BYTES:
                out[:] = record.payloads[layer]
            else:  # numpy releases the GIL while copying: load threads copy in parallel
                np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(record.payloads[layer], np.uint8))
            ok[i] = True
            nbytes += size
        return nbytes

    @staticmethod
    def _copy(ref: BlockRef, payloads: list[Payload], dst_row: list[memoryview]) -> bool:
        for payload, dst in zip(payloads, dst_row):
            if len(dst) != len(payload):
                log.warning("load of %s: dst holds %d bytes, payload has %d", ref.key.hex(), len(dst), len(payload))
                return False
        for payload, dst in zip(payloads, dst_row):
            if len(payload) < _GIL_FREE_COPY_BYTES:
                dst[:] = payload
            else:  # numpy releases the GIL while copying: load threads copy in parallel
                np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(payload, np.uint8))
        return True

    @staticmethod
    def _check(ref: BlockRef, record: BlockRecord) -> None:
        """Every layer verified: `record` is about to be promoted into DRAM, where it is trusted."""
        if not record.header.matches(ref):
            raise RecordMismatch("key, parent or token ids differ from the caller's (hash collision or stale entry)")
        for layer in range(record.header.num_layers):
            if not record.verify_layer(layer):
                raise RecordError(f"checksum mismatch in layer {layer}")

    def _drop(self, key: BlockKey, why: str) -> None:
        tiers = self._tiers
        log.warning("dropping %s: %s", key.hex(), why)
        with tiers.lock:
            tiers.removals.begin()
            tiers.counters.corrupt_dropped += 1
            tiers.inflight.pop(key)
            tiers.dram.remove(key, corrupt=True)
        try:
            if tiers.disk is not None:
                tiers.disk.remove([key], corrupt=True)
        finally:
            with tiers.lock:
                tiers.removals.end()

    def promote(self, keys: Sequence[BlockKey]) -> None:
        """Prefetch: copy disk blocks into DRAM (verified against their own header, all layers)."""
        tiers, disk = self._tiers, self._tiers.disk
        assert disk is not None, "promote needs a disk tier"
        with tiers.lock:
            keys = [key for key in keys if key not in tiers.dram and key not in tiers.inflight]
            removals = tiers.removals.mark()
        found: list[BlockRecord] = []
        bad: Rejects = []

        def visit(key: BlockKey, stored: StoredRecord) -> bool:
            try:
                record = decode_record(bytes(stored.view))
                if record.key != key:
                    raise RecordMismatch("header names another key")
                for layer in range(record.header.num_layers):
                    if not record.verify_layer(layer):
                        raise RecordError(f"checksum mismatch in layer {layer}")
            except RecordError as exc:
                bad.append((key, f"disk entry rejected during prefetch: {exc}"))
                return False
            found.append(record)
            return True

        disk.read_many(keys, keys, visit)
        for key, why in bad:
            self._drop(key, why)
        with tiers.lock:
            if tiers.removals.quiet_since(removals):  # else one of them may have been removed since it was read
                tiers.dram.put_many([record for record in found if record.key not in tiers.dram], "prefetch")
