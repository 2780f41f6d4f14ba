"""The Store's disk tier: restart, eviction by deletion, pins, and the write-behind racing `remove` (real LMDB)."""

from __future__ import annotations

import threading

import lmdb

from tests.store_helpers import (
    NUM_LAYERS,
    PAYLOAD,
    assert_loaded,
    dump_all,
    load_all,
    make_refs,
    open_store,
    payload,
    record_bytes,
)
from ucm.api import Tier
from ucm.disk_tier import DiskTier
from ucm.eviction import PolicyName, make_policy
from ucm.record import BlockRecord, checksum


def test_disk_round_trip_promotion_and_restart(tmp_path) -> None:
    refs = make_refs(list(range(24)))
    with open_store(tmp_path) as store:
        dump_all(store, refs)
        store.flush()
        assert store.stats().tiers[Tier.DISK].blocks == 6
    with open_store(tmp_path) as store:  # reopen: only the disk tier has them
        keys = [r.key for r in refs]
        assert store.lookup(keys) == 6
        ok, _, dst = load_all(store, refs)
        assert ok
        assert_loaded(refs, dst)
        stats = store.stats()
        assert stats.tiers[Tier.DISK].hits == 6 and stats.tiers[Tier.DRAM].misses == 6
        assert stats.tiers[Tier.DRAM].blocks == 6  # promoted
        ok, _, dst = load_all(store, refs)
        assert ok and store.stats().tiers[Tier.DRAM].hits == 6
        assert_loaded(refs, dst)


def test_pinned_block_not_deleted_from_disk_during_load(tmp_path) -> None:
    refs = make_refs(list(range(4 * 6)))
    with open_store(tmp_path, disk=None) as probe:
        size = record_bytes(probe, refs[0])
    with open_store(tmp_path, dram=1, disk=2 * size) as store:  # DRAM admits nothing: blocks live on disk only
        dump_all(store, refs[:2])
        store.flush()
        in_load, release = threading.Event(), threading.Event()
        store.load_hook = lambda _blocks: (in_load.set(), release.wait(10))
        dst = [[bytearray(PAYLOAD) for _ in range(NUM_LAYERS)]]
        task = store.load([refs[0]], list(range(NUM_LAYERS)), [[memoryview(b) for b in dst[0]]])
        assert in_load.wait(10)
        for i in range(2, 5):
            dump_all(store, refs[i : i + 1])
            store.flush()
        assert store.contains([refs[0].key]) == [True], "a pinned block was deleted from disk"
        assert store.stats().tiers[Tier.DISK].evictions == 3
        release.set()
        assert task.wait(10)
        assert_loaded([refs[0]], dst)


def test_reopen_keeps_recency_and_evicts_down_to_capacity(tmp_path, monkeypatch) -> None:
    refs = [make_refs(list(range(4)), salt=f"chain-{i}")[0] for i in range(6)]  # unrelated: plain commit order
    with open_store(tmp_path, disk=None) as probe:
        size = record_bytes(probe, refs[0])
    clock = iter(range(1_000_000, 1_000_100))
    monkeypatch.setattr("ucm.record.time.time", lambda: next(clock))  # one second per commit
    with open_store(tmp_path, disk=6 * size) as store:
        for i in (3, 0, 5, 1, 4, 2):  # commit order differs from key order and from position
            dump_all(store, refs[i : i + 1])
        store.flush()
    with open_store(tmp_path, disk=3 * size, disk_policy=PolicyName.LRU) as store:
        stats = store.stats().tiers[Tier.DISK]
        assert stats.blocks == 3 and stats.bytes_used <= 3 * size
        assert store.contains([r.key for r in refs]) == [False, True, True, False, True, False]  # newest 3 kept
        present = [refs[i] for i in (1, 2, 4)]
        ok, _, dst = load_all(store, present)
        assert ok
        assert_loaded(present, dst)
    with lmdb.open(str(tmp_path / "db"), readonly=True, lock=False) as env:
        assert env.stat()["entries"] == 3  # deleted, not just forgotten


def test_disk_write_that_cannot_make_room_still_deletes_its_victims(tmp_path) -> None:
    # Room for three small blocks; two are pinned, so a big block evicts the third and then finds no more room.
    refs = make_refs(list(range(4 * 4)))
    small = [_record(ref, PAYLOAD) for ref in refs[:3]]
    big = _record(refs[3], 2 * PAYLOAD)
    pinned = {refs[1].key, refs[2].key}
    disk = DiskTier(
        tmp_path / "db",
        3 * small[0].nbytes,
        1 << 24,
        make_policy(PolicyName.LRU, 3 * small[0].nbytes),
        lambda key: key not in pinned,
    )
    try:
        assert disk.write(small) == [r.key for r in small]
        assert disk.write([big]) == []  # not admitted: no room once refs[0] is gone
        assert refs[0].key not in disk and disk.snapshot().evictions == 1
        with disk._env.begin() as txn:
            assert txn.get(refs[0].key) is None, "evicted from the index but left in LMDB"
            assert txn.stat()["entries"] == 2
    finally:
        disk.close()


def _record(ref, size: int) -> BlockRecord:
    payloads = [payload(ref, layer, size) for layer in range(NUM_LAYERS)]
    return BlockRecord.build(ref, payloads, [checksum(p) for p in payloads])


def test_block_removed_while_its_disk_write_is_queued_stays_removed(tmp_path) -> None:
    refs = make_refs(list(range(4 * 2)))
    with open_store(tmp_path) as store:
        disk_write = store._disk.write
        entered, release, landed, finish = (threading.Event() for _ in range(4))

        def paused_write(records):  # the write-behind thread: hold the write before and after it lands
            entered.set()
            release.wait(10)
            out = disk_write(records)
            landed.set()
            finish.wait(10)
            return out

        store._disk.write = paused_write
        dump_all(store, refs)
        assert entered.wait(10)
        store.remove([refs[0].key])
        release.set()
        assert landed.wait(10)
        assert store.contains([r.key for r in refs]) == [False, True], "the landed write made it visible again"
        finish.set()
        store.flush()
        assert store.contains([r.key for r in refs]) == [False, True]
        assert store.stats().tiers[Tier.DISK].blocks == 1
    with lmdb.open(str(tmp_path / "db"), readonly=True, lock=False) as env:
        assert env.begin().get(refs[0].key) is None and env.begin().get(refs[1].key) is not None


def test_layer_by_layer_disk_reads_see_removes_and_rewrites_at_once(tmp_path) -> None:
    """Per-layer loads share one LMDB snapshot per moment (ucm.read_snapshot); a remove or a write retires it."""
    refs = make_refs(list(range(24)))
    with open_store(tmp_path) as store:
        one_block = record_bytes(store, refs[0])
    with open_store(tmp_path, dram=one_block, promote_on_disk_hit=False) as store:  # reads come from LMDB

        def load_layers() -> list[list[int]]:
            failed = []
            for layer in range(NUM_LAYERS):
                _ok, bad, dst = load_all(store, refs, layers=[layer])
                assert_loaded(refs, dst, layers=[layer], skip=tuple(bad))
                failed.append(bad)
            return failed

        dump_all(store, refs)
        store.flush()
        store.remove([refs[2].key])
        assert load_layers() == [[2]] * NUM_LAYERS  # a snapshot without refs[2]...
        dump_all(store, refs)  # refs[2] is written again (the others are committed already) and held in DRAM...
        dump_all(store, make_refs(list(range(100, 104))))  # ...until this block takes its place
        store.flush()
        assert load_layers() == [[]] * NUM_LAYERS  # ...is not what serves it now
        assert store.stats().corrupt_dropped == 0
