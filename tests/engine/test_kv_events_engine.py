"""The device prefix cache's KV events (engine/kv_event_log.py): exact events from the block pool without a model,
then a real engine (the embedded SmolLM2) whose events go out on a real publisher into the router's index."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from common.keys import KeyNamespace, root_key
from common.kv_events.config import KVEventsConfig
from common.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from common.kv_events.publisher import ZmqEventPublisher
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from protocol.messages import KVEventsEndpoint
from router.kv_index import KVIndex
from tests.engine_helpers import single_thread

BS = 4
ROOT = root_key(KeyNamespace("test-model", "float32", BS))
_arrival = itertools.count()


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), root_key=ROOT, block_size=BS, arrival=next(_arrival), seed=0)


def _admit(m: KVCacheManager, req: Request) -> None:
    prefix = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - prefix.num_tokens, prefix) is not None
    req.num_computed_tokens = req.num_tokens
    m.cache_full_blocks(req)


def _stored(keys, parent, tokens) -> BlockStored:
    return BlockStored(list(keys), parent, list(tokens), BS, None, MEDIUM_GPU, None)


def test_block_pool_events_are_vllms() -> None:
    m = KVCacheManager(num_blocks=8, block_size=BS, record_events=True)
    a = _request("a", list(range(10)))  # 2 full blocks + 2 tokens
    _admit(m, a)
    k = a.block_keys
    assert m.take_events() == [_stored(k[:2], None, range(8))]  # one event per chain, no parent for block 0
    assert m.take_events() == []
    a.append_output_token(10)  # decoding fills block 2: its event names block 1 as the parent
    a.append_output_token(11)
    m.allocate_slots(a, 0)
    a.num_computed_tokens = a.num_tokens
    m.cache_full_blocks(a)
    assert m.take_events() == [_stored([a.block_keys[2]], k[1], range(8, 12))]
    b = _request("b", list(range(8)) + [50] * 4)  # hits a's 2 blocks, adds one of its own
    _admit(m, b)
    assert m.take_events() == [_stored([b.block_keys[2]], k[1], [50] * 4)]
    m.uncache_from(b, 2)  # its KV failed to load: the key leaves the cache
    assert m.take_events() == [BlockRemoved([b.block_keys[2]], MEDIUM_GPU)]
    m.free(a)
    m.free(b)
    c = _request("c", [90] * 28)  # 7 blocks: the 4 never used, then the least recently freed (b's uncached one too)
    _admit(m, c)
    events = m.take_events()
    assert events[0] == BlockRemoved([a.block_keys[2], k[1]], MEDIUM_GPU)  # a's tail first, one event
    assert isinstance(events[1], BlockStored) and events[1].block_hashes == c.block_keys
    m.pool.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]  # no BlockRemoved for each: the reset says it all
    m.check_integrity()


def test_no_events_unless_asked() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    _admit(m, _request("a", list(range(8))))
    m.pool.reset_prefix_cache()
    assert m.take_events() == []


def _until(what: str, condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def engine(smollm2_fp32):
    with single_thread():
        per_block = smollm2_fp32.config.kv_bytes_per_block(16, torch.float32)
        config = EngineConfig(
            dtype="float32",
            cache=CacheConfig(16, 9 * per_block),  # 9 blocks: a second prompt evicts the first one's
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
            enable_kv_cache_events=True,
            adaptive_threads=False,
        )
        yield EngineCore(config, loaded_model=smollm2_fp32)


def test_a_real_engine_feeds_the_router_index(engine, tmp_path) -> None:
    pub = ZmqEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay"
        )
    )
    index = KVIndex()
    published = []

    def run(rid: str, prompt: list[int]) -> list[bytes]:
        keys = engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
            events = engine.take_kv_events()  # what the node does after each step
            if events:
                published.append(events)
                pub.publish(events)
        return keys

    try:
        index.track("node-0", "i0", KVEventsEndpoint(pub.endpoint, pub.replay_endpoint))
        prompt_a = [1000 + i for i in range(40)]  # 2 full blocks (+ 8 tokens, + 2 generated)
        keys_a = run("a", prompt_a)
        assert published == [[BlockStored(keys_a, None, prompt_a[:32], 16, None, MEDIUM_GPU, None)]]
        _until("the index learns a's blocks", lambda: index.holders(keys_a) == {"node-0": 2})
        prompt_b = [5000 + i for i in range(120)]  # 8 blocks of 9: the 6 never used, a's tail, a's block 1
        keys_b = run("b", prompt_b)
        assert published[1:] == [
            [
                BlockRemoved([keys_a[1]], MEDIUM_GPU),
                BlockStored(keys_b, None, prompt_b[:112], 16, None, MEDIUM_GPU, None),
            ]
        ]
        _until("the index learns b's", lambda: index.holders(keys_b) == {"node-0": 7})
        assert index.holders(keys_a) == {"node-0": 1} and index.blocks("node-0") == {keys_a[0], *keys_b}
        engine.add_request("c", prompt_a, SamplingParams(max_tokens=2, temperature=0.0))
        assert not engine.reset_prefix_cache()  # a request holds blocks: refused, as vLLM's, nothing dropped
        assert engine.take_kv_events() == []
        engine.abort_request("c")
        while engine.has_unfinished_requests():  # the abort's output is taken by the next step
            engine.step()
        assert engine.take_kv_events() == []  # never computed: nothing cached
        assert engine.reset_prefix_cache()  # what a node does on the router's ResetPrefixCache
        pub.publish(engine.take_kv_events())
        _until("AllBlocksCleared forgets the node's blocks", lambda: index.holders(keys_b) == {})
        assert index.blocks("node-0") == frozenset() and index.indexed("node-0")
    finally:
        index.close()
        pub.close()
