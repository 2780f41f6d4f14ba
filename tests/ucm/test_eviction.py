"""Eviction policies: exact victim order on tiny capacities (expectations worked out by hand), pins, edge cases."""

from __future__ import annotations

import random

import pytest

from tests.eviction_helpers import drain, everything, put
from ucm.eviction import (
    ARCPolicy,
    GDSFPolicy,
    LRFUPolicy,
    LRUPolicy,
    PolicyName,
    S3FIFOPolicy,
    TinyLFUPolicy,
    make_policy,
)
from ucm.eviction.scored_heap import ScoredHeap

# --- common contract ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PolicyName))
def test_make_policy_and_edge_cases(name: PolicyName) -> None:
    policy = make_policy(name, 100)
    assert policy.name is name
    assert policy.evict(everything) is None, "evict() on an empty policy returns None"
    policy.remove("never-inserted")  # harmless
    policy.touch("never-inserted")  # harmless
    policy.insert("a", 10)
    policy.remove("a")
    assert "a" not in policy and policy.used_bytes == 0 and policy.evict(everything) is None
    with pytest.raises(ValueError):
        make_policy(name, 0)
    with pytest.raises(ValueError):
        policy.insert("b", -1)


def test_make_policy_rejects_strings() -> None:
    with pytest.raises(ValueError, match="PolicyName"):
        make_policy("lru", 10)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(PolicyName))
def test_pinned_keys_are_skipped_and_stay_tracked(name: PolicyName) -> None:
    policy = make_policy(name, 3)
    for key in "abc":
        policy.insert(key, 1)
    policy.touch("b")
    first = policy.evict(everything)
    policy.insert(first, 1)  # put it back: we only wanted to know who goes first
    pinned = policy.evict(everything)
    policy.insert(pinned, 1)
    others = drain(policy, lambda k: k != pinned)
    assert pinned not in others and len(others) == 2
    assert pinned in policy and len(policy) == 1 and policy.used_bytes == 1
    assert policy.evict(lambda k: False) is None and pinned in policy
    assert drain(policy) == [pinned]


@pytest.mark.parametrize("name", list(PolicyName))
def test_byte_sizes_are_accounted(name: PolicyName) -> None:
    policy = make_policy(name, 100)
    for i, size in enumerate((10, 20, 30)):
        policy.insert(i, size)
    assert policy.used_bytes == 60
    victim = policy.evict(everything)
    assert policy.used_bytes == 60 - (10, 20, 30)[victim]
    policy.remove(2 if victim != 2 else 1)
    assert len(policy) == 1


@pytest.mark.parametrize("name", list(PolicyName))
def test_deterministic(name: PolicyName) -> None:
    def run() -> list:
        rng = random.Random(7)
        policy = make_policy(name, 40)
        victims = []
        for _ in range(400):
            key = rng.randrange(80).to_bytes(16, "little")
            if key in policy:
                policy.touch(key)
            else:
                victims += put(policy, key, 40)
        return victims

    assert run() == run()


# --- LRU ------------------------------------------------------------------------------------------------


def test_lru_order() -> None:
    lru = LRUPolicy(3)
    for key in "abc":
        lru.insert(key, 1)
    lru.touch("a")
    assert lru.keys() == ["b", "c", "a"]
    assert put(lru, "d", 3) == ["b"]
    lru.insert("c", 1)  # a rewrite counts as a use
    assert drain(lru) == ["a", "d", "c"]


def test_lru_keeps_a_chain_s_shallower_blocks_more_recent() -> None:
    lru = LRUPolicy(10)
    for key, parent in (("a2", "a1"), ("a1", "a0"), ("a0", None), ("b0", None)):  # deepest first, as tiers do
        lru.insert(key, 1, parent)
    assert lru.keys() == ["a2", "a1", "a0", "b0"]
    for key in ("a1", "a0"):  # a request hits a's prefix (touched deepest first)...
        lru.touch(key)
    lru.insert("a1x", 1, "a1")  # ...and commits a new block after it: the prefix it used ends more recent
    assert lru.keys() == ["a2", "b0", "a1x", "a1", "a0"]
    lru.remove("a1")
    lru.insert("c", 1, "a1")  # an absent parent: nothing to refresh
    assert lru.keys() == ["a2", "b0", "a1x", "a0", "c"]


