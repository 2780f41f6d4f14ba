"""The in-process Store: visibility, DRAM and disk eviction, pins, concurrency (real LMDB in tmp_path).
The disk tier's own behaviour is in test_store_disk.py; integrity (checksums, corruption, collisions) in
test_store_integrity.py."""

from __future__ import annotations

import threading

import pytest

from tests.cluster_helpers import wait_until
from tests.store_helpers import (
    NUM_LAYERS,
    PAYLOAD,
    assert_loaded,
    dump_all,
    dump_load_rounds,
    load_all,
    make_refs,
    open_store,
    payload,
    record_bytes,
    run_threads,
)
from ucm.api import Tier
from ucm.eviction import PolicyName
from ucm.store import StoreConfig


def test_dram_round_trip_and_prefix_lookup(tmp_path) -> None:
    with open_store(tmp_path, disk=None) as store:
        refs = make_refs(list(range(40)))  # 10 blocks
        dump_all(store, refs[:6])
        keys = [r.key for r in refs]
        assert store.lookup(keys) == 6
        assert store.lookup(keys[1:]) == 5
        assert store.lookup([keys[7], *keys[:6]]) == 0  # a prefix, not a count
        assert store.contains(keys[4:8]) == [True, True, False, False]
        ok, failed, dst = load_all(store, refs[:6])
        assert ok and failed == []
        assert_loaded(refs[:6], dst)
        ok, failed, dst = load_all(store, refs[4:8], layers=[2, 0])
        assert not ok and failed == [2, 3]
        assert_loaded(refs[4:6], dst[:2], layers=[2, 0])
        stats = store.stats()
        assert stats.tiers[Tier.DRAM].hits == 8 and stats.tiers[Tier.DRAM].misses == 2
        assert Tier.DISK not in stats.tiers


def test_prefetch_promotes(tmp_path) -> None:
    refs = make_refs(list(range(16)))
    with open_store(tmp_path) as store:
        dump_all(store, refs)
        store.flush()
    with open_store(tmp_path) as store:
        store.prefetch([r.key for r in refs])
        store._pool.submit(lambda: None).result()  # prefetch runs on the load pool; wait for it
        wait_until("the prefetch to fill DRAM", lambda: store.stats().tiers[Tier.DRAM].blocks == 4, poll_s=0.02)
        ok, _, dst = load_all(store, refs)
        assert ok and store.stats().tiers[Tier.DISK].hits == 4
        assert_loaded(refs, dst)


def test_partial_dump_never_visible(tmp_path) -> None:
    with open_store(tmp_path) as store:
        refs = make_refs(list(range(8)))
        for layer in range(NUM_LAYERS - 1):  # the last layer never arrives
            store.dump(refs, layer, NUM_LAYERS, [payload(r, layer) for r in refs]).wait()
        assert store.lookup([r.key for r in refs]) == 0
        store.commit([r.key for r in refs], True)
        assert store.lookup([r.key for r in refs]) == 0
        ok, failed, _ = load_all(store, refs)
        assert not ok and failed == [0, 1]
        # All layers but committed with ok=False: discarded too.
        dump_all(store, refs, commit=False)
        assert store.contains([r.key for r in refs]) == [False, False]
        store.commit([r.key for r in refs], False)
        store.flush()
        assert store.lookup([r.key for r in refs]) == 0
        assert store.stats().tiers[Tier.DISK].blocks == 0


def test_lru_eviction_dram_then_disk(tmp_path) -> None:
    # Unrelated blocks (each the first of its own chain), so that the order is plain LRU; chains: below.
    refs = [make_refs(list(range(4)), salt=f"chain-{i}")[0] for i in range(12)]
    with open_store(tmp_path, disk=None) as probe:
        size = record_bytes(probe, refs[0])
    with open_store(tmp_path, dram=4 * size, disk=6 * size, policy=PolicyName.LRU) as store:
        dump_all(store, refs[:4])
        assert load_all(store, [refs[0]])[0]  # refs[0] is now the most recently used
        dump_all(store, refs[4:6])  # DRAM evicts refs[1], refs[2] (still on disk)
        store.flush()
        stats = store.stats()
        assert stats.tiers[Tier.DRAM].evictions == 2 and stats.tiers[Tier.DRAM].blocks == 4
        assert all(store.contains([r.key for r in refs[:6]]))
        assert [k in store._dram for k in (r.key for r in refs[:6])] == [True, False, False, True, True, True]
        # DRAM (LRU 3, 0, 4, 5) drops refs[3] and refs[0]; disk (6 blocks, LRU by write order) deletes 0 and 1.
        dump_all(store, refs[6:8])
        store.flush()
        stats = store.stats()
        assert stats.tiers[Tier.DISK].evictions == 2 and stats.tiers[Tier.DISK].blocks == 6
        assert [k in store._dram for k in (r.key for r in refs[:8])] == [
            False,
            False,
            False,
            False,
            True,
            True,
            True,
            True,
        ]
        assert store.contains([r.key for r in refs[:8]]) == [False, False, True, True, True, True, True, True]
        _ok, failed, dst = load_all(store, refs[:8])
        assert failed == [0, 1]
        assert_loaded(refs[:8], dst, skip=(0, 1))


