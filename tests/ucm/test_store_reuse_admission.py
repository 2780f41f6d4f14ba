"""`DiskWrites.REUSED` (real LMDB): DRAM's evictions reach the disk while evicted blocks come back, and only those that
showed reuse once they stop coming back. Past a warm-up of evictions nobody asks for again, a block evicted unread
leaves a ghost and no disk write; the same block evicted again (saved anew since) is written; a block a load read
while in DRAM is written at its first eviction; lookups asking for evicted blocks again make every eviction written;
what is written loads back intact."""

from __future__ import annotations

import pytest

from common.keys import BlockKey
from tests.store_helpers import assert_loaded, dump_all, load_all, make_refs, open_store, record_bytes
from ucm.api import Tier
from ucm.reuse_admission import MIN_EVICTIONS, ReuseAdmission
from ucm.store_config import DiskWrites


def _chains(n: int, tag: str = "chain") -> list:
    return [make_refs(list(range(4)), salt=f"{tag}-{i}")[0] for i in range(n)]  # unrelated one-block chains


def _disk(store) -> tuple[int, int]:
    """(blocks on disk, evictions declined)."""
    stats = store.stats().tiers[Tier.DISK]
    return stats.blocks, stats.declined


def _open(tmp_path, dram_blocks: int):
    with open_store(tmp_path, disk=None) as probe:
        size = record_bytes(probe, _chains(1, "probe")[0])
    return open_store(tmp_path, dram=max(1, dram_blocks * size), disk=1 << 30, disk_writes=DiskWrites.REUSED)


def _warm_up(store) -> tuple[int, int]:
    """Evictions of blocks nobody asks for again, past the warm-up (in which every one is written)."""
    dump_all(store, _chains(MIN_EVICTIONS + 2, "warm-up"))
    store.flush()
    written, declined = _disk(store)
    assert written >= MIN_EVICTIONS, "the warm-up's evictions are all written"
    return written, declined


def test_a_block_evicted_unread_is_declined_then_written_when_evicted_again(tmp_path) -> None:
    refs = _chains(4)
    with _open(tmp_path, 2) as store:
        written, declined = _warm_up(store)
        dump_all(store, refs[:2])  # evicts the warm-up's last two (declined)
        dump_all(store, refs[2:])  # LRU evicts refs 0 and 1, never read
        store.flush()
        assert _disk(store) == (written, declined + 4), "first sight: ghosts only"
        assert store.lookup([refs[0].key]) == 0, "a declined block is gone"
        dump_all(store, refs[:2])  # computed and saved again: evicts refs 2 and 3 (first sight, declined)
        dump_all(store, refs[2:])  # ... which evicts refs 0 and 1 a second time: written now
        store.flush()
        assert _disk(store) == (written + 2, declined + 6)
        assert store.contains([r.key for r in refs[:2]]) == [True, True]
        ok, failed, dst = load_all(store, refs[:2])
        assert ok, failed
        assert_loaded(refs[:2], dst)


def test_a_block_read_in_dram_is_written_at_its_first_eviction(tmp_path) -> None:
    refs = _chains(4)
    with _open(tmp_path, 2) as store:
        written, declined = _warm_up(store)
        dump_all(store, refs[:2])
        assert load_all(store, refs[:1])[0], "a hit in DRAM"
        dump_all(store, refs[2:3])  # LRU evicts ref 1 (unread): declined
        dump_all(store, refs[3:])  # then ref 0, which was read: written
        store.flush()
        assert _disk(store) == (written + 1, declined + 3)
        assert store.contains([refs[0].key, refs[1].key]) == [True, False]
        ok, failed, dst = load_all(store, refs[:1])
        assert ok, failed
        assert_loaded(refs[:1], dst)


def test_a_block_dram_cannot_admit_is_declined_on_first_sight(tmp_path) -> None:
    refs = _chains(2)
    with _open(tmp_path, 0) as store:  # DRAM admits nothing
        written, declined = _warm_up(store)
        dump_all(store, refs)
        store.flush()
        assert _disk(store) == (written, declined + 2)
        dump_all(store, refs)  # the second time: written
        store.flush()
        assert _disk(store) == (written + 2, declined + 2)
        ok, failed, dst = load_all(store, refs)
        assert ok, failed
        assert_loaded(refs, dst)


def test_lookups_of_evicted_blocks_make_the_store_write_them_all(tmp_path) -> None:
    refs = _chains(2 * MIN_EVICTIONS + 2)
    with _open(tmp_path, 2) as store:
        written, declined = _warm_up(store)
        assert declined == 0
        for ref in refs[:MIN_EVICTIONS]:  # none asked for again: declined
            dump_all(store, [ref])
            store.lookup([ref.key])  # asked for right after it was saved: a DRAM hit, not a return
        store.flush()
        assert _disk(store) == (written, MIN_EVICTIONS)
        for ref in refs[: MIN_EVICTIONS // 2]:  # half of them asked for again (a miss: recomputed)
            assert store.lookup([ref.key]) == 0
        dump_all(store, refs[MIN_EVICTIONS : MIN_EVICTIONS + 2])  # evicts two never asked for: written all the same
        store.flush()
        assert _disk(store) == (written + 2, MIN_EVICTIONS)
        ok, failed, dst = load_all(store, refs[MIN_EVICTIONS - 2 : MIN_EVICTIONS])
        assert ok, failed
        assert_loaded(refs[MIN_EVICTIONS - 2 : MIN_EVICTIONS], dst)


def test_ghosts_are_kept_for_as_many_bytes_as_the_disk_holds() -> None:
    admission = ReuseAdmission(ghost_bytes=3 * 100, min_evictions=0)
    keys = [_key(i) for i in range(5)]
    assert [admission.evicted(k, 100, was_read=False) for k in keys] == [False] * 5
    assert len(admission) == 3, "the two oldest ghosts were dropped"
    assert admission.evicted(keys[0], 100, was_read=False) is False, "its ghost was dropped: first sight again"
    assert admission.evicted(keys[4], 100, was_read=False) is True, "evicted before"
    assert admission.evicted(_key(9), 100, was_read=True) is True, "read in DRAM"
    assert (admission.admitted, admission.declined) == (2, 6)


def test_it_writes_every_block_while_evicted_blocks_come_back_and_stops_when_they_do_not() -> None:
    admission = ReuseAdmission(ghost_bytes=1 << 30, write_all_returns=0.2, window=50, min_evictions=20)
    first = [_key(i) for i in range(20)]
    assert all(admission.evicted(key, 100, was_read=False) for key in first), "all written in the warm-up"
    assert not admission.writes_all, "nothing came back"
    admission.looked_up(first[:10])  # half of them asked for again
    admission.looked_up(first[:10])  # ... counted once each
    assert admission.returns == 10 and admission.writes_all, admission.return_rate
    assert admission.evicted(_key(100), 100, was_read=False) is True, "first sight, written"
    n = 101
    while admission.writes_all:  # new blocks only from here: the rate decays
        admission.evicted(_key(n), 100, was_read=False)
        n += 1
        assert n < 400, "the rate never fell"
    assert admission.return_rate < 0.2
    assert admission.evicted(_key(n), 100, was_read=False) is False


def test_admission_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="ghost_bytes"):
        ReuseAdmission(0)
    with pytest.raises(ValueError, match="write_all_returns"):
        ReuseAdmission(1, write_all_returns=0.0)


def _key(i: int) -> BlockKey:
    return i.to_bytes(16, "big")