def test_lru_pinned_key_keeps_its_place() -> None:
    lru = LRUPolicy(10)
    for key in "abc":
        lru.insert(key, 1)
    assert lru.evict(lambda k: k != "a") == "b"
    assert lru.keys() == ["a", "c"], "the pinned key is next in line once unpinned"


# --- S3-FIFO --------------------------------------------------------------------------------------------


def test_s3fifo_one_hit_wonder_goes_first_and_reaccessed_key_is_promoted() -> None:
    s3 = S3FIFOPolicy(10)  # small queue target: 1 byte; ghost: 9 bytes
    for key in "abc":
        s3.insert(key, 1)
    s3.touch("b")
    assert s3.evict(everything) == "a", "a was never read again: out of the small queue first"
    assert s3.queues() == (["b", "c"], [], ["a"])
    assert s3.evict(everything) == "c", "b was read again, so it moved to main and c went instead"
    assert s3.queues() == ([], ["b"], ["a", "c"])
    s3.insert("a", 1)  # a ghost hit goes straight to main
    assert s3.queues() == ([], ["b", "a"], ["c"])
    s3.touch("b")
    assert s3.evict(everything) == "a", "b's frequency bit buys it one more trip round main"
    assert s3.queues() == ([], ["b"], ["c"])


def test_s3fifo_ghost_is_bounded() -> None:
    s3 = S3FIFOPolicy(10)
    for i in range(50):
        put(s3, i, 10)
    assert s3.ghost_bytes <= s3.ghost_capacity == 9


# --- ARC ------------------------------------------------------------------------------------------------


def test_arc_adapts_p_on_ghost_hits() -> None:
    arc = ARCPolicy(4)
    for key in "ab":
        arc.insert(key, 1)
        arc.touch(key)  # a, b seen twice: T2
    for key in "cd":
        arc.insert(key, 1)
    assert put(arc, "e", 4) == ["c"], "T1 is over its target p=0: its LRU goes, into ghost B1"
    assert arc.lists() == {"t1": ["d", "e"], "t2": ["a", "b"], "b1": ["c"], "b2": []}
    assert put(arc, "c", 4) == ["d"], "the B1 hit raised p to 1 block, T1 (2) is still over it"
    assert arc.p == 1.0
    assert arc.lists() == {"t1": ["e"], "t2": ["a", "b", "c"], "b1": ["d"], "b2": []}
    assert arc.evict(everything) == "a", "T1 is at p now, so T2's LRU goes, into ghost B2"
    assert arc.lists()["b2"] == ["a"]
    arc.insert("a", 1)  # a B2 hit lowers p again
    assert arc.p == 0.0
    assert arc.evict(everything) == "e"


def test_arc_does_not_evict_the_block_just_inserted() -> None:
    arc = ARCPolicy(2)
    arc.insert("a", 1)
    arc.touch("a")
    arc.insert("b", 1)
    arc.insert("c", 1)  # T1 = [b, c] is over p = 0, but c is the newcomer
    assert arc.evict(everything) == "b"


# --- TinyLFU --------------------------------------------------------------------------------------------


def test_tinylfu_admission_rejects_a_cold_newcomer_against_a_hot_victim() -> None:
    lfu = TinyLFUPolicy(20, window_fraction=0.0, adaptive=False)  # pure admission filter
    for i in range(20):
        assert put(lfu, i, 20) == []
    for i in range(20):
        for _ in range(5):
            lfu.touch(i)
    probation, protected = lfu.segments()[1:]
    victim = probation[0]
    assert len(protected) == 16 and lfu.frequency(victim) == 6  # doorkeeper + 5 counted touches
    for attempt in range(1, 7):
        assert not lfu.admit("new", 1), f"attempt {attempt}: 'new' is still colder than block {victim}"
    assert lfu.frequency("new") == 6
    assert lfu.admit("new", 1), "seen more often than the victim now: admitted"
    lfu.insert("new", 1)
    assert lfu.evict(everything) == victim


