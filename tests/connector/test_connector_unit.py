"""UCMDirectConnector without a model: real Store, real Request / SchedulerOutput, random paged caches."""

from __future__ import annotations

import pytest
import torch

from common.keys import KeyNamespace, root_key
from connector.base import KVConnectorRole
from connector.factory import UCMDirectConnector
from connector.kv_layout import KVLayout, StagingBuffer, pack_blocks, unpack_blocks
from connector.metadata import ConnectorStats
from connector.ucm_scheduler import UCMSchedulerConnector
from connector.ucm_worker import UCMWorkerConnector
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from protocol.messages import KVTransferParams
from ucm.api import BlockRef
from ucm.store import Store
from ucm.store_config import StoreConfig
from ucm.task import Task

BS, LAYERS, HEADS, DIM, NUM_BLOCKS = 4, 3, 2, 8, 64
ROOT = root_key(KeyNamespace("unit-test-model", "float32", BS))


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), root_key=ROOT, block_size=BS, arrival=0, seed=0)


def make_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen), torch.randn(NUM_BLOCKS, BS, HEADS, DIM, generator=gen))
        for _ in range(LAYERS)
    ]


def make_pair(
    store, role: KVConnectorRole, save_decode_blocks: bool = True, last_token_only: bool = False, **worker_kw
):
    stats = ConnectorStats()
    sched = UCMSchedulerConnector(
        store, role, BS, stats, save_decode_blocks=save_decode_blocks, recompute_last_token_only=last_token_only
    )
    worker = UCMWorkerConnector(store, role, stats, **worker_kw)
    caches = make_caches()
    worker.register_kv_caches(caches)
    return sched, worker, caches, stats


def run_step(sched, worker, caches, scheduled: list[ScheduledRequest], new: bool = True) -> set[int]:
    out = SchedulerOutput(scheduled_new_reqs=scheduled) if new else SchedulerOutput(scheduled_running_reqs=scheduled)
    meta = sched.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    for layer, (k, v) in enumerate(caches):
        worker.wait_for_layer_load(layer)
        worker.save_kv_layer(layer, k, v, None)
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, None)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


@pytest.fixture
def store():
    with Store(StoreConfig(dram_bytes=64 << 20)) as s:
        yield s


