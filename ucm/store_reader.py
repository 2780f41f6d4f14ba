"""The store's read path: find blocks in DRAM, in the write-behind map or on disk; verify; hand out bytes.

A block is served only if its header names the caller's key, parent and token ids (no collision can return
wrong KV) and every requested payload's checksum verifies; otherwise it is a miss and the entry is dropped.
One call handles a whole load request: one lock round for the DRAM lookups, one LMDB read transaction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ucm.api import BlockRef
from ucm.keys import BlockKey
from ucm.record import BlockRecord, RecordError, RecordMismatch, decode_record, read_layers

if TYPE_CHECKING:
    from ucm.store import Store

log = logging.getLogger("ucm.store")
# sink(j, payload of layers[j], owned): `owned` = the buffer stays valid after the call (else copy it now).
Sink = Callable[[int, "memoryview | bytes", bool], None]


class BlockReader:
    def __init__(self, store: Store) -> None:
        self._store = store

    def read_many(self, refs: Sequence[BlockRef], layers: Sequence[int], sinks: Sequence[Sink]) -> list[bool]:
        """Deliver `layers` of each block to its sink; False where it missed (a dropped bad entry included)."""
        store = self._store
        with store._lock:
            records = []
            for ref in refs:
                record = store._inflight.get(ref.key) if ref.key not in store._dram else None
                if record is not None:  # committed, evicted from DRAM before reaching disk: still served
                    store._dram.stats.hits += 1
                else:
                    record = store._dram.get(ref.key)
                records.append(record)
        ok = [False] * len(refs)
        bad: list[tuple[BlockKey, str]] = []
        start, nbytes = time.perf_counter(), 0
        for i, (ref, record) in enumerate(zip(refs, records)):
            if record is not None:
                ok[i] = self._serve_dram(ref, record, layers, sinks[i], bad)
                nbytes += sum(record.header.payload_sizes[layer] for layer in layers) if ok[i] else 0
        with store._lock:
            store._dram.stats.bytes_read += nbytes
            store._dram.stats.read_seconds += time.perf_counter() - start
        on_disk = [i for i, record in enumerate(records) if record is None]
        promoted: list[BlockRecord] = []
        if on_disk and store._disk is not None:
            promote = store.config.promote_on_disk_hit

            def visit(i: int, buf: memoryview) -> bool:
                ref, sink = refs[i], sinks[i]
                try:
                    if not promote:  # serve straight out of the memory map
                        for j, payload in enumerate(read_layers(buf, ref, layers)):
                            sink(j, payload, False)
                        return True
                    found = decode_record(bytes(buf))  # one copy out of the map, then owned by DRAM
                    self._check(ref, found, range(found.header.num_layers))
                    for j, layer in enumerate(layers):
                        sink(j, found.payloads[layer], True)
                    promoted.append(found)
                    return True
                except RecordError as exc:
                    bad.append((ref.key, f"disk entry rejected: {exc}"))
                except ValueError as exc:  # the caller's layers or buffers do not fit this block
                    log.warning("load of %s failed: %s", ref.key.hex(), exc)
                return False

            for i, hit in zip(on_disk, store._disk.read_many([refs[i].key for i in on_disk], on_disk, visit)):
                ok[i] = hit
        for key, why in bad:
            self._drop(key, why)
        if promoted:
            with store._lock:
                for record in promoted:
                    store._dram.put(record, "promoted after a disk hit")
        return ok

    def _serve_dram(
        self, ref: BlockRef, record: BlockRecord, layers: Sequence[int], sink: Sink, bad: list[tuple[BlockKey, str]]
    ) -> bool:
        try:
            self._check(ref, record, layers if self._store.config.verify_dram_reads else ())
            if any(not 0 <= layer < record.header.num_layers for layer in layers):
                raise ValueError(f"layers {list(layers)} outside the block's {record.header.num_layers}")
            for j, layer in enumerate(layers):
                sink(j, record.payloads[layer], True)
            return True
        except RecordError as exc:
            bad.append((ref.key, f"DRAM entry rejected: {exc}"))
        except ValueError as exc:
            log.warning("load of %s failed: %s", ref.key.hex(), exc)
        return False

    @staticmethod
    def _check(ref: BlockRef, record: BlockRecord, verify: Sequence[int] | range) -> None:
        if not record.header.matches(ref):
            raise RecordMismatch("key, parent or token ids differ from the caller's (hash collision or stale entry)")
        for layer in verify:
            if not 0 <= layer < record.header.num_layers:
                raise ValueError(f"layer {layer} outside the block's {record.header.num_layers}")
            if not record.verify_layer(layer):
                raise RecordError(f"checksum mismatch in layer {layer}")

    def _drop(self, key: BlockKey, why: str) -> None:
        store = self._store
        log.warning("dropping %s: %s", key.hex(), why)
        with store._lock:
            store._counters.corrupt_dropped += 1
            store._inflight.pop(key, None)
            store._dram.remove(key)
        if store._disk is not None:
            store._disk.remove([key])

    def promote(self, keys: Sequence[BlockKey]) -> None:
        """Prefetch: copy disk blocks into DRAM (verified against their own header, all layers)."""
        store = self._store
        assert store._disk is not None, "promote needs a disk tier"
        with store._lock:
            keys = [key for key in keys if key not in store._dram and key not in store._inflight]
        found: list[BlockRecord] = []
        bad: list[tuple[BlockKey, str]] = []

        def visit(key: BlockKey, buf: memoryview) -> bool:
            try:
                record = decode_record(bytes(buf))
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

        store._disk.read_many(keys, keys, visit)
        for key, why in bad:
            self._drop(key, why)
        with store._lock:
            for record in found:
                store._dram.put(record, "prefetch")