def test_w_tinylfu_window_candidate_duels_main_victim() -> None:
    lfu = TinyLFUPolicy(10, window_fraction=0.1, adaptive=False)  # window 1 block, main 9
    for i in range(10):
        put(lfu, f"k{i}", 10)
    for i in range(9):
        lfu.touch(f"k{i}")
        lfu.touch(f"k{i}")
    # Window overflow: k9, k0..k7 fill main; k8 arrives when main is full and duels main's LRU, k9.
    assert put(lfu, "cold", 10) == ["k9"], "hot candidate k8 beats the once-seen victim k9"
    assert put(lfu, "cold2", 10) == ["cold"], "a once-seen candidate loses against hot k0"
    window, probation, protected = lfu.segments()
    assert window == ["cold2"] and "k8" in probation and not protected


def test_w_tinylfu_window_adapts() -> None:
    lfu = TinyLFUPolicy(64)
    start = lfu.window_target
    for i in range(2000):  # a pure scan: nothing ever hits, the climber keeps moving
        put(lfu, i, 64)
    assert lfu.window_target != start


# --- DENSITY --------------------------------------------------------------------------------------------


def test_gdsf_keeps_the_frequent_block_and_ages_by_its_clock() -> None:
    policy = make_policy(PolicyName.GDSF, 3 * 10)
    for key in ("a", "b", "c"):
        policy.insert(key, 10)
    for _ in range(3):
        policy.touch("a")
    policy.touch("b")
    policy.touch("b")
    assert policy.evict(lambda k: True) == "c", "the least used block goes first"
    assert isinstance(policy, GDSFPolicy)
    clock = policy.clock
    assert clock > 0, "the clock rises to the evicted priority"
    policy.insert("d", 10)  # a newcomer starts at the clock: above what left, below what is still used
    assert policy.evict(lambda k: True) == "d"
    # Without further use, newcomers overtake "a" once the clock passes its priority: aging.
    for i in range(12):
        policy.insert(f"n{i}", 10)
        policy.touch(f"n{i}")
        victim = policy.evict(lambda k: True)
        if victim == "a":
            break
    else:
        raise AssertionError("a block no longer used was never aged out")


def test_lrfu_forgets_with_its_half_life() -> None:
    policy = make_policy(PolicyName.LRFU, 10)  # half-life: 10 accesses (capacity in blocks)
    assert isinstance(policy, LRFUPolicy)
    policy.insert("old", 1)
    for _ in range(5):
        policy.touch("old")  # 6 uses, long ago
    for i in range(40):
        policy.insert(f"x{i}", 1)
        policy.remove(f"x{i}")
    policy.insert("new", 1)
    policy.touch("new")  # 2 uses, now: 6 uses decayed by 2^-4 count less
    assert policy.evict(lambda k: True) == "old"
    policy = make_policy(PolicyName.LRFU, 1000)  # half-life 1000: the same history keeps the frequent block
    policy.insert("old", 1)
    for _ in range(5):
        policy.touch("old")
    for i in range(40):
        policy.insert(f"x{i}", 1)
        policy.remove(f"x{i}")
    policy.insert("new", 1)
    policy.touch("new")
    assert policy.evict(lambda k: True) == "new"


def test_scored_heap_skips_pinned_and_stale_entries() -> None:
    heap = ScoredHeap()
    heap.set("a", 1.0)
    heap.set("b", 2.0)
    heap.set("a", 3.0)  # the old entry of "a" is stale
    assert heap.pop_min(lambda k: k != "b") == ("a", 3.0), "b is pinned, a's stale 1.0 is skipped"
    assert heap.pop_min(lambda k: True) == ("b", 2.0), "the pinned key kept its place"
    assert heap.pop_min(lambda k: True) is None and len(heap) == 0
    for i in range(5000):  # rescoring one key many times compacts instead of growing without bound
        heap.set("k", float(i))
    assert len(heap._heap) <= 2 * len(heap) + 1024 + 1
