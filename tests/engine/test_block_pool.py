"""Block pool and KV-cache manager without a model: exact block ids, eviction order, CoW, integrity."""

from __future__ import annotations

import itertools

import pytest

from common.keys import KeyNamespace, block_keys, root_key
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4
ROOT = root_key(KeyNamespace("test-model", "float32", BS))
_arrival = itertools.count()


def make_request(rid: str, tokens: list[int], salt: str | None = None, n: int = 1) -> Request:
    root = root_key(KeyNamespace("test-model", "float32", BS), salt)
    return Request(rid, tokens, SamplingParams(n=n), root_key=root, block_size=BS, arrival=next(_arrival), seed=0)


@pytest.fixture
def manager():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    yield m
    m.check_integrity()


def admit(m: KVCacheManager, req: Request) -> list[int]:
    """What the scheduler does for a waiting request: match the prefix, allocate the rest, mark computed."""
    prefix = m.get_computed_blocks(req)
    req.num_computed_tokens = 0
    ids = m.allocate_slots(req, req.num_tokens - prefix.num_tokens, prefix)
    assert ids is not None
    req.num_computed_tokens = req.num_tokens
    m.cache_full_blocks(req)
    return ids


def test_request_block_keys_match_ucm_keys():
    req = make_request("a", list(range(10)))
    assert req.block_keys == block_keys(ROOT, list(range(10)), BS)
    req.append_output_token(10)
    req.append_output_token(11)
    assert req.block_keys == block_keys(ROOT, list(range(12)), BS)
    assert len(req.block_keys) == 3


def test_prefill_allocates_exact_ids_and_prefix_hit(manager):
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(manager, a) == [0, 1, 2]
    b = make_request("b", list(range(8)) + [100, 101, 102])  # shares 2 full blocks
    prefix = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in prefix.blocks] == [0, 1] and prefix.num_tokens == 8
    b.num_computed_tokens = 0
    assert manager.allocate_slots(b, 3, prefix) == [0, 1, 3]
    assert manager.pool.blocks[0].ref_cnt == 2 and manager.pool.blocks[2].ref_cnt == 1
    manager.free(a)
    manager.free(b)


def test_full_hit_computes_only_the_last_token_into_a_copy(manager):
    a = make_request("a", list(range(8)))
    assert admit(manager, a) == [0, 1]
    manager.free(a)
    b = make_request("b", list(range(8)))
    prefix = manager.get_computed_blocks(b)
    # Both blocks hit; the last token is left to compute (its logits give the next token).
    assert [blk.block_id for blk in prefix.blocks] == [0, 1] and prefix.num_tokens == 7
    b.num_computed_tokens = 0
    # Its KV slot is written into a copy of block 1: the cached block itself is never written.
    assert manager.allocate_slots(b, 1, prefix) == [0, 2]
    assert manager.take_pending_copies() == [(1, 2)]
    assert manager.pool.blocks[1].ref_cnt == 0 and manager.pool.blocks[1].key == b.block_keys[1]
    b.num_computed_tokens = 8
    manager.cache_full_blocks(b)
    assert manager.pool.blocks[2].key is None  # the copy is not cached a second time
    manager.free(b)
    assert manager.get_computed_blocks(make_request("c", list(range(8)))).blocks == prefix.blocks


def test_hit_of_all_full_blocks_before_a_partial_one_copies_nothing(manager):
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(9)))
    prefix = manager.get_computed_blocks(b)
    assert prefix.num_tokens == 8
    b.num_computed_tokens = 0
    assert manager.allocate_slots(b, 1, prefix) == [0, 1, 3] and manager.take_pending_copies() == []
    manager.free(b)


def test_salt_isolates(manager):
    a = make_request("a", list(range(8)) + [1], salt="tenant-1")
    admit(manager, a)
    b = make_request("b", list(range(8)) + [1], salt="tenant-2")
    assert manager.get_computed_blocks(b).num_tokens == 0
    manager.free(a)


