"""The in-process Store's integrity: a corrupt or colliding block is a miss and is dropped, never wrong data."""

from __future__ import annotations

import lmdb
import pytest

from common import keys
from tests.store_helpers import NUM_LAYERS, PAYLOAD, assert_loaded, dump_all, load_all, make_refs, open_store, payload
from ucm.api import Tier


def _flip_byte_in_lmdb(path, key: bytes, offset_from_end: int) -> None:
    env = lmdb.open(str(path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[-offset_from_end] ^= 0xFF
        txn.put(key, bytes(value))
    env.close()


def _stored_refs_with_block_1_corrupted(tmp_path, where: int) -> list:
    """12 blocks written through to LMDB, then one byte of block 1's stored value flipped at `where`."""
    refs = make_refs(list(range(12)))
    with open_store(tmp_path) as store:
        dump_all(store, refs)
        store.flush()
    record_len = len(lmdb.open(str(tmp_path / "db"), readonly=True, lock=False).begin().get(refs[1].key))
    _flip_byte_in_lmdb(tmp_path / "db", refs[1].key, min(where, record_len - 20))
    return refs


@pytest.mark.parametrize("where", [10, 10_000])  # inside a payload / inside the header
def test_corruption_on_disk_is_a_miss_and_dropped(tmp_path, where: int) -> None:
    refs = _stored_refs_with_block_1_corrupted(tmp_path, where)
    with open_store(tmp_path) as store:
        assert store.lookup([r.key for r in refs]) == 3  # lookup trusts the index; the read verifies
        ok, failed, dst = load_all(store, refs)
        assert not ok and failed == [1]
        assert bytes(dst[1][0]) == bytes(PAYLOAD) and bytes(dst[1][2]) == bytes(PAYLOAD)  # nothing copied
        assert_loaded(refs, dst, skip=(1,))
        stats = store.stats()
        assert stats.corrupt_dropped == 1 and stats.tiers[Tier.DISK].blocks == 2
        disk = stats.tiers[Tier.DISK]
        assert (disk.corrupt_dropped, disk.removed, disk.evictions) == (1, 0, 0), "counted under its reason"
        assert store.lookup([r.key for r in refs]) == 1
        store.remove([refs[2].key])
        disk = store.stats().tiers[Tier.DISK]
        assert (disk.corrupt_dropped, disk.removed) == (1, 1)
    with lmdb.open(str(tmp_path / "db"), readonly=True, lock=False) as env:
        assert env.begin().get(refs[1].key) is None  # dropped from LMDB too


def test_forced_collision_never_returns_wrong_data(tmp_path, monkeypatch) -> None:
    real_chain_key = keys.chain_key
    monkeypatch.setattr(keys, "chain_key", lambda parent, token_ids, extra=b"": real_chain_key(parent, [0]))
    a, b = make_refs([1, 2, 3, 4]), make_refs([5, 6, 7, 8])
    assert a[0].key == b[0].key and a[0].token_ids != b[0].token_ids
    with open_store(tmp_path) as store:
        store.dump(a, 0, NUM_LAYERS, [payload(a[0], 0)]).wait()
        assert store.dump(b, 0, NUM_LAYERS, [payload(b[0], 0)]).failed_blocks == [0]  # same key, other content
        dump_all(store, a)
        store.flush()
        assert store.lookup([b[0].key]) == 1  # the key is there...
        ok, failed, dst = load_all(store, b)  # ...but it is not b's block
        assert not ok and failed == [0] and bytes(dst[0][0]) == bytes(PAYLOAD)
        assert store.stats().corrupt_dropped == 1 and store.lookup([a[0].key]) == 0
        dump_all(store, b)
        ok, _, dst = load_all(store, b)
        assert ok
        assert_loaded(b, dst)
        assert not load_all(store, a)[0]


def test_dram_checksum_verified_when_enabled(tmp_path) -> None:
    refs = make_refs(list(range(8)))
    with open_store(tmp_path, disk=None, verify_dram_reads=True) as store:
        dump_all(store, refs)
        record = store._dram._blocks[refs[1].key]
        record.payloads[2] = bytes(PAYLOAD)  # simulate memory corruption of one payload
        ok, failed, _ = load_all(store, refs, layers=[0, 1])
        assert ok  # layer 2 was not asked for
        ok, failed, _ = load_all(store, refs)
        assert failed == [1] and store.stats().corrupt_dropped == 1
        assert store.lookup([r.key for r in refs]) == 1


@pytest.mark.parametrize("where", [10, 10_000])  # inside the last layer's payload / inside the header
def test_corruption_found_by_one_layer_loads_straight_from_lmdb(tmp_path, where: int) -> None:
    """The connector's pattern (one layer per call) with DRAM out of the way: the shared read snapshot must not
    let a layer skip its checksum, nor a later call miss that the block was dropped."""
    refs = _stored_refs_with_block_1_corrupted(tmp_path, where)
    with open_store(tmp_path, promote_on_disk_hit=False) as store:
        last = NUM_LAYERS - 1
        for layer in range(last if where == 10 else 0):  # a payload flip spoils only its own layer
            ok, _, dst = load_all(store, refs, layers=[layer])
            assert ok
            assert_loaded(refs, dst, layers=[layer])
        ok, failed, dst = load_all(store, refs, layers=[last])
        assert not ok and failed == [1] and bytes(dst[1][0]) == bytes(PAYLOAD)
        assert_loaded(refs, dst, layers=[last], skip=(1,))
        assert store.stats().corrupt_dropped == 1
        assert load_all(store, refs, layers=[0])[1] == [1]  # dropped: a miss from now on
        assert store.lookup([r.key for r in refs]) == 1
