"""Disk tier: one LMDB environment (key -> encoded record), bounded in bytes, persistent across restarts.

Only the store's write-behind thread writes records; any thread may read or remove. The in-memory index
(key -> record bytes) answers lookups without touching LMDB and is rebuilt from the database on open.
Lock order: the store's lock may be held while taking this tier's lock, never the other way round.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

import lmdb

from common.keys import BlockKey
from common.kv_events.events import MEDIUM_STORAGE
from ucm.api import TierStats
from ucm.chain_order import deepest_first, records_deepest_first
from ucm.eviction import EvictionPolicy
from ucm.read_snapshot import SnapshotHolder, StoredRecord
from ucm.record import BlockRecord, committed_seconds, stated_parent
from ucm.tier_events import TierEvents

log = logging.getLogger("ucm.disk")
T = TypeVar("T")


class _Indexed(NamedTuple):
    committed_s: int
    key: BlockKey
    size: int
    parent: BlockKey | None


def _indexed_key(item: _Indexed) -> BlockKey:
    return item.key


def _indexed_parent(item: _Indexed) -> BlockKey | None:
    return item.parent


class DiskTier:
    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        map_size: int,
        policy: EvictionPolicy,
        can_evict: Callable[[Hashable], bool],
        events: TierEvents | None = None,
    ) -> None:
        """`events`: told each block that landed on disk and each dropped (medium STORAGE), those found at open too."""
        if capacity_bytes <= 0:
            raise ValueError(f"disk capacity must be positive, got {capacity_bytes}")
        if map_size < capacity_bytes:
            raise ValueError(f"LMDB map size {map_size} must be at least the disk capacity {capacity_bytes}")
        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self._env = lmdb.open(str(path), map_size=map_size, max_readers=256, readahead=False, metasync=False)
        self._policy = policy
        self._can_evict = can_evict
        self._events = events
        self._lock = threading.Lock()
        self._sizes: dict[BlockKey, int] = {}
        self._snapshots = SnapshotHolder(self._env)  # reads share one; every write or delete retires it
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._load_index()

    def _load_index(self) -> None:
        found: list[_Indexed] = []
        with self._env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                found.append(_Indexed(committed_seconds(value), bytes(key), len(value), stated_parent(value)))
        found.sort(key=lambda item: item.committed_s)  # oldest commit first: the order they arrived in
        for _, same_second in itertools.groupby(found, key=lambda item: item.committed_s):
            for item in deepest_first(list(same_second), _indexed_key, _indexed_parent):
                self._sizes[item.key] = item.size
                self._policy.insert(item.key, item.size, item.parent)
                self.stats.bytes_used += item.size
                if self._events is not None:
                    self._events.stored(MEDIUM_STORAGE, item.key, item.parent or bytes(len(item.key)), ())
        self.stats.blocks = len(self._sizes)
        log.info("disk: opened %s with %d blocks, %d bytes", self.path, len(self._sizes), self.stats.bytes_used)
        if self.stats.bytes_used > self.capacity_bytes:  # reopened with a smaller capacity
            victims, _ = self._make_room(0, "reopened with a smaller capacity")
            if self._events is not None:
                self._events.removed(MEDIUM_STORAGE, victims)
            self._delete(victims)

    def __contains__(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._sizes

    def _make_room(self, size: int, reason: str) -> tuple[list[BlockKey], bool]:
        """Evict so that `size` more bytes fit: (the victims, whether it fits). The victims are gone from the
        index even when it does not fit, so the caller deletes them from LMDB either way. Caller holds the lock."""
        victims: list[BlockKey] = []
        while self.stats.bytes_used + size > self.capacity_bytes:
            victim = self._policy.evict(self._can_evict)
            assert victim is None or isinstance(victim, bytes), "a tier's policy holds its BlockKeys"
            if victim is None:
                log.debug("disk: no room for %d bytes: every resident block is pinned", size)
                self.stats.blocks = len(self._sizes)
                return victims, False
            freed = self._sizes.pop(victim)
            self.stats.bytes_used -= freed
            self.stats.evictions += 1
            victims.append(victim)
            log.debug(
                "disk: evicting %s (%d bytes, policy %s) %s: %d/%d bytes used",
                victim.hex(),
                freed,
                self._policy.name.value,
                reason,
                self.stats.bytes_used,
                self.capacity_bytes,
            )
        self.stats.blocks = len(self._sizes)
        return victims, True

    def write(self, records: Sequence[BlockRecord]) -> list[BlockKey]:
        """Persist records in one transaction (evicting by deletion as needed); returns the keys written, in the
        given order (the policy sees them deepest first)."""
        victims: list[BlockKey] = []
        accepted: list[BlockRecord] = []
        with self._lock:
            for record in records_deepest_first(records):
                key, size = record.key, record.nbytes
                if key in self._sizes or size > self.capacity_bytes or not self._policy.admit(key, size):
                    continue
                made, fits = self._make_room(size, f"to admit {key.hex()} ({size} bytes)")
                victims += made
                if not fits:
                    continue
                # Reserved before the write lands; the store keeps serving the block from its in-flight map.
                self._sizes[key] = size
                self._policy.insert(key, size, record.header.parent)
                self.stats.bytes_used += size
                accepted.append(record)
            self.stats.blocks = len(self._sizes)
            if self._events is not None:  # gone from the index now, whether or not the write below lands
                self._events.removed(MEDIUM_STORAGE, victims)
        start = time.perf_counter()
        nbytes = 0
        try:
            with self._env.begin(write=True) as txn:
                for key in victims:
                    txn.delete(key)
                for record in accepted:
                    value = record.encode()
                    nbytes += len(value)
                    txn.put(record.key, value)
        except lmdb.Error as exc:
            self._snapshots.retire()
            log.error("disk: write of %d blocks failed (%s); dropping them from the index", len(accepted), exc)
            with self._lock:
                for record in accepted:
                    self._forget(record.key)
            return []
        self._snapshots.retire()
        with self._lock:
            self.stats.bytes_written += nbytes
            self.stats.write_seconds += time.perf_counter() - start
            if self._events is not None:
                for record in records_deepest_first(accepted)[::-1]:  # root first: one chain, one BlockStored
                    if record.key in self._sizes:
                        self._events.stored(MEDIUM_STORAGE, record.key, record.header.parent, record.header.token_ids)
        written = {record.key for record in accepted}
        return [record.key for record in records if record.key in written]

    def read_many(
        self, keys: Sequence[BlockKey], tags: Sequence[T], visit: Callable[[T, StoredRecord], bool], use: bool = True
    ) -> list[bool]:
        """In one read snapshot, call `visit(tag, stored record)` for each present key (its view is valid only
        during the call); returns, per key, False if absent or what `visit` said. `keys` in chain order;
        `use=False`: hits are counted but the policy is not told (another call of the same load did)."""
        with self._lock:
            present = [key in self._sizes for key in keys]
        out = [False] * len(keys)
        start, nbytes = time.perf_counter(), 0
        if any(present):
            snap = self._snapshots.acquire()
            try:
                for i, key in enumerate(keys):
                    stored = snap.get(key) if present[i] else None
                    if stored is not None and visit(tags[i], stored):
                        out[i] = True
                        nbytes += len(stored.view)
            finally:
                self._snapshots.release(snap)
        with self._lock:
            if use:
                for key, hit in zip(reversed(keys), reversed(out)):  # deepest first, as the DRAM tier does
                    if hit and key in self._sizes:
                        self._policy.touch(key)
            hits = sum(out)
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
            self.stats.bytes_read += nbytes
            self.stats.read_seconds += time.perf_counter() - start
        return out

    def _forget(self, key: BlockKey) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self._policy.remove(key)
        self.stats.bytes_used -= size
        self.stats.blocks = len(self._sizes)
        return True

    def remove(self, keys: Sequence[BlockKey], purge: bool = False, corrupt: bool = False) -> None:
        """Forget keys and delete them from LMDB; purge: delete every key from LMDB, also those the index no
        longer has (a write that landed after they were removed); corrupt: a read found them wrong."""
        with self._lock:
            present = [key for key in keys if self._forget(key)]
            if self._events is not None:
                self._events.removed(MEDIUM_STORAGE, present)
            if corrupt:
                self.stats.corrupt_dropped += len(present)
            else:
                self.stats.removed += len(present)
        self._delete(list(keys) if purge else present)

    def _delete(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            try:
                with self._env.begin(write=True) as txn:
                    for key in keys:
                        txn.delete(key)
            finally:
                self._snapshots.retire()

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(**vars(self.stats))

    def close(self) -> None:
        self._snapshots.retire()
        self._env.sync(True)
        self._env.close()