def test_lazy_eviction_lru_order(manager):
    # a: blocks 0,1,2 (2 full); freed tail first → free queue ... 2,1,0 after the never-used 3..9
    a = make_request("a", list(range(10)))
    admit(manager, a)
    manager.free(a)
    assert list(manager.pool._free)[-3:] == [2, 1, 0]
    assert manager.pool.stats().num_cached == 2
    # Allocating 7 fresh blocks takes 3..9 (never used) first: cached blocks survive.
    c = make_request("c", [50 + i for i in range(26)])
    assert admit(manager, c) == [3, 4, 5, 6, 7, 8, 9]
    assert manager.pool.stats().num_cached == 2 + 6
    # The next allocation evicts block 2 (partial, uncached), then block 1 (a's tail first).
    d = make_request("d", [200, 201, 202, 203, 204])
    assert admit(manager, d) == [2, 1]
    assert manager.get_computed_blocks(make_request("e", list(range(10)))).num_tokens == 4  # block 0 still hits
    manager.free(c)
    manager.free(d)


def test_hit_revives_free_cached_block(manager):
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    free_before = manager.pool.num_free_blocks
    b = make_request("b", list(range(9)))
    assert admit(manager, b) == [0, 1, 3]  # 0,1 revived from the free queue; block 2 was the partial one
    assert manager.pool.num_free_blocks == free_before - 3
    manager.free(b)


def test_collision_safe_lookup():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    key = b"k" * 16
    assert pool.cache_block(blk, key, ROOT, (1, 2, 3, 4))
    assert pool.lookup(key, ROOT, (1, 2, 3, 4)) is blk
    assert pool.lookup(key, ROOT, (9, 2, 3, 4)) is None  # same key, other tokens: a collision, not a hit
    assert pool.lookup(key, b"p" * 16, (1, 2, 3, 4)) is None
    pool.free_blocks([blk])
    pool.check_integrity()


def test_allocation_failure_changes_nothing(manager):
    a = make_request("a", list(range(36)))  # 9 blocks
    admit(manager, a)
    b = make_request("b", list(range(100, 108)))
    before = manager.pool.stats()
    assert manager.allocate_slots(b, 8) is None
    assert manager.pool.stats() == before
    manager.free(a)


def test_copy_on_write_fork(manager):
    parent = make_request("p", list(range(6)), n=2)  # 1 full block + 2 tokens
    admit(manager, parent)
    child = parent.fork(1)
    manager.fork(parent, child)
    assert manager.block_ids("p") == manager.block_ids(child.request_id) == [0, 1]
    assert manager.pool.blocks[1].ref_cnt == 2
    for seq, tok in ((parent, 7), (child, 8)):
        seq.append_output_token(tok)
    # The parent writes first into the shared partial block 1: it gets a copy (block 2).
    assert manager.allocate_slots(parent, 1) == [0, 2]
    assert manager.take_pending_copies() == [(1, 2)]
    # The child is now the only owner of block 1: it writes in place, no copy.
    assert manager.allocate_slots(child, 1) == [0, 1]
    assert manager.take_pending_copies() == []
    assert manager.pool.blocks[0].ref_cnt == 2
    manager.free(parent)
    manager.free(child)


def test_uncache_drops_keys(manager):
    a = make_request("a", list(range(12)))
    admit(manager, a)
    manager.uncache_from(a, 1)
    b = make_request("b", list(range(12)) + [5])
    assert manager.get_computed_blocks(b).num_tokens == 4
    manager.free(a)


def test_integrity_detects_leak(manager):
    a = make_request("a", list(range(5)))
    admit(manager, a)
    manager.req_blocks.pop("a")  # simulate a leak: the pool still counts the references
    with pytest.raises(AssertionError):
        manager.check_integrity()
    manager.pool.free_blocks([manager.pool.blocks[1], manager.pool.blocks[0]])


def test_evictions_are_recorded_only_when_asked_and_only_for_reused_cached_blocks():
    keys = block_keys(ROOT, list(range(8)), BS)
    for record in (False, True):
        pool = BlockPool(3, record_evictions=record)
        a, b, c = pool.get_new_blocks(3)
        assert pool.cache_block(a, keys[0], ROOT, (0, 1, 2, 3))
        assert pool.cache_block(b, keys[1], keys[0], (4, 5, 6, 7))
        pool.free_blocks([c, b, a])  # eviction order: c (uncached), then b, then a
        pool.uncache(a)  # garbage, not an eviction: nothing to save
        assert pool.take_evicted() == []
        got = pool.get_new_blocks(3)
        assert [blk.block_id for blk in got] == [c.block_id, b.block_id, a.block_id]
        evicted = pool.take_evicted()
        if not record:
            assert evicted == []
            continue
        assert [(e.block_id, e.key, e.parent_key, e.token_ids) for e in evicted] == [
            (b.block_id, keys[1], keys[0], (4, 5, 6, 7))
        ]
        assert pool.take_evicted() == [], "taken once"
