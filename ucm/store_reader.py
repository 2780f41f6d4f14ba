"""The store's read path: find a block in DRAM, in the write-behind map or on disk; verify; hand out bytes.

A block is served only if its header names the caller's key, parent and token ids (no collision can return
wrong KV) and every requested payload's checksum verifies; otherwise it is a miss and the entry is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ucm.api import BlockRef
from ucm.keys import BlockKey
from ucm.record import BlockRecord, RecordError, decode_record

if TYPE_CHECKING:
    from ucm.store import Store

log = logging.getLogger("ucm.store")
# sink(j, payload of layers[j], owned): `owned` = the buffer stays valid after the call (else copy it now).
Sink = Callable[[int, "memoryview | bytes", bool], None]


class _Bad(Exception):
    """This stored entry must not be served and is dropped."""


class BlockReader:
    def __init__(self, store: Store) -> None:
        self._store = store

    def read(self, ref: BlockRef, layers: Sequence[int], sink: Sink) -> bool:
        """Deliver `layers` of `ref` to `sink`; False on a miss (including a dropped bad entry)."""
        store = self._store
        with store._lock:
            record = store._inflight.get(ref.key) if ref.key not in store._dram else None
            if record is not None:  # committed, evicted from DRAM before reaching disk: still served
                store._dram.stats.hits += 1
            else:
                record = store._dram.get(ref.key)
        if record is not None:
            return self._serve_dram(ref, record, layers, sink)
        disk = store._disk
        if disk is None:
            return False
        promote = store.config.promote_on_disk_hit

        def visit(buf: memoryview) -> BlockRecord | bool:
            found = decode_record(bytes(buf) if promote else buf)  # promotion: one copy out of the map
            self._check(ref, found, range(found.header.num_layers) if promote else layers)
            for j, layer in enumerate(layers):
                sink(j, found.payloads[layer], promote)
            return found if promote else True

        try:
            result = disk.read(ref.key, visit)
        except (_Bad, RecordError) as exc:
            self._drop(ref.key, f"disk entry rejected: {exc}")
            return False
        except ValueError as exc:  # the caller's buffers do not fit
            log.warning("load of %s failed: %s", ref.key.hex(), exc)
            return False
        if isinstance(result, BlockRecord):
            with store._lock:
                store._dram.put(result, "promoted after a disk hit")
        return result is not None

    def _serve_dram(self, ref: BlockRef, record: BlockRecord, layers: Sequence[int], sink: Sink) -> bool:
        store = self._store
        start = time.perf_counter()
        try:
            self._check(ref, record, layers if store.config.verify_dram_reads else ())
            if any(not 0 <= layer < record.header.num_layers for layer in layers):
                raise ValueError(f"layers {list(layers)} outside the block's {record.header.num_layers}")
            for j, layer in enumerate(layers):
                sink(j, record.payloads[layer], True)
        except _Bad as exc:
            self._drop(ref.key, f"DRAM entry rejected: {exc}")
            return False
        except ValueError as exc:
            log.warning("load of %s failed: %s", ref.key.hex(), exc)
            return False
        with store._lock:
            store._dram.stats.bytes_read += sum(record.header.payload_sizes[layer] for layer in layers)
            store._dram.stats.read_seconds += time.perf_counter() - start
        return True

    @staticmethod
    def _check(ref: BlockRef, record: BlockRecord, verify: Sequence[int] | range) -> None:
        if not record.header.matches(ref):
            raise _Bad("key, parent or token ids differ from the caller's (hash collision or stale entry)")
        for layer in verify:
            if not 0 <= layer < record.header.num_layers:
                raise ValueError(f"layer {layer} outside the block's {record.header.num_layers}")
            if not record.verify_layer(layer):
                raise _Bad(f"checksum mismatch in layer {layer}")

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
        for key in keys:
            with store._lock:
                if key in store._dram or key in store._inflight:
                    continue

            def visit(buf: memoryview) -> BlockRecord:
                found = decode_record(bytes(buf))
                if found.key != key:
                    raise _Bad("header names another key")
                for layer in range(found.header.num_layers):
                    if not found.verify_layer(layer):
                        raise _Bad(f"checksum mismatch in layer {layer}")
                return found

            try:
                found = store._disk.read(key, visit)
            except (_Bad, RecordError) as exc:
                self._drop(key, f"disk entry rejected during prefetch: {exc}")
                continue
            if found is not None:
                with store._lock:
                    store._dram.put(found, "prefetch")