def produce(store, tokens: list[int], **worker_kw):
    """A producer computes `tokens` in one step into blocks 1..n and saves them."""
    sched, worker, caches, stats = make_pair(store, KVConnectorRole.PRODUCER, **worker_kw)
    req = make_request("p", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # producers never load
    ids = list(range(1, len(tokens) // BS + 2))
    assert run_step(sched, worker, caches, [ScheduledRequest(req, ids, 0, len(tokens))]) == set()
    return caches, ids, stats, sched.request_finished(req, ids)


@pytest.mark.parametrize("small_save_layer_bytes", [0, 1 << 20], ids=["layer-by-layer", "one-request"])
def test_save_then_load_roundtrip(store, monkeypatch, small_save_layer_bytes):
    """A save streams to the store layer by layer, or, when it is small (a decode step's few blocks), goes in one
    request after the last layer; either way the consumer loads the same bytes."""
    calls: list[tuple[str, list[int]]] = []
    dump, dump_layers = store.dump, store.dump_layers
    monkeypatch.setattr(store, "dump", lambda b, layer, *a: calls.append(("dump", [layer])) or dump(b, layer, *a))
    monkeypatch.setattr(
        store, "dump_layers", lambda b, ls, *a: calls.append(("dump_layers", list(ls))) or dump_layers(b, ls, *a)
    )
    tokens = list(range(1000, 1018))  # 4 full blocks + 2 tokens
    src, src_ids, pstats, (delay, params) = produce(store, tokens, small_save_layer_bytes=small_save_layer_bytes)
    if small_save_layer_bytes:
        assert calls == [("dump_layers", list(range(LAYERS)))], calls
    else:  # the in-process store's dump is its dump_layers of one layer
        assert [c for c in calls if c[0] == "dump"] == [("dump", [layer]) for layer in range(LAYERS)], calls
    assert pstats.blocks_saved == 4 and pstats.blocks_save_failed == 0
    assert delay is False and params.num_saved_tokens == 16 and len(params.block_keys) == 4
    assert store.lookup(make_request("x", tokens).block_keys) == 4

    sched, worker, caches, stats = make_pair(store, KVConnectorRole.CONSUMER)
    req = make_request("c", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    ids = [40, 41, 42, 43, 44]
    sched.update_state_after_alloc(req, ids, 16)
    assert run_step(sched, worker, caches, [ScheduledRequest(req, ids, 16, 2, 16)]) == set()
    for layer in range(LAYERS):
        for a, b in zip(src_ids[:4], ids[:4]):
            assert torch.equal(src[layer][0][a], caches[layer][0][b]) and torch.equal(
                src[layer][1][a], caches[layer][1][b]
            )
    assert stats.blocks_loaded == 4 and stats.blocks_load_failed == 0 and stats.blocks_saved == 0
    assert sched.request_finished(req, ids) == (False, None)  # consumers pass nothing on


def test_lookup_skips_device_blocks_and_leaves_last_token(store):
    tokens = list(range(2000, 2016))  # exactly 4 full blocks
    produce(store, tokens)
    sched, _, _, _ = make_pair(store, KVConnectorRole.CONSUMER)
    # Every token would hit: the last block is left to compute so the first token can be sampled.
    assert sched.get_num_new_matched_tokens(make_request("a", tokens), 0) == (12, False)
    # The device already holds 2 blocks: only the rest is asked of the store.
    assert sched.get_num_new_matched_tokens(make_request("b", tokens), 8) == (4, False)
    assert sched.get_num_new_matched_tokens(make_request("c", tokens), 12) == (0, False)
    assert sched.get_num_new_matched_tokens(make_request("d", [7] * 16), 0) == (0, False)


def test_fully_stored_aligned_prompt_recomputes_only_its_last_token(store):
    tokens = list(range(2100, 2116))  # exactly 4 full blocks, all stored
    src, src_ids, _, _ = produce(store, tokens)
    sched, worker, caches, stats = make_pair(store, KVConnectorRole.BOTH, last_token_only=True)
    req = make_request("a", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (15, False)
    assert sched.get_num_new_matched_tokens(make_request("b", tokens), 8) == (7, False)
    ids = [20, 21, 22, 23]
    sched.update_state_after_alloc(req, ids, 15)
    assert run_step(sched, worker, caches, [ScheduledRequest(req, ids, 15, 1, 15)]) == set()
    assert stats.blocks_loaded == 4 and stats.blocks_saved == 0  # the last block is loaded whole, not re-saved
    assert torch.equal(caches[0][0][23], src[0][0][src_ids[3]])
    # A prompt that ends inside a block still loads whole blocks only.
    assert sched.get_num_new_matched_tokens(make_request("c", tokens + [1, 2]), 0) == (16, False)


def test_decode_blocks_saved_only_with_flag(store):
    for flag, expected in ((False, 1), (True, 2)):
        sched, worker, caches, stats = make_pair(store, KVConnectorRole.PRODUCER, save_decode_blocks=flag)
        req = make_request(f"r{flag}", list(range(3000 + 100 * flag, 3006 + 100 * flag)))  # 1 block + 2 tokens
        run_step(sched, worker, caches, [ScheduledRequest(req, [1, 2], 0, 6)])
        for tok in (5, 6):  # two decode steps fill block 2
            req.append_output_token(tok)
            run_step(sched, worker, caches, [ScheduledRequest(req, [1, 2], req.num_tokens - 1, 1)], new=False)
        assert len(req.block_keys) == 2
        assert stats.blocks_saved == expected, flag


def test_failed_block_fails_the_rest_of_its_request(store, monkeypatch):
    tokens = list(range(4000, 4021))  # 5 full blocks + 1
    produce(store, tokens)
    sched, worker, caches, stats = make_pair(store, KVConnectorRole.BOTH)
    before = [(k.clone(), v.clone()) for k, v in caches]
    real_load = store.load

    def flaky_load(blocks, layers, dst):  # the one fault we cannot cause for real: block 2 of layer 1 missing
        task = real_load(blocks, layers, dst)
        task.wait()
        return Task.completed(len(blocks), [2] if layers == [1] else [])

    monkeypatch.setattr(store, "load", flaky_load)
    req = make_request("c", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (20, False)
    ids = [50, 51, 52, 53, 54, 55]
    sched.update_state_after_alloc(req, ids, 20)
    errors = run_step(sched, worker, caches, [ScheduledRequest(req, ids, 20, 1, 20)])
    assert errors == {52, 53, 54}  # block 2 and every later block of the request
    assert stats.blocks_loaded == 2 and stats.blocks_load_failed == 3
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    # Failed blocks are not scattered on their failing layer.
    assert torch.equal(caches[1][0][52], before[1][0][52])


def test_saves_of_a_request_with_a_failed_load_are_discarded(store, monkeypatch):
    tokens = list(range(5000, 5008))
    produce(store, tokens)
    monkeypatch.setattr(store, "load", lambda blocks, layers, dst: Task.all_failed(len(blocks), "injected"))
    sched, worker, caches, stats = make_pair(store, KVConnectorRole.BOTH)
    longer = tokens + list(range(6000, 6009))  # 2 stored blocks, then 2 more computed in this step
    req = make_request("c", longer)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)
    ids = [10, 11, 12, 13, 14]
    sched.update_state_after_alloc(req, ids, 8)
    assert run_step(sched, worker, caches, [ScheduledRequest(req, ids, 8, 9, 8)]) == {10, 11}
    # Blocks 2-3 were computed over garbage context: they must not reach the store.
    assert stats.blocks_saved == 0 and stats.blocks_save_failed == 2
    assert store.lookup(req.block_keys) == 2 and store.contains(req.block_keys[2:]) == [False, False]


class _DeadStore:
    """Stands in for a store whose every call fails, as a daemon client does when nothing answers."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise ConnectionError(f"{name}: store unreachable")

        return fail


def test_unreachable_store_never_raises():
    sched, worker, caches, stats = make_pair(_DeadStore(), KVConnectorRole.BOTH)
    req = make_request("r", list(range(9)))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert run_step(sched, worker, caches, [ScheduledRequest(req, [1, 2, 3], 0, 9)]) == set()
    assert stats.store_errors >= 1 and stats.blocks_saved == 0


def test_factory_embedded_shares_one_store():
    a = UCMDirectConnector.create("embedded?dram=16MiB", "kv_producer", BS)
    b = UCMDirectConnector.create("embedded?dram=16MiB", KVConnectorRole.CONSUMER, BS)
    assert a.store is b.store and a.scheduler.role is KVConnectorRole.PRODUCER
    with pytest.raises(ValueError, match="kv_role"):
        UCMDirectConnector.create("embedded", "producer", BS)
    with pytest.raises(ValueError, match="kv_store"):
        UCMDirectConnector.create("redis://x", "kv_both", BS)


def test_blockref_of_request_matches_store_expectations():
    req = make_request("r", list(range(8)))
    from connector.ucm_scheduler import block_refs

    refs = block_refs(req, 0, 2)
    assert refs[0] == BlockRef(req.block_keys[0], ROOT, tuple(range(4)))
    assert refs[1].parent == req.block_keys[0]


def test_producer_keys_from_another_namespace_are_flagged(store, caplog):
    sched, _, _, stats = make_pair(store, KVConnectorRole.CONSUMER)
    req = make_request("r", list(range(8)))
    req.kv_transfer_params = KVTransferParams(block_keys=["00" * 16, "01" * 16])
    sched.get_num_new_matched_tokens(req, 0)
    assert stats.key_mismatches == 1 and "block keys differ" in caplog.text
    ok = make_request("s", list(range(8)))
    ok.kv_transfer_params = KVTransferParams(block_keys=[k.hex() for k in ok.block_keys])
    sched.get_num_new_matched_tokens(ok, 0)
    assert stats.key_mismatches == 1


def test_store_spec_parsing():
    from connector.store_spec import StoreKind, StoreSpec

    spec = StoreSpec.parse("embedded?disk_path=/tmp/x&dram=1GiB&disk=2GiB&policy=s3fifo")
    assert spec.kind is StoreKind.EMBEDDED and spec.disk_path == "/tmp/x" and spec.dram_bytes == 1 << 30
    assert spec.disk_bytes == 2 << 30 and spec.policy.value == "s3fifo"
    assert StoreSpec.parse("embedded").disk_path is None
    daemon = StoreSpec.parse("tcp://127.0.0.1:7000?timeout_s=0.5")
    assert daemon.kind is StoreKind.DAEMON and daemon.address == "tcp://127.0.0.1:7000" and daemon.timeout_s == 0.5
    for bad in ("", "embedded?nope=1", "embedded?dram=lots", "file:///x", "tcp://h:1?timeout_s=-1"):
        with pytest.raises(ValueError):
            StoreSpec.parse(bad)


def test_stuck_load_times_out_as_failed(store, monkeypatch):
    tokens = list(range(7000, 7009))
    produce(store, tokens)
    monkeypatch.setattr(store, "load", lambda blocks, layers, dst: Task(len(blocks)))  # never finishes
    stats = ConnectorStats()
    sched = UCMSchedulerConnector(store, KVConnectorRole.CONSUMER, BS, stats)
    worker = UCMWorkerConnector(store, KVConnectorRole.CONSUMER, stats, task_timeout_s=0.01)
    caches = make_caches()
    worker.register_kv_caches(caches)
    old_buf = worker._load_bufs[0]
    req = make_request("c", tokens)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [5, 6, 7], n)
    assert run_step(sched, worker, caches, [ScheduledRequest(req, [5, 6, 7], n, 1, n)]) == {5, 6}
    assert worker._load_bufs[0] is not old_buf  # the straggler keeps its buffer


def test_lifecycle_checker_catches_misordered_calls():
    from connector.recording import Call, check_lifecycle

    def step(layers: list[tuple[str, int]]) -> list[Call]:
        return (
            [
                Call("get_num_new_matched_tokens", "r"),
                Call("update_state_after_alloc", "r"),
                Call("build_connector_meta"),
                Call("bind_connector_metadata"),
                Call("start_load_kv"),
            ]
            + [Call(m, layer=i) for m, i in layers]
            + [
                Call(m)
                for m in ("wait_for_save", "get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata")
            ]
        )

    good = [("wait_for_layer_load", 0), ("save_kv_layer", 0), ("wait_for_layer_load", 1), ("save_kv_layer", 1)]
    ok = [Call("register_kv_caches")] + step(good) + [Call("request_finished", "r")]
    assert check_lifecycle(ok, 2) == []
    swapped = [Call("register_kv_caches")] + step([good[1], good[0], *good[2:]])
    assert check_lifecycle(swapped, 2) and "wait_for_layer_load:0" in check_lifecycle(swapped, 2)[0]
    assert check_lifecycle([Call("register_kv_caches")] + step(good[:2]), 2)  # a layer missing
    assert check_lifecycle(step(good), 2)  # register_kv_caches missing
    orphan = [Call("register_kv_caches"), Call("update_state_after_alloc", "x")] + step(good)
    assert any("without a lookup" in p for p in check_lifecycle(orphan, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_roundtrip_half_precision_caches(store, dtype):
    tokens = list(range(8000, 8013))  # 3 full blocks + 1
    stats = ConnectorStats()
    caches = [(k.to(dtype), v.to(dtype)) for k, v in make_caches()]
    prod = UCMWorkerConnector(store, KVConnectorRole.PRODUCER, stats)
    prod.register_kv_caches(caches)
    psched = UCMSchedulerConnector(store, KVConnectorRole.PRODUCER, BS, stats)
    req = make_request("p", tokens)
    run_step(psched, prod, caches, [ScheduledRequest(req, [1, 2, 3, 4], 0, 13)])
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    cons = UCMWorkerConnector(store, KVConnectorRole.CONSUMER, stats)
    cons.register_kv_caches(dst)
    csched = UCMSchedulerConnector(store, KVConnectorRole.CONSUMER, BS, stats)
    req2 = make_request("c", tokens)
    n, _ = csched.get_num_new_matched_tokens(req2, 0)
    csched.update_state_after_alloc(req2, [7, 8, 9, 10], n)
    assert run_step(csched, cons, dst, [ScheduledRequest(req2, [7, 8, 9, 10], n, 1, n)]) == set()
    assert cons.layout.payload_nbytes == 2 * BS * HEADS * DIM * 2
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][0][7:10], caches[layer][0][1:4])
        assert torch.equal(dst[layer][1][7:10], caches[layer][1][1:4])


def test_loads_that_the_model_never_waited_for_are_still_accounted(store):
    tokens = list(range(9000, 9009))
    produce(store, tokens)
    sched, worker, _caches, stats = make_pair(store, KVConnectorRole.CONSUMER)
    req = make_request("c", tokens)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [3, 4, 5], n)
    worker.bind_connector_metadata(
        sched.build_connector_meta(SchedulerOutput([ScheduledRequest(req, [3, 4, 5], n, 1, n)]))
    )
    worker.start_load_kv()
    worker.wait_for_save()  # no layer waited: every layer still lands and is counted once
    assert worker.get_block_ids_with_load_errors() == set() and stats.blocks_loaded == 2
    worker.clear_connector_metadata()


@pytest.mark.parametrize(
    "block_ids",
    [[5, 6, 7, 8], [5, 6, 20, 21], [40, 3, 17, 9, 2, 60]],
    ids=["one run: slice copies", "two runs: slice copies", "scattered: a gather"],
)
def test_pack_blocks_stages_each_block_as_k_then_v(block_ids):
    """Both ways of staging (slice copies, one gather) lay out the same payloads, and unpack puts them back."""
    k, v = make_caches()[0]
    layout = KVLayout.from_caches([(k, v)])
    staging = StagingBuffer(layout)
    ids = torch.tensor(block_ids)
    pack_blocks(k, v, ids, staging, first_row=2)
    rows = staging.blocks(2 + len(block_ids))[2:]
    assert torch.equal(rows[:, 0], k[ids]) and torch.equal(rows[:, 1], v[ids])
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    unpack_blocks(staging, torch.arange(2, 2 + len(block_ids)), 2 + len(block_ids), k2, v2, ids)
    assert torch.equal(k2[ids], k[ids]) and torch.equal(v2[ids], v[ids])
