"""`DiskWrites.EVICTED` (real LMDB): the disk tier as a victim tier. A committed block stays in DRAM only; DRAM's
evictions (and blocks DRAM does not admit) are written behind and served from disk, bytes intact; a block the disk
already holds is not written twice; a store reopened on the folder has only what was evicted. `BEHIND` writes all."""

from __future__ import annotations

import pytest

from tests.store_helpers import assert_loaded, dump_all, load_all, make_refs, open_store, record_bytes
from ucm.api import Tier
from ucm.store_config import DiskWrites, StoreConfig


def _chains(n: int) -> list:
    return [make_refs(list(range(4)), salt=f"chain-{i}")[0] for i in range(n)]  # unrelated one-block chains


def test_only_what_dram_evicts_reaches_the_disk(tmp_path) -> None:
    refs = _chains(5)
    with open_store(tmp_path, disk=None) as probe:
        size = record_bytes(probe, refs[0])
    with open_store(tmp_path, dram=3 * size, disk_writes=DiskWrites.EVICTED) as store:
        dump_all(store, refs[:3])
        store.flush()
        assert store.stats().tiers[Tier.DISK].blocks == 0, "committed blocks stay in DRAM only"
        dump_all(store, refs[3:])  # LRU evicts the two oldest to admit these
        store.flush()
        stats = store.stats()
        assert stats.tiers[Tier.DRAM].evictions == 2 and stats.tiers[Tier.DISK].blocks == 2
        assert store.lookup([r.key for r in refs]) == 5, "every block is visible, in DRAM or on disk"
        ok, failed, dst = load_all(store, refs)
        assert ok, failed
        assert_loaded(refs, dst)
        # Promoting the two disk blocks (a load pins only its own blocks) evicts two DRAM-only ones: written now.
        assert load_all(store, refs[:2])[0]
        store.flush()
        stats = store.stats().tiers[Tier.DISK]
        assert stats.blocks == 4 and store.stats().tiers[Tier.DRAM].evictions == 4
        written = stats.bytes_written
        # Promoting those two evicts the first two again, which the disk holds: nothing is written twice.
        assert load_all(store, refs[2:4])[0]
        store.flush()
        assert store.stats().tiers[Tier.DISK].bytes_written == written and store.stats().tiers[Tier.DISK].blocks == 4
    with open_store(tmp_path, dram=3 * size, disk_writes=DiskWrites.EVICTED) as store:
        on_disk = store.contains([r.key for r in refs])
        assert on_disk[:2] == [True, True], "what DRAM evicted survives a reopen"
        ok, failed, dst = load_all(store, [r for r, here in zip(refs, on_disk) if here])
        assert ok, failed


def test_a_block_dram_cannot_admit_is_still_written(tmp_path) -> None:
    refs = _chains(2)
    with open_store(tmp_path, dram=1, disk_writes=DiskWrites.EVICTED) as store:  # DRAM admits nothing
        dump_all(store, refs)
        store.flush()
        assert store.stats().tiers[Tier.DISK].blocks == 2
        ok, failed, dst = load_all(store, refs)
        assert ok, failed
        assert_loaded(refs, dst)


def test_behind_writes_every_committed_block(tmp_path) -> None:
    refs = _chains(3)
    with open_store(tmp_path) as store:  # the default
        assert store.config.disk_writes is DiskWrites.BEHIND
        dump_all(store, refs)
        store.flush()
        assert store.stats().tiers[Tier.DISK].blocks == 3 and store.stats().tiers[Tier.DRAM].blocks == 3


def test_disk_writes_must_be_the_enum() -> None:
    with pytest.raises(ValueError, match="DiskWrites"):
        StoreConfig(dram_bytes=1, disk_writes="evicted")  # type: ignore[arg-type]
