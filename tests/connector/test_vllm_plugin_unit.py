"""UCMConnector's vLLM-independent cores under a fake vLLM (tests/vllm_fakes.py): runs without vllm installed.

Call order, the request tracker across preemption / resumption / abort, vLLM's full-hit rule (the recomputed
last token keeps its fresh K/V), failed loads reported and never served, and the key namespaces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from common.keys import KeyNamespace, root_key
from connector.vllm.block_bytes import block_rows
from connector.vllm.key_scope import VllmKeyScope, layout_tag
from connector.vllm.plugin_config import PluginConfig
from connector.vllm.step import BlockLoad, ScheduledRequest, StepDelta, StepPlan
from tests.vllm_fakes import BS, LAYERS, FakeRequest, FakeVllm
from ucm.store import Store, StoreConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store():
    s = Store(StoreConfig(dram_bytes=64 << 20))
    yield s
    s.close()


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 1009 + i * 37) % 30000 + 1 for i in range(n)]


def assert_kv_correct(vllm: FakeVllm, rid: str, upto: int) -> None:
    for layer in range(LAYERS):
        for pos in range(upto):
            assert vllm.slot(rid, pos, layer) == vllm.expected(rid, pos, layer), f"layer {layer} pos {pos}"


# ---- call order and the basic save -> restart -> load round trip ---------------------------------------------


def test_save_then_load_after_restart(store):
    tokens = prompt(10)  # 2 full blocks + 2 tokens
    first = FakeVllm(store)
    assert first.admit(FakeRequest("a", tokens, len(tokens))) == 0
    res = first.step()
    assert [s.blocks for s in res.plan.saves] and sum(len(s.blocks) for s in res.plan.saves) == 2
    assert res.calls == [
        "build_plan",
        "bind",
        "wait_layer:0",
        "save_layer:0",
        "wait_layer:1",
        "save_layer:1",
        "start_load",
        "wait_for_save",
        "load_errors",
        "clear",
    ]
    assert first.stats.blocks_saved == 2
    first.finish("a")
    assert first.sched.num_tracked == 0

    second = FakeVllm(store)  # a restarted vLLM: empty device cache, same store
    assert second.admit(FakeRequest("b", tokens, len(tokens))) == 8
    res = second.step()
    assert res.calls[:3] == ["build_plan", "bind", "start_load"], "a synchronous load starts before the forward"
    assert res.load_errors == set()
    (load,) = res.plan.loads
    assert not load.before_forward and load.block_ids == tuple(second.tables["b"][:2])
    assert res.plan.saves == [], "loaded blocks are not saved again"
    assert second.stats.blocks_loaded == 2
    assert_kv_correct(second, "b", 10)


def test_full_hit_keeps_the_recomputed_tokens_fresh_kv(store):
    tokens = prompt(8)  # block-aligned: every block stored, vLLM still computes the last token
    first = FakeVllm(store)
    first.admit(FakeRequest("a", tokens, 8))
    first.step()
    second = FakeVllm(store)
    assert second.admit(FakeRequest("b", tokens, 8)) == 7, "offered up to one token short of the prompt"
    second.fresh_bias[("b", 7)] = 0.5  # the forward's K/V for the last token differs from the stored copy
    res = second.step({"b": 1})
    (load,) = res.plan.loads
    assert load.before_forward and len(load.blocks) == 2
    for layer in range(LAYERS):
        assert second.slot("b", 7, layer) == second.expected("b", 7, layer) + 0.5, "stored copy overwrote it"
        for pos in range(7):
            assert second.slot("b", pos, layer) == second.expected("b", pos, layer)


def test_transfers_must_finish_before_the_next_bind(store):
    vllm = FakeVllm(store)
    vllm.admit(FakeRequest("x", prompt(8, seed=9), 8))
    plan = vllm.sched.build_plan(StepDelta((ScheduledRequest("x", tuple(vllm.tables["x"]), True, 0, 8),)))
    vllm.worker.bind(plan)
    vllm.worker.save_layer(0)  # a save dumped but never waited for (wait_for_save skipped)
    with pytest.raises(AssertionError, match="not finished"):
        vllm.worker.bind(StepPlan())


def test_alloc_of_tokens_never_offered_is_an_error(store):
    vllm = FakeVllm(store)
    req = FakeRequest("a", prompt(8), 8)
    vllm.sched.track("a", lambda: req.all_token_ids, 8, None)
    assert vllm.sched.num_new_matched_tokens("a", 0) == 0
    with pytest.raises(ValueError, match="never offered"):
        vllm.sched.after_alloc("a", [0, 1], 4)
    with pytest.raises(ValueError, match="multiple of block size"):
        vllm.sched.num_new_matched_tokens("a", 3)


# ---- the request tracker -------------------------------------------------------------------------------------


def test_chunked_prefill_preemption_and_resumption(store):
    tokens = prompt(12)  # 3 blocks
    vllm = FakeVllm(store, num_blocks=8)
    vllm.admit(FakeRequest("a", tokens, 12))
    res = vllm.step({"a": 8})  # first chunk: blocks 0 and 1 become full
    assert [len(s.blocks) for s in res.plan.saves] == [2]
    old_table = list(vllm.tables["a"])
    vllm.preempt("a")
    # another request takes the freed blocks meanwhile
    vllm.admit(FakeRequest("other", prompt(8, seed=5), 8))
    vllm.step({"other": 8})
    vllm.finish("other")
    tracker = vllm.sched.tracker("a")
    assert tracker is not None and tracker.handled == 2
    assert vllm.admit(FakeRequest("a", tokens, 12)) == 8, "a resumed request loads what it saved before"
    assert vllm.tables["a"] != old_table
    res = vllm.step()
    (load,) = res.plan.loads
    assert load.block_ids == tuple(vllm.tables["a"][:2]), "loads go to the new block table"
    assert [len(s.blocks) for s in res.plan.saves] == [1], "only the block that became full is saved"
    assert vllm.sched.tracker("a").preemptions == 1
    assert_kv_correct(vllm, "a", 12)
    assert vllm.stats.blocks_saved == 5  # 2 of a, 2 of other, 1 of a


def test_abort_forgets_the_request(store):
    vllm = FakeVllm(store)
    vllm.admit(FakeRequest("a", prompt(16), 16))
    vllm.step({"a": 4})
    vllm.finish("a")  # aborted mid-prefill
    assert vllm.sched.num_tracked == 0
    res = vllm.step({})
    assert res.plan.loads == [] and res.plan.saves == []


def test_decode_blocks_are_saved_only_when_asked(store):
    for save_decode, expect in ((False, 1), (True, 2)):
        vllm = FakeVllm(
            store,
            save_decode_blocks=save_decode,
            scope=VllmKeyScope("folder:m", "float32", BS, f"vllm-test/CPU_ATTN/{save_decode}"),
        )
        req = FakeRequest("a", prompt(6), 6)
        vllm.admit(req)
        vllm.step()
        req.all_token_ids.extend([7, 8])  # two generated tokens fill block 1
        vllm.step({"a": 2})
        assert vllm.stats.blocks_saved == expect


def test_salt_separates_tenants(store):
    tokens = prompt(8)
    first = FakeVllm(store)
    first.admit(FakeRequest("a", tokens, 8, cache_salt="tenant-1"))
    first.step()
    second = FakeVllm(store)
    assert second.admit(FakeRequest("b", tokens, 8, cache_salt="tenant-2")) == 0
    assert second.admit(FakeRequest("c", tokens, 8, cache_salt="tenant-1")) == 7


# ---- failures are reported, never served ---------------------------------------------------------------------


def test_missing_block_is_reported_and_its_saves_dropped(store):
    tokens = prompt(14)  # 3 full blocks
    first = FakeVllm(store)
    first.admit(FakeRequest("a", tokens, 14))
    first.step()
    second = FakeVllm(store)
    assert second.admit(FakeRequest("b", tokens + [5, 6], 16)) == 12
    store.remove([second.sched.tracker("b").keys[1]])  # evicted between lookup and load
    res = second.step()
    table = second.tables["b"]
    assert res.load_errors == {table[1], table[2]}, "the failed block and every later one"
    assert second.stats.blocks_loaded == 1 and second.stats.blocks_load_failed == 2
    assert second.stats.blocks_saved == 0, "KV computed over a failed load is never published"
    # vLLM recomputes from the first failed block; what the store lacks is saved this time (block 2 is still
    # stored: it only failed by following block 1)
    second.sched.on_load_errors(res.load_errors)
    second.computed["b"] = BS
    res = second.step()
    assert [ref.key for save in res.plan.saves for ref in save.blocks] == [
        second.sched.tracker("b").keys[i] for i in (1, 3)
    ]
    assert second.stats.blocks_saved == 2
    assert_kv_correct(second, "b", 16)


def test_poisoned_load_reports_its_blocks(store):
    vllm = FakeVllm(store)
    vllm.worker.bind(StepPlan(loads=[BlockLoad("a", (3, 4), (), poisoned=True)]))
    vllm.worker.start_load()
    vllm.worker.wait_for_save()
    assert vllm.worker.take_load_errors() == {3, 4}
    vllm.worker.clear()


def test_unreachable_store_is_a_miss():
    from ucm.client import StoreClient

    client = StoreClient("tcp://127.0.0.1:9", timeout_s=0.2, retry_after_s=5.0)
    try:
        vllm = FakeVllm(client)
        assert vllm.admit(FakeRequest("a", prompt(8), 8)) == 0
        res = vllm.step()
        assert res.load_errors == set() and vllm.stats.blocks_saved == 0
    finally:
        client.close()


# ---- vLLM's per-step deltas -----------------------------------------------------------------------------------


def test_step_delta_from_vllm_scheduler_output():
    """The fields vLLM 0.32's SchedulerOutput / NewRequestData / CachedRequestData carry, as plain objects."""
    from types import SimpleNamespace as NS

    so = NS(
        scheduled_new_reqs=[NS(req_id="new", block_ids=([4, 5, 6],), num_computed_tokens=256)],
        scheduled_cached_reqs=NS(
            req_ids=["running", "resumed", "decoding"],
            resumed_req_ids={"resumed"},
            new_block_ids=[([9],), ([1, 2],), None],
            num_computed_tokens=[128, 0, 300],
        ),
        num_scheduled_tokens={"new": 100, "running": 128, "resumed": 256, "decoding": 1},
        preempted_req_ids={"gone"},
        finished_req_ids={"done"},
    )
    delta = StepDelta.of(so)
    assert delta.scheduled == (
        ScheduledRequest("new", (4, 5, 6), True, 256, 100),
        ScheduledRequest("running", (9,), False, 128, 128),
        ScheduledRequest("resumed", (1, 2), True, 0, 256),
        ScheduledRequest("decoding", (), False, 300, 1),
    )
    assert delta.preempted == {"gone"} and delta.finished == {"done"}
    so.preempted_req_ids = None  # vLLM may leave it unset
    assert StepDelta.of(so).preempted == frozenset()


