"""Prefix chains in the store: tiers hand a request's blocks to the policy deepest first (ucm.chain_order), so a
chain loses its tail before its root; a load counts as a use once (by its layer-0 call); a reopened disk tier
still knows the chains."""

from __future__ import annotations

import pytest

from tests.store_helpers import NUM_LAYERS, dump_all, load_all, make_refs, open_store, record_bytes
from ucm.api import Tier
from ucm.chain_order import deepest_first
from ucm.eviction import PolicyName


def keys(refs) -> list[bytes]:
    return [r.key for r in refs]


def block_size(tmp_path) -> int:
    with open_store(tmp_path / "probe", disk=None) as probe:
        return record_bytes(probe, make_refs(list(range(4)))[0])


def test_deepest_first_puts_children_before_parents() -> None:
    items = [("a", None), ("b", "a"), ("c", "b"), ("x", None), ("y", "x"), ("u", None)]
    order = deepest_first(items, lambda t: t[0], lambda t: t[1])
    assert [t[0] for t in order] == ["c", "b", "y", "a", "x", "u"], "each chain deepest first, ties in given order"
    shuffled = [items[i] for i in (4, 0, 2, 5, 1, 3)]
    assert [t[0] for t in deepest_first(shuffled, lambda t: t[0], lambda t: t[1])] == ["c", "y", "b", "a", "u", "x"]
    cycle = [("p", "q"), ("q", "p")]  # forged keys must not hang the tier
    assert sorted(t[0] for t in deepest_first(cycle, lambda t: t[0], lambda t: t[1])) == ["p", "q"]


@pytest.mark.parametrize("policy", [p for p in PolicyName if p is not PolicyName.TINYLFU])
def test_a_chain_too_long_for_dram_keeps_its_root(tmp_path, policy: PolicyName) -> None:
    # TinyLFU is left out: its frequency duel, not the order, decides who stays among blocks seen once.
    size = block_size(tmp_path)
    chain = make_refs(list(range(4 * 6)))
    with open_store(tmp_path, dram=4 * size, disk=None, policy=policy) as store:
        dump_all(store, chain)  # one commit of six blocks into room for four
        assert store.lookup(keys(chain)) == 4, "the tail was evicted, not the root (forward order would keep 0)"


@pytest.mark.parametrize("policy", [PolicyName.LRU, PolicyName.DENSITY, PolicyName.ADAPTIVE])
def test_a_request_s_root_survives_while_its_tail_is_evicted(tmp_path, policy: PolicyName) -> None:
    size = block_size(tmp_path)
    x = make_refs(list(range(4 * 4)), salt="x")
    y = make_refs(list(range(4 * 3)), salt="y")
    others = [make_refs(list(range(4)), salt=f"other-{i}")[0] for i in range(4)]
    with open_store(tmp_path, dram=6 * size, disk=None, policy=policy) as store:
        dump_all(store, x[:3])
        dump_all(store, y)  # full
        assert store.lookup(keys(x)) == 3 and load_all(store, x[:3])[0]  # a request hits x's prefix...
        dump_all(store, x[3:])  # ...and commits its new tail: one block of y has to go
        assert store.lookup(keys(y)) == 2, "y lost its tail, not its root"
        assert store.lookup(keys(x)) == 4
        for other in others:  # four more blocks: y goes, then x's new tail; x's prefix was used with it
            dump_all(store, [other])
        assert store.lookup(keys(y)) == 0
        assert store.lookup(keys(x)) == 2, "x lost its tail first, although its prefix was touched before it"


def test_only_a_load_of_layer_0_is_a_use(tmp_path) -> None:
    # The connector loads one layer per call: a request's loads of layers 1.. must not count as more uses.
    size = block_size(tmp_path)
    a, b, c, d = (make_refs(list(range(4)), salt=s)[0] for s in "abcd")
    with open_store(tmp_path, dram=3 * size, disk=None, policy=PolicyName.LRU) as store:
        for ref in (a, b, c):
            dump_all(store, [ref])
        assert load_all(store, [a], layers=[1, 2])[0]  # served, but a stays the least recently used
        dump_all(store, [d])
        assert store.contains(keys([a, b])) == [False, True]
        assert load_all(store, [b], layers=[0])[0]  # a use: c goes next, not b
        dump_all(store, [a])
        assert store.contains(keys([b, c])) == [True, False]
        assert store.stats().tiers[Tier.DRAM].hits == 2


def test_reopened_disk_tier_knows_the_chains(tmp_path) -> None:
    size = block_size(tmp_path)
    chain = make_refs(list(range(4 * 6)))
    with open_store(tmp_path, disk=8 * size) as store:
        dump_all(store, chain)  # one commit: the same second for all six
        store.flush()
    with open_store(tmp_path, disk=3 * size, disk_policy=PolicyName.LRU) as store:
        assert store.stats().tiers[Tier.DISK].blocks == 3
        assert store.lookup(keys(chain)) == 3, "reopened with less room: the tail went, the root stayed"
        ok, failed, _ = load_all(store, chain[:3], layers=list(range(NUM_LAYERS)))
        assert ok, failed
