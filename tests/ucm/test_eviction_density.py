"""Eviction policies that learn: DENSITY (chains tail first, by learned hit density), its reuse model, Belady's
offline optimum (the benchmarks' bound) and Adaptive (follows whichever of LRU and DENSITY is winning)."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from tests.eviction_helpers import drain, everything, put
from ucm.eviction import AdaptivePolicy, DensityPolicy, LRUPolicy, PolicyName
from ucm.eviction.adaptive import EXPERTS
from ucm.eviction.belady import belady
from ucm.eviction.density import GHOSTS_PER_BLOCK
from ucm.eviction.reuse_model import ReuseModel


def insert_chains(policy, *chains: list[str]) -> None:
    """Insert each chain deepest first with its parents, as a tier does."""
    for chain in chains:
        for i in range(len(chain) - 1, -1, -1):
            policy.insert(chain[i], 1, chain[i - 1] if i else None)


def test_density_evicts_chains_tail_first_in_lru_order_before_it_has_data() -> None:
    density = DensityPolicy(5)
    insert_chains(density, ["a0", "a1", "a2"], ["b0", "b1"])  # ticks: a2 1, a1 2, a0 3, b1 4, b0 5
    assert drain(density) == ["a2", "a1", "a0", "b1", "b0"], "leaves only, oldest first; a parent waits for its child"
    insert_chains(density, ["a0", "a1", "a2"], ["b0", "b1"])
    density.touch("a0")  # a hit, the newest use of all; but a1 still depends on a0
    assert density.hits("a0") == 2, "coming back as a ghost counted as a use, then the hit"
    assert drain(density) == ["a2", "a1", "b1", "b0", "a0"]


def test_density_orphans_go_first_and_come_back_with_their_parent() -> None:
    density = DensityPolicy(10)
    density.insert("x", 1)
    insert_chains(density, ["a", "b", "c"])
    density.remove("b")  # e.g. found corrupt: c cannot be reached through this tier any more
    assert density.orphans() == ["c"]
    assert density.evict(everything) == "c", "the orphan goes before the older leaf x"
    density.insert("c", 1, "b")
    assert density.orphans() == [], "a block whose parent was never here is not an orphan"
    density.insert("b", 1, "a")  # the parent comes back: c is its child again
    assert drain(density) == ["x", "c", "b", "a"]
    insert_chains(density, ["a", "b", "c"])
    density.remove("a")
    density.touch("b")  # read again (its parent must be reachable some other way): an ordinary block again
    assert density.orphans() == [] and drain(density) == ["c", "b"]


def test_density_pinned_leaves_fall_back_to_inner_blocks() -> None:
    density = DensityPolicy(10)
    insert_chains(density, ["a", "b"])
    assert density.evict(lambda k: k != "b") == "a", "only the leaf is pinned: its parent has to go"
    assert density.orphans() == ["b"] and "b" in density
    assert density.evict(lambda k: False) is None
    assert drain(density) == ["b"]


def test_density_learns_to_keep_reused_blocks_through_a_scan() -> None:
    stream: list[tuple[str, int]] = []
    for round_ in range(60):  # 10 hot keys, then 40 never seen again: a reuse distance of 50 > 20 blocks
        stream += [("hot", i) for i in range(10)] + [("scan", 40 * round_ + i) for i in range(40)]
    assert replay_hits(LRUPolicy(20), stream, 20) == 0
    assert replay_hits(DensityPolicy(20), stream, 20) > 0.8 * 600, "most of the 600 hot accesses hit"


def test_density_metadata_stays_proportional_to_resident_blocks() -> None:
    rng = random.Random(11)
    capacity = 64
    density = DensityPolicy(capacity)
    chains: list[list[int]] = []
    fresh = itertools.count()
    worst_ghosts = 0
    for step in range(40_000):
        if step % 10_000 < 5_000 and chains and rng.random() < 0.5:  # random reuse of a prefix
            chain = rng.choice(chains)
            chain = chain[: rng.randrange(1, len(chain) + 1)]
        else:  # a new chain, never seen again half the time: a scan
            chain = [next(fresh) for _ in range(rng.randrange(1, 9))]
            chains = (chains + [chain])[-200:]
        for i in range(len(chain) - 1, -1, -1):
            key, parent = chain[i], chain[i - 1] if i else None
            if key in density:
                density.touch(key)
            else:
                density.insert(key, 1, parent)
        while density.used_bytes > capacity:
            density.evict(everything)
        worst_ghosts = max(worst_ghosts, density.ghosts())
        assert density.ghosts() <= GHOSTS_PER_BLOCK * capacity, f"step {step}: {density.ghosts()} ghosts"
        assert density.heap_entries() <= 2 * (2 * len(density) + 1024 + 1), f"step {step}: stale heap entries"
    assert worst_ghosts == GHOSTS_PER_BLOCK * capacity, "the scans fill the cap (the test reaches it)"


def test_reuse_model_censors_ghosts_over_the_cap() -> None:
    model = ReuseModel(num_classes=1, entries=4)
    for now in range(1, 11):
        model.start(now, 0, 0, now)
        model.left(now, now, max_ghosts=3)
    assert model.ghosts == 3 and len(model) == 3, "the first evicted go first"
    assert model.end(7, 11) is None and model.end(8, 11) == 0, "a dropped ghost comes back unknown"
    with pytest.raises(ValueError):
        model.left(9, 11, max_ghosts=-1)


def test_reuse_model_values_a_class_that_comes_back() -> None:
    model = ReuseModel(num_classes=2, entries=16)
    now = 0
    for i in range(2000):  # class 0: never used again; class 1: used again 8 accesses later
        now += 1
        model.start(("once", i), 0, 0, now)
        if i >= 8:
            assert model.end(("twice", i - 8), now) == 0
        now += 1
        model.start(("twice", i), 1, 0, now)
        model.advance(now)
    assert len(model) <= model.horizon + 16, "starts past the horizon are dropped"
    assert model.value(1, 4) > 10 * model.value(0, 4)
    assert model.value(1, 100) < model.value(1, 4), "past its reuse age a block is worth little"
    model.forget(("twice", 1999))
    assert model.end(("twice", 1999), now) is None


# --- Belady ---------------------------------------------------------------------------------------------


def brute_force_optimum(seq: list[int], capacity: int) -> int:
    """Most hits over every possible eviction/bypass choice (exponential: tiny inputs only)."""

    @functools.cache
    def best(pos: int, cache: frozenset) -> int:
        if pos == len(seq):
            return 0
        key = seq[pos]
        if key in cache:
            return 1 + best(pos + 1, cache)
        options = [best(pos + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(pos + 1, cache | {key}))
        else:
            options += [best(pos + 1, (cache - {old}) | {key}) for old in cache]
        return max(options)

    return best(0, frozenset())


def test_belady_hand_made() -> None:
    # a b c a b with room for 2: keep a and b, bypass c -> 2 hits (LRU would get 0).
    assert belady([["a"], ["b"], ["c"], ["a"], ["b"]], 2).block_hits == 2
    # Prefix chains: with room for 1 block, keep the root; block 2 is bypassed.
    result = belady([[1, 2], [1, 3], [1, 2]], 1)
    assert (result.accesses, result.block_hits, result.prefix_hits) == (6, 2, 2)
    assert belady([[1, 2, 3], [1, 2, 3]], 0).block_hits == 0


def test_belady_matches_brute_force() -> None:
    rng = random.Random(3)
    for _, capacity in itertools.product(range(30), (1, 2, 3)):
        seq = [rng.randrange(5) for _ in range(11)]
        assert belady([[k] for k in seq], capacity).block_hits == brute_force_optimum(seq, capacity), seq


# --- Adaptive -------------------------------------------------------------------------------------------


def replay_hits(policy, stream: list[int], capacity: int) -> int:
    hits = 0
    for key in stream:
        if key in policy:
            hits += 1
            policy.touch(key)
        else:
            put(policy, key, capacity)
    return hits


def test_adaptive_leaves_lru_on_a_loop_larger_than_the_cache() -> None:
    stream = list(range(120)) * 30  # LRU's worst case: every access misses
    assert replay_hits(LRUPolicy(100), stream, 100) == 0
    adaptive = AdaptivePolicy(100)
    hits = replay_hits(adaptive, stream, 100)
    assert adaptive.leader_name is not PolicyName.LRU
    assert hits > 0.3 * len(stream)


def test_adaptive_stays_with_lru_on_a_recency_stream() -> None:
    rng = random.Random(5)
    stream, recent = [], list(range(50))
    for i in range(5000):  # mostly re-reads of the 50 newest keys, a new key every 4th access
        if i % 4 == 0:
            recent = recent[1:] + [50 + i]
        stream.append(recent[-1 - min(49, int(rng.expovariate(0.1)))])
    adaptive = AdaptivePolicy(40)
    lru_hits = replay_hits(LRUPolicy(40), stream, 40)
    assert replay_hits(adaptive, stream, 40) >= 0.97 * lru_hits


def test_adaptive_density_copy_learns_from_the_leaders_evictions() -> None:
    adaptive = AdaptivePolicy(4)
    for key in range(6):
        put(adaptive, key, 4)
    assert adaptive.leader_name is PolicyName.LRU
    density = adaptive._real[EXPERTS.index(DensityPolicy)]
    assert isinstance(density, DensityPolicy) and 0 not in density
    assert density.ghosts() == 2, "LRU's victims stay ghosts in density's copy (a remove would forget them)"
    put(adaptive, 0, 4)
    assert density.hits(0) == 1, "back within the horizon: its use before the eviction counts"


def test_density_classes_never_hit_blocks_by_depth_and_lineage() -> None:
    density = DensityPolicy(10_000)
    root = [f"s{i}" for i in range(3)]
    first = [*root, *(f"a{i}" for i in range(10))]
    insert_chains(density, first)  # deepest first: each block waits for the one above it
    assert density.placement("a9")[0] is True, "the chain's root has no parent: the whole chain is anchored"
    assert [density.placement(k)[1] for k in first] == list(range(13))
    assert all(density.placement(k)[2] == 0 for k in first), "a new prompt continues nothing"
    assert density.placement("a9")[3] == 1 and density.placement("a0")[3] == 0, "depth 12 is past the first bucket"
    # A follow-up: the prompt's blocks are hit (once), then its new blocks stored below the deepest of them.
    for key in reversed(first):
        density.touch(key)
    follow = [f"b{i}" for i in range(3)]
    for i in range(len(follow) - 1, -1, -1):
        density.insert(follow[i], 1, follow[i - 1] if i else first[-1])
    assert [density.placement(k)[:3] for k in follow] == [(True, 13 + i, 1) for i in range(3)]
    hot = DensityPolicy(10_000)
    insert_chains(hot, root)
    for _ in range(3):
        for key in reversed(root):
            hot.touch(key)
    hot.insert("q0", 1, "s2")
    assert hot.placement("q0")[:3] == (True, 3, 0), "below a hot shared prompt: a new prompt, not a follow-up"


def test_density_chain_under_an_unknown_parent_settles_at_the_next_request() -> None:
    density = DensityPolicy(10_000)
    for i in range(4, -1, -1):  # a chain whose root's parent (the namespace root) is never stored
        density.insert(f"c{i}", 1, f"c{i - 1}" if i else "namespace-root")
    assert density.placement("c0")[0] is False, "the namespace root might still come"
    density.insert("other", 1, "namespace-root")  # the next request: c0's parent was not handed over
    assert [density.placement(f"c{i}")[:2] for i in range(5)] == [(True, i) for i in range(5)]


def test_density_anchors_each_block_of_a_long_chain_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = ReuseModel.reclass
    monkeypatch.setattr(ReuseModel, "reclass", lambda self, key, cls: (calls.append(key), real(self, key, cls)))
    density = DensityPolicy(100_000)
    chain = [f"k{i}" for i in range(3000)]
    insert_chains(density, chain)
    assert len(calls) == len(chain) - 1, "anchored in one pass when the root arrives, not once per arrival"
    assert density.placement(chain[-1])[1] == len(chain) - 1