# ---- namespaces, config, block bytes -------------------------------------------------------------------------


def test_vllm_and_ucm_serve_namespaces_never_collide():
    ucm_engine = root_key(KeyNamespace("llama-0123abcd", "float32", 128))
    vllm = VllmKeyScope("folder:0123abcd", "float32", 128, layout_tag("0.32.0+cpu", "CPU_ATTN", "vec"))
    roots = {
        ucm_engine,
        vllm.root(None),
        VllmKeyScope(vllm.model, "float32", 128, layout_tag("0.32.0+cpu", "CPU_ATTN", "amx")).root(None),
        VllmKeyScope(vllm.model, "float32", 128, layout_tag("0.33.0+cpu", "CPU_ATTN", "vec")).root(None),
        VllmKeyScope(vllm.model, "bfloat16", 128, vllm.layout_tag).root(None),
        VllmKeyScope(vllm.model, "float32", 64, vllm.layout_tag).root(None),
        VllmKeyScope(vllm.model, "float32", 128, vllm.layout_tag, tp_rank=1, tp_size=2).root(None),
        vllm.root("salt"),
    }
    assert len(roots) == 8


def test_plugin_config():
    cfg = PluginConfig.from_extra({"store": "tcp://127.0.0.1:5555", "save_decode_blocks": True})
    assert cfg.store.address == "tcp://127.0.0.1:5555" and cfg.save_decode_blocks
    for bad, match in (
        ({}, "needs"),
        ({"store": "embedded"}, "separate processes"),
        ({"store": "tcp://h:1", "x": 1}, "unknown"),
        ({"store": "tcp://h:1", "task_timeout_s": 0}, "positive"),
    ):
        with pytest.raises(ValueError, match=match):
            PluginConfig.from_extra(bad)


