"""The worker connector's per-request, per-tier count of loaded blocks (`take_loaded_by_tier`): what the node
reports as store_dram_tokens / store_disk_tokens. Only the loaded prefix of a request counts."""

from __future__ import annotations

from connector.base import KVConnectorRole
from engine.scheduler_output import ScheduledRequest
from tests.connector.test_connector_unit import make_pair, make_request, produce, run_step
from tests.store_helpers import open_store
from ucm.api import Tier
from ucm.task import Task

TOKENS = list(range(6000, 6021))  # 5 full blocks + 1 token
IDS = [50, 51, 52, 53, 54, 55]


def _consume(store, rid: str):
    sched, worker, caches, stats = make_pair(store, KVConnectorRole.CONSUMER)
    req = make_request(rid, TOKENS)
    assert sched.get_num_new_matched_tokens(req, 0) == (20, False)
    sched.update_state_after_alloc(req, IDS, 20)
    errors = run_step(sched, worker, caches, [ScheduledRequest(req, IDS, 20, 1, 20)])
    return errors, worker.take_loaded_by_tier(), stats


def test_dram_then_disk_after_the_store_reopens(tmp_path):
    with open_store(tmp_path, dram=64 << 20) as store:
        produce(store, TOKENS)
        store.flush()
        errors, tiers, stats = _consume(store, "a")
        assert errors == set() and tiers == {"a": {Tier.DRAM: 5, Tier.DISK: 0}}
        assert stats.blocks_loaded == 5 and stats.blocks_loaded_disk == 0
    with open_store(tmp_path, dram=64 << 20) as store:  # the blocks are only on disk now
        errors, tiers, stats = _consume(store, "b")
        assert errors == set() and tiers == {"b": {Tier.DRAM: 0, Tier.DISK: 5}}
        assert stats.blocks_loaded_disk == 5
        assert _consume(store, "c")[1] == {"c": {Tier.DRAM: 5, Tier.DISK: 0}}  # promoted by b's load


def test_partial_and_failed_loads_count_only_what_loaded(tmp_path, monkeypatch):
    with open_store(tmp_path, dram=64 << 20) as store:
        produce(store, TOKENS)
        real_load = store.load

        def block_2_fails(blocks, layers, dst):  # a store that says every block came off disk, block 2 failed
            real_load(blocks, layers, dst).wait()
            return Task.completed(len(blocks), [2] if layers == [1] else [], from_disk=range(len(blocks)))

        monkeypatch.setattr(store, "load", block_2_fails)
        errors, tiers, stats = _consume(store, "p")
        assert errors == {52, 53, 54}
        assert tiers == {"p": {Tier.DRAM: 0, Tier.DISK: 2}}  # the prefix before the failed block only
        assert stats.blocks_loaded == stats.blocks_loaded_disk == 2

        monkeypatch.setattr(store, "load", lambda blocks, layers, dst: Task.all_failed(len(blocks), "injected"))
        errors, tiers, stats = _consume(store, "f")
        assert errors == set(IDS[:5]) and tiers == {} and stats.blocks_loaded == 0
