"""`StoreStats.transit_bytes` (real LMDB): the bytes a store holds outside its tiers, dumped and not yet committed or
committed and waiting for the disk write, and their most at once. DRAM's capacity plus that peak bounds what the
store held, which is what a soak allows the daemon's memory to grow by."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import ucm.disk_tier
from tests.store_helpers import NUM_LAYERS, PAYLOAD, dump_all, make_refs, open_store, payload, record_bytes


def test_pending_layers_count_once_and_leave_at_commit(tmp_path) -> None:
    refs = make_refs(list(range(8)))  # two blocks
    with open_store(tmp_path, disk=None) as store:
        for layer in (0, 1, 1):  # layer 1 dumped twice: its bytes are replaced, not added
            assert store.dump(refs, layer, NUM_LAYERS, [payload(r, layer) for r in refs]).wait(10)
        assert store.stats().transit_bytes == 2 * 2 * PAYLOAD
        assert store.dump(refs, 2, NUM_LAYERS, [payload(r, 2) for r in refs]).wait(10)
        store.commit([refs[0].key], True)
        stats = store.stats()
        assert stats.transit_bytes == NUM_LAYERS * PAYLOAD, "block 0 is in DRAM now; block 1 still pending"
        assert stats.transit_bytes_peak == 2 * NUM_LAYERS * PAYLOAD
        store.commit([refs[1].key], False)  # a failed save is discarded
        store.remove([refs[0].key])
        stats = store.stats()
        assert (stats.transit_bytes, stats.transit_bytes_peak) == (0, 2 * NUM_LAYERS * PAYLOAD)


@dataclass
class SlowDisk:
    """The one injected fault: every disk write waits for `release`; `writing` is set once one has started."""

    release: threading.Event = field(default_factory=threading.Event)
    writing: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def slow_disk(monkeypatch) -> Iterator[SlowDisk]:
    disk = SlowDisk()
    write = ucm.disk_tier.DiskTier.write

    def slow_write(self, records):
        disk.writing.set()
        assert disk.release.wait(10), "test never released the disk"
        return write(self, records)

    monkeypatch.setattr(ucm.disk_tier.DiskTier, "write", slow_write)
    yield disk
    disk.release.set()  # a failed test must not leave the write-behind thread waiting


def test_a_block_waiting_for_its_disk_write_counts_until_written(tmp_path, slow_disk) -> None:
    refs = make_refs(list(range(4)))
    with open_store(tmp_path, disk=None) as probe:  # no disk: nothing for the slow disk to hold
        size = record_bytes(probe, refs[0])
    with open_store(tmp_path) as store:  # DiskWrites.BEHIND: every commit goes to the write-behind
        dump_all(store, refs)
        assert slow_disk.writing.wait(10), "the write-behind never started"
        assert store.stats().transit_bytes == size, "committed, not yet on disk"
        slow_disk.release.set()
        store.flush()
        stats = store.stats()
        assert stats.transit_bytes == 0 and stats.transit_bytes_peak >= size
        assert stats.pending_blocks == 0


def test_removing_a_block_in_flight_frees_its_bytes(tmp_path, slow_disk) -> None:
    refs = make_refs(list(range(4)))
    with open_store(tmp_path) as store:
        dump_all(store, refs)
        assert store.stats().transit_bytes > 0
        store.remove([refs[0].key])
        assert store.stats().transit_bytes == 0
        slow_disk.release.set()
        store.flush()
        assert store.stats().transit_bytes == 0
        assert store.lookup([refs[0].key]) == 0