def test_block_rows_are_whole_blocks():
    cache = torch.arange(6 * 2 * 4 * 8, dtype=torch.float32).reshape(6, 2, 4, 8)
    rows = block_rows(cache, 6)
    assert rows.shape == (6, 2 * 4 * 8 * 4)
    assert rows[3].numpy().tobytes() == cache[3].numpy().tobytes()
    rows[1].zero_()
    assert float(cache[1].abs().sum()) == 0.0, "rows write through to the cache"
    split = block_rows(cache, 3)  # kernel blocks half the size of vLLM's: consecutive rows form one block
    assert split[1].numpy().tobytes() == cache[2:4].numpy().tobytes()
    permuted = torch.zeros(6, 4, 2, 8).permute(0, 2, 1, 3)  # dense, block outermost, inner order permuted
    assert block_rows(permuted, 6).shape == (6, 256)
    with pytest.raises(ValueError, match="outermost"):
        block_rows(torch.zeros(2, 6, 8).transpose(0, 1), 6)


def test_only_the_plugin_imports_vllm():
    offenders = []
    packages = ("engine", "ucm_kernels", "ucm", "connector", "prefill_node", "decode_node", "router", "benchmarks")
    for path in (p for pkg in packages for p in (REPO / pkg).rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.as_posix() == "connector/vllm_plugin.py":
            continue
        if re.search(r"^\s*(import vllm|from vllm[ .])", path.read_text(errors="replace"), re.M):
            offenders.append(rel.as_posix())
    assert offenders == [], f"only connector/vllm_plugin.py may import vllm: {offenders}"