def test_pinned_block_not_evicted_during_load(tmp_path) -> None:
    refs = make_refs(list(range(4 * 6)))
    with open_store(tmp_path, disk=None) as probe:
        size = record_bytes(probe, refs[0])
    with open_store(tmp_path, dram=2 * size, disk=None) as store:
        dump_all(store, refs[:2])
        in_load, release = threading.Event(), threading.Event()

        def hold(_blocks) -> None:
            in_load.set()
            assert release.wait(10)

        store.load_hook = hold
        dst = [[bytearray(PAYLOAD) for _ in range(NUM_LAYERS)]]
        task = store.load([refs[0]], list(range(NUM_LAYERS)), [[memoryview(b) for b in dst[0]]])
        assert in_load.wait(10)
        dump_all(store, refs[2:5])  # each needs a victim: only refs[1] and then the newcomers may go
        assert store.contains([refs[0].key]) == [True], "a pinned block was evicted"
        release.set()
        assert task.wait(10)
        store.load_hook = None
        assert_loaded([refs[0]], dst)
        dump_all(store, refs[5:6])  # unpinned now: LRU may take it
        assert store.stats().tiers[Tier.DRAM].blocks == 2


def test_concurrent_threads_dump_and_load_same_keys(tmp_path) -> None:
    refs = make_refs(list(range(4 * 8)))
    with open_store(tmp_path) as store:
        errors = run_threads(lambda n: dump_load_rounds(store, refs, 20), 4)
        assert not errors, errors
        store.flush()
        assert store.stats().tiers[Tier.DISK].blocks == 8


def test_bad_arguments_raise(tmp_path) -> None:
    with open_store(tmp_path, disk=None) as store:
        refs = make_refs(list(range(8)))
        with pytest.raises(ValueError):
            store.dump(refs, 0, NUM_LAYERS, [b"x"])
        with pytest.raises(ValueError):
            store.dump(refs, NUM_LAYERS, NUM_LAYERS, [b"x", b"y"])
        with pytest.raises(ValueError):
            store.load(refs, [0], [[memoryview(bytearray(4))]])
        dump_all(store, refs)
        _ok, failed, _ = load_all(store, refs, size=PAYLOAD - 1)  # dst of the wrong size: a failure, no crash
        assert failed == [0, 1]
    with pytest.raises(ValueError):
        StoreConfig(dram_bytes=0)
    with pytest.raises(ValueError):
        StoreConfig(dram_bytes=1, disk_path="/tmp/x", disk_bytes=0)


@pytest.mark.parametrize("policy", list(PolicyName))
def test_every_policy_respects_capacity_and_pins(tmp_path, policy: PolicyName, caplog) -> None:
    refs = make_refs(list(range(4 * 40)))
    with open_store(tmp_path, disk=None) as probe:
        size = record_bytes(probe, refs[0])
    caplog.set_level("DEBUG", logger="ucm")
    with open_store(tmp_path, dram=5 * size, disk=8 * size, policy=policy, disk_policy=policy) as store:
        for start in range(0, 40, 4):
            dump_all(store, refs[start : start + 4])
            load_all(store, refs[: start + 4 : 3])  # some reuse for the frequency-aware policies
            store.flush()
            stats = store.stats()
            for tier in (Tier.DRAM, Tier.DISK):
                assert stats.tiers[tier].bytes_used <= stats.tiers[tier].capacity_bytes
        assert stats.tiers[Tier.DRAM].evictions > 0 and stats.tiers[Tier.DISK].evictions > 0
        present = [r for r in refs if store.contains([r.key])[0]]
        ok, failed, dst = load_all(store, present)
        assert ok, failed
        assert_loaded(present, dst)
    assert any("evicted" in m and policy.value in m for m in caplog.messages), "no debug line says what was evicted"
    assert any("disk: evicting" in m for m in caplog.messages)


def test_abandoned_dumps_expire(tmp_path) -> None:
    refs = make_refs(list(range(8)))
    with open_store(tmp_path, disk=None, pending_timeout_s=0.05) as store:
        store.dump(refs[:1], 0, NUM_LAYERS, [payload(refs[0], 0)]).wait()  # never committed
        assert store.stats().pending_blocks == 1
        threading.Event().wait(0.1)
        store.dump(refs[1:], 0, NUM_LAYERS, [payload(refs[1], 0)]).wait()  # any dump sweeps stale ones
        assert store.stats().pending_blocks == 1  # only the fresh one
        dump_all(store, refs[:1], commit=False)
        store.commit([refs[0].key], True)
        assert store.lookup([refs[0].key]) == 1
