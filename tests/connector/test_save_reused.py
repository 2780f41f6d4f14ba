"""KVSavePolicy.REUSED at the scheduler side of the connector (real Store, real Request / SchedulerOutput): past a
warm-up of evictions, a block the device cache evicts is saved only if a prefix hit took it on the device, or it was
evicted once before; once lookups ask for declined blocks again, every evicted block is saved. The write-back path
after this choice is KVSavePolicy.EVICTED's (tests/connector/test_write_back.py, on the real model)."""

from __future__ import annotations

import itertools

from common.keys import KeyNamespace, root_key
from common.save_policy import KVSavePolicy
from connector.base import KVConnectorRole
from connector.metadata import ConnectorStats
from connector.ucm_scheduler import UCMSchedulerConnector
from engine.block_pool import BlockPool, EvictedBlock
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from ucm.reuse_admission import MIN_EVICTIONS
from ucm.store import Store
from ucm.store_config import StoreConfig

BS = 4
ROOT = root_key(KeyNamespace("save-reused-test", "float32", BS))


_REQUESTS = itertools.count(1)


def _request(rid: str, n_blocks: int) -> Request:
    """A request with tokens of its own (so blocks of no other request)."""
    first = next(_REQUESTS) * 100_000
    tokens = [first + i for i in range(n_blocks * BS + 1)]
    return Request(rid, tokens, SamplingParams(max_tokens=4), root_key=ROOT, block_size=BS, arrival=0, seed=0)


def _evicted(req: Request, reused: bool = False) -> list[EvictedBlock]:
    keys, parents = req.block_keys, [ROOT, *req.block_keys]
    tokens = req.prompt_token_ids
    return [
        EvictedBlock(i, key, parents[i], tuple(tokens[i * BS : (i + 1) * BS]), reused) for i, key in enumerate(keys)
    ]


def _saved(sched: UCMSchedulerConnector, evicted: list[EvictedBlock]) -> list[bytes]:
    meta = sched.build_connector_meta(SchedulerOutput(evicted_blocks=evicted))
    return [ref.key for spec in meta.evicted_saves for ref in spec.blocks]


def test_reused_saves_what_comes_back() -> None:
    stats = ConnectorStats()
    with Store(StoreConfig(dram_bytes=64 << 20)) as store:
        sched = UCMSchedulerConnector(store, KVConnectorRole.BOTH, BS, stats, save_policy=KVSavePolicy.REUSED)
        warm = _evicted(_request("warm-up", MIN_EVICTIONS))
        assert len(_saved(sched, warm)) == MIN_EVICTIONS, "every block is saved in the warm-up"
        fresh = [_request(f"new-{i}", 8) for i in range(4)]
        assert _saved(sched, _evicted(fresh[0])) == [], "past it, a block nobody took is not saved"
        assert stats.blocks_save_declined == 8
        taken = _evicted(fresh[1], reused=True)
        assert _saved(sched, taken) == [b.key for b in taken], "a block a prefix hit took is saved"
        assert _saved(sched, _evicted(fresh[0])) == fresh[0].block_keys, "evicted a second time: saved"
        assert _saved(sched, _evicted(fresh[2])) == []
        # Requests ask for their declined blocks again (a store miss each): past 1 in 10, every evicted block is saved.
        declined, rounds = stats.blocks_save_declined, 0
        while True:
            back = _request(f"back-{rounds}", 8)
            rounds += 1
            saved = _saved(sched, _evicted(back))
            sched.get_num_new_matched_tokens(back, 0)
            if saved:
                break
            assert rounds < MIN_EVICTIONS // 8, "returns never made it save everything"
        assert rounds > 2, "a few returns are not enough"
        assert stats.blocks_save_declined == declined + 8 * (rounds - 1) + 8 - len(saved)
        assert _saved(sched, _evicted(fresh[3])) == fresh[3].block_keys


def test_a_prefix_hit_marks_the_evicted_block_reused() -> None:
    pool = BlockPool(4, record_evictions=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a" * 16, ROOT, (1, 2, 3, 4))
    pool.cache_block(b, b"b" * 16, ROOT, (5, 6, 7, 8))
    pool.free_blocks([a, b])
    pool.touch([a])  # a prefix hit
    pool.free_blocks([a])
    pool.get_new_blocks(4)  # evicts both
    assert {e.key: e.reused for e in pool.take_evicted()} == {b"a" * 16: True, b"b" * 16: False}
