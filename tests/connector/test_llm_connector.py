"""The engine's KV-connector call sites: documented call order, external hits counted as computed, and
recovery from failed loads (output equals a cache-free run). Uses a tiny dict-backed connector."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from connector.base import ConnectorMetadata, KVConnectorScheduler, KVConnectorWorker
from engine import EngineCore, SamplingParams
from protocol.messages import KVTransferParams
from tests.engine_helpers import PROMPTS, make_llm, single_thread

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = " ".join(PROMPTS[2:6])


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with single_thread():
        yield


@dataclass
class ToyMeta(ConnectorMetadata):
    loads: list[tuple[bytes, int]] = field(default_factory=list)  # (key, device block)
    saves: list[tuple[bytes, int]] = field(default_factory=list)


class ToyScheduler(KVConnectorScheduler):
    def __init__(self, store: dict, calls: list, bs: int = 16) -> None:
        self.store, self.calls, self.bs = store, calls, bs
        self.pending: list[tuple[bytes, int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append("get_num_new_matched_tokens")
        start, hits = num_computed_tokens // self.bs, 0
        self.start_block = start  # request.num_computed_tokens is only updated after update_state_after_alloc
        for key in request.block_keys[start:]:
            if key not in self.store:
                break
            hits += 1
        return hits * self.bs, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append("update_state_after_alloc")
        start = self.start_block
        for i in range(start, start + -(-num_external_tokens // self.bs)):
            self.pending.append((request.block_keys[i], block_ids[i]))

    def build_connector_meta(self, scheduler_output):
        self.calls.append("build_connector_meta")
        meta = ToyMeta(loads=self.pending)
        self.pending = []
        for s in scheduler_output.scheduled:
            first = s.num_computed_tokens // self.bs
            stop = min((s.num_computed_tokens + s.num_scheduled_tokens) // self.bs, len(s.request.block_keys))
            meta.saves += [(s.request.block_keys[i], s.block_ids[i]) for i in range(first, stop)]
        return meta

    def request_finished(self, request, block_ids):
        self.calls.append("request_finished")
        return False, KVTransferParams(num_saved_tokens=len(block_ids) * self.bs, block_size=self.bs)


class ToyWorker(KVConnectorWorker):
    def __init__(self, store: dict, calls: list, fail_keys: set[bytes] = frozenset(), saves: bool = True) -> None:
        super().__init__()
        self.store, self.calls, self.fail_keys, self.saves = store, calls, fail_keys, saves
        self.failed: set[int] = set()
        self.staged: dict[bytes, dict] = {}

    def bind_connector_metadata(self, metadata):
        self.calls.append("bind_connector_metadata")
        super().bind_connector_metadata(metadata)

    def clear_connector_metadata(self):
        self.calls.append("clear_connector_metadata")
        super().clear_connector_metadata()

    def register_kv_caches(self, kv_caches):
        self.caches = kv_caches

    def start_load_kv(self):
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer):
        self.calls.append(f"wait_for_layer_load:{layer}")
        k_cache, v_cache = self.caches[layer]
        for key, bid in self.metadata.loads:
            if key in self.fail_keys:
                self.failed.add(bid)  # nothing copied: the block holds garbage
                continue
            k, v = self.store[key][layer]
            k_cache[bid].copy_(k)
            v_cache[bid].copy_(v)

    def save_kv_layer(self, layer, k_cache, v_cache, attn_metadata):
        self.calls.append(f"save_kv_layer:{layer}")
        if self.saves:
            for key, bid in self.metadata.saves:
                self.staged.setdefault(key, {})[layer] = (k_cache[bid].clone(), v_cache[bid].clone())

    def wait_for_save(self):
        self.calls.append("wait_for_save")
        for key, layers in self.staged.items():
            self.store.setdefault(key, layers)
        self.staged = {}

    def get_finished(self, finished_req_ids):
        self.calls.append("get_finished")
        return set(), set()

    def get_block_ids_with_load_errors(self):
        self.calls.append("get_block_ids_with_load_errors")
        failed, self.failed = self.failed, set()
        return failed


def run(core: EngineCore, ids: list[int]) -> list[int]:
    core.add_request("r", ids, GREEDY)
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.outputs[0].token_ids
            if out.finished:
                bs, blocks = core.namespace.block_size, core.kv_manager.blocks_needed(len(ids) + 7)
                assert out.kv_transfer_params == KVTransferParams(num_saved_tokens=blocks * bs, block_size=bs)
                assert out.num_external_tokens == core.stats().external_hit_tokens
    core.check_integrity()
    return tokens


def make_core(loaded, store, calls, **worker_kw) -> EngineCore:
    config = make_llm(loaded).config
    return EngineCore(
        config, loaded_model=loaded, kv_connector=(ToyScheduler(store, calls), ToyWorker(store, calls, **worker_kw))
    )


def test_call_order_and_external_hits(smollm2_fp32):
    ids = smollm2_fp32.tokenizer.encode(PROMPT)
    layers = smollm2_fp32.config.num_layers
    store, calls = {}, []
    producer = make_core(smollm2_fp32, store, calls)
    want = run(producer, ids)
    assert len(store) == (len(ids) + 7) // 16
    per_layer = [c for i in range(layers) for c in (f"wait_for_layer_load:{i}", f"save_kv_layer:{i}")]
    step = [
        "build_connector_meta",
        "bind_connector_metadata",
        "start_load_kv",
        *per_layer,
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    assert calls[: 2 + len(step)] == ["get_num_new_matched_tokens", "update_state_after_alloc", *step]
    assert calls[-1] == "request_finished" and calls[-1 - len(step) : -1] == step
    consumer = make_core(smollm2_fp32, store, [])
    assert run(consumer, ids) == want
    stats = consumer.stats()
    hit = (len(ids) - 1) // 16 * 16
    assert stats.external_hit_tokens == hit and stats.prefix_cache_hit_tokens == 0
    assert stats.computed_tokens == len(ids) - hit


def test_load_errors_are_recomputed(smollm2_fp32):
    ids = smollm2_fp32.tokenizer.encode(PROMPT)
    store = {}
    want = run(make_core(smollm2_fp32, store, []), ids)
    producer_keys = list(store)
    assert len(producer_keys) >= 3
    broken = make_core(smollm2_fp32, store, [], fail_keys={producer_keys[1]}, saves=False)
    assert run(broken, ids) == want
    stats = broken.stats()
    assert stats.external_hit_tokens == 16  # only the block before the failed one counts as a hit
    assert stats.load_error_tokens > 0
    # The garbage blocks were never published in the device prefix cache.
    pool = broken.kv_manager.pool
    cached = {b.key for b in pool.blocks if b.key is not None}
    assert producer_keys[1] in cached  # recomputed afterwards: now holds correct KV under its key


def test_close_releases_both_connector_sides(smollm2_fp32):
    calls = []
    sched, worker = ToyScheduler({}, calls), ToyWorker({}, calls)
    closed = []
    sched.close = lambda: closed.append("scheduler")
    worker.close = lambda: closed.append("worker")
    core = EngineCore(make_llm(smollm2_fp32).config, loaded_model=smollm2_fp32, kv_connector=(sched, worker))
    core.close()
    assert closed == ["scheduler", "worker"]
    core.close()  # idempotent
    assert closed == ["scheduler", "worker"]
