"""Scheduler without a model: token budget, chunked prefill mixed with decodes, priority, preemption, abort."""

from __future__ import annotations

import itertools

import pytest

from common.keys import KeyNamespace, root_key
from engine.config import SchedulerConfig, SchedulingPolicy
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from protocol.messages import KVTransferParams

BS = 4
ROOT = root_key(KeyNamespace("test-model", "float32", BS))
EOS = 0
_arrival = itertools.count()


def make_request(rid: str, num_tokens: int, max_tokens: int = 4, priority: int = 0, start: int = 1) -> Request:
    return Request(
        rid,
        list(range(start, start + num_tokens)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
        priority=priority,
    )


def make_scheduler(
    num_blocks=32,
    budget=16,
    max_seqs=8,
    max_model_len=64,
    chunked=True,
    policy=SchedulingPolicy.FCFS,
    clock=None,
    chunk_after_tokens=SchedulerConfig.chunk_after_tokens,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BS),
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        eos_token_ids=frozenset([EOS]),
        enable_chunked_prefill=chunked,
        policy=policy,
        chunk_after_tokens=chunk_after_tokens,
        **({"clock": clock} if clock else {}),
    )


def fake_run(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """A model that always samples `token` for every sequence that completes its known tokens."""
    res = ModelRunnerOutput()
    for s in out.scheduled:
        if s.num_samples:
            res.sampled[s.request_id] = [token] * s.num_samples
    return res


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out, token))
    sched.check_integrity()
    return out


def test_budget_and_chunked_prefill_mixed_with_decodes():
    sched = make_scheduler(budget=16)
    a = make_request("a", 10)
    sched.add_request(a)
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 10} and a.num_output_tokens == 1
    b = make_request("b", 30, start=100)
    sched.add_request(b)
    out = step(sched)
    # a decodes (1 token), b gets the rest of the budget (15) as its first chunk.
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert b.num_computed_tokens == 15 and b.num_output_tokens == 0
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert b.num_computed_tokens == 30 and b.num_output_tokens == 1
    assert sched.stats.computed_tokens == 10 + 30


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(budget=16, chunked=False, max_model_len=16)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 12, start=50))
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 10}  # b does not fit whole in the remaining 6
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 12}


def test_max_num_seqs():
    sched = make_scheduler(budget=64, max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, start=10 * i + 1))
    out = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_priority_order():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("low", 8, priority=5))
    sched.add_request(make_request("high", 8, priority=-1, start=40))
    sched.add_request(make_request("mid", 8, priority=0, start=80))
    assert [r.request_id for r in sched.waiting] == ["high", "mid", "low"]
    out = step(sched)
    assert out.num_scheduled_tokens == {"high": 8}


def test_preemption_by_recompute_and_resume():
    # 6 blocks of 4 tokens; two sequences of 8 prompt tokens each growing to 16 tokens cannot both fit.
    sched = make_scheduler(num_blocks=6, budget=64, max_model_len=24)
    a = make_request("a", 8, max_tokens=8)
    b = make_request("b", 8, max_tokens=8, start=50)
    sched.add_request(a)
    sched.add_request(b)
    preempted = set()
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        preempted |= out.preempted_req_ids
    assert not sched.has_unfinished_requests()
    assert preempted == {"b"}  # the later arrival is the victim
    assert sched.stats.preemptions >= 1 and b.num_preemptions >= 1
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free_blocks == 6


def test_stop_token_min_tokens_and_max_model_len():
    sched = make_scheduler(max_model_len=12)
    r = Request(
        "r",
        [1, 2, 3],
        SamplingParams(max_tokens=20, min_tokens=2),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
    )
    sched.add_request(r)
    step(sched, token=EOS)
    assert not r.is_finished  # EOS before min_tokens does not stop
    step(sched, token=EOS)
    assert r.status is RequestStatus.FINISHED_STOPPED
    long = make_request("long", 10, max_tokens=20, start=30)
    sched.add_request(long)
    for _ in range(5):
        step(sched)
    assert long.status is RequestStatus.FINISHED_LENGTH and long.num_tokens == 12


def test_abort_frees_blocks_and_validation():
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", 10)
    sched.add_request(a)
    step(sched)
    assert sched.kv.block_ids("a")
    sched.abort_requests({"a"})
    assert a.status is RequestStatus.FINISHED_ABORTED and sched.kv.pool.num_free_blocks == 8
    sched.check_integrity()
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("x", 65))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("y", 0))


def test_fork_shares_blocks_then_copies_on_write():
    sched = make_scheduler(budget=64)
    r = Request(
        "p",
        list(range(1, 7)),
        SamplingParams(n=3, max_tokens=4, ignore_eos=True),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
    )
    sched.add_request(r)
    step(sched)
    ids = {rid: sched.kv.block_ids(rid) for rid in ("p", "p#1", "p#2")}
    assert ids["p"] == ids["p#1"] == ids["p#2"] == [0, 1]
    out = step(sched)
    assert len(out.cow_copies) == 2  # two of three sequences copy the shared partial block; the last keeps it
    after = [sched.kv.block_ids(rid) for rid in ("p", "p#1", "p#2")]
    assert all(b[0] == 0 for b in after) and len({b[1] for b in after}) == 3


class _DelayFreeConnector:
    """Scheduler side only: no external hits; asks to keep blocks after finish (an async save in flight)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return object()

    def request_finished(self, request, block_ids):
        return True, KVTransferParams(block_keys=[k.hex() for k in request.block_keys])


def test_delay_free_until_connector_reports_sent():
    sched = make_scheduler(num_blocks=8)
    sched.connector = _DelayFreeConnector()
    r = make_request("r", 6, max_tokens=1)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    assert r.is_finished and r.finished_kv_transfer_params == KVTransferParams(
        block_keys=[k.hex() for k in r.block_keys]
    )
    assert sched.kv.block_ids("r") == [0, 1]  # still held for the connector
    sched.check_integrity()
    out = sched.schedule()
    assert out.finished_req_ids == {"r"}
    sched.update_from_output(out, ModelRunnerOutput(finished_sending={"r"}))
    assert sched.kv.pool.num_free_blocks == 8
    sched.check_integrity()


def test_preemption_victim_is_lowest_priority():
    sched = make_scheduler(num_blocks=6, budget=64, max_model_len=24)
    low = make_request("low", 8, max_tokens=8, priority=1)
    high = make_request("high", 8, max_tokens=8, priority=0, start=50)  # arrives later, more important
    sched.add_request(low)
    sched.add_request(high)
    preempted = set()
    while sched.has_unfinished_requests():
        preempted |= step(sched).preempted_req_ids
    assert preempted == {"low"}
    assert low.output_token_ids == high.output_token_ids == [7] * 8


def test_a_prompt_whose_prefix_is_being_computed_waits_for_it_instead_of_computing_it_again():
    # a and c share a 12-token (3-block) prefix; b shares nothing. All arrive at once.
    sched = make_scheduler(budget=24, num_blocks=64)
    shared = list(range(1, 13))
    a = Request(
        "a",
        shared + [50, 51, 52, 53, 54, 55, 56, 57],
        SamplingParams(max_tokens=2, ignore_eos=True),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
    )
    c = Request(
        "c",
        shared + [90, 91, 92, 93, 94],
        SamplingParams(max_tokens=2, ignore_eos=True),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
    )
    b = make_request("b", 6, max_tokens=2, start=200)
    for req in (a, c, b):
        sched.add_request(req)
    out = step(sched)
    # c would compute a's prefix a second time, so it is held back; b, behind it, has nothing to wait for.
    assert out.num_scheduled_tokens == {"a": 20, "b": 4}, out.num_scheduled_tokens
    out = step(sched)
    # a's prompt (5 full blocks) is cached now: c computes only its own 5 tokens.
    assert out.num_scheduled_tokens["c"] == 5, out.num_scheduled_tokens
    while sched.has_unfinished_requests():
        step(sched)
    assert c.num_cached_tokens == 12, c.num_cached_tokens
    assert sched.stats.computed_tokens == 20 + 5 + 6, "every prompt token was computed exactly once"
    assert sched.stats.prefix_deferrals >= 1


def test_no_deferral_without_prefix_caching():
    sched = Scheduler(
        KVCacheManager(64, BS, enable_caching=False),
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        eos_token_ids=frozenset([EOS]),
    )
    a, c = make_request("a", 12, max_tokens=1), make_request("c", 12, max_tokens=1)
    sched.add_request(a)
    sched.add_request(c)
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 12, "c": 12}
    assert sched.stats.prefix_deferrals == 0


def test_cache_aware_admits_the_fewest_tokens_to_compute_first_and_ages_the_rest():
    now = [0.0]
    sched = make_scheduler(budget=8, num_blocks=64, policy=SchedulingPolicy.CACHE_AWARE, clock=lambda: now[0])
    shared = list(range(1, 13))
    lead = Request(
        "lead",
        shared + [40],
        SamplingParams(max_tokens=1, ignore_eos=True),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
    )
    sched.add_request(lead)
    while sched.has_unfinished_requests():
        step(sched)  # lead's 3 shared blocks are now in the device cache
    long_ = make_request("long", 20, max_tokens=1, start=300)
    hit = Request(
        "hit",
        shared + [41, 42],
        SamplingParams(max_tokens=1, ignore_eos=True),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
    )
    for req in (long_, hit):
        sched.add_request(req)
    # "hit" arrived later but has 2 tokens left to compute, "long" 20: the cache hit goes first.
    out = step(sched)
    assert list(out.num_scheduled_tokens) == ["hit", "long"] and out.num_scheduled_tokens["hit"] == 2, (
        out.num_scheduled_tokens
    )
    while sched.has_unfinished_requests():
        step(sched)
    # Aging: past max_wait_s the oldest goes first whatever its size.
    old = make_request("old", 20, max_tokens=1, start=500)
    sched.add_request(old)
    now[0] += sched.max_wait_s + 1
    short = make_request("short", 3, max_tokens=1, start=700)
    sched.add_request(short)
    out = step(sched)
    assert next(iter(out.num_scheduled_tokens)) == "old", out.num_scheduled_tokens


def _prompt(rid: str, tokens: list[int]) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=1, ignore_eos=True),
        root_key=ROOT,
        block_size=BS,
        arrival=next(_arrival),
        seed=0,
    )


@pytest.mark.parametrize("policy", [SchedulingPolicy.FCFS, SchedulingPolicy.CACHE_AWARE])
def test_cache_aware_starts_the_shared_prefix_group_with_the_fewest_tokens_per_prompt_first(policy):
    """Two prompts behind prefix A arrive first, four behind prefix B after them (12 shared tokens each, one of
    their own): B's leader computes 13 tokens for 4 first tokens, A's 13 for 2, so CACHE_AWARE starts B, and each
    follower then computes only its own token."""
    sched = make_scheduler(budget=13, num_blocks=64, policy=policy, clock=lambda: 0.0)
    a = [_prompt(f"a{i}", list(range(1, 13)) + [50 + i]) for i in range(2)]
    b = [_prompt(f"b{i}", list(range(100, 112)) + [60 + i]) for i in range(4)]
    for req in a + b:
        sched.add_request(req)
    firsts: list[str] = []
    while sched.has_unfinished_requests():
        step(sched)
        firsts += [r.request_id for r in a + b if r.num_output_tokens and r.request_id not in firsts]
    assert firsts[0] == ("b0" if policy is SchedulingPolicy.CACHE_AWARE else "a0"), firsts
    assert sched.stats.computed_tokens == 13 + 1 + 13 + 3, "each prefix computed once, each follower its own token"


def test_a_step_that_finishes_prompts_starts_no_chunk_of_the_next():
    """At `chunk_after_tokens` a step takes no chunk of a prompt it cannot finish (its finishing prompt's first
    token would wait for it); below it, and with None, the budget is filled with a chunk as before."""
    runs = {}
    for after in (8, None):
        sched = make_scheduler(budget=16, num_blocks=64, chunk_after_tokens=after)
        sched.add_request(make_request("a", 10, max_tokens=1))
        sched.add_request(make_request("b", 30, max_tokens=1, start=100))
        runs[after] = [step(sched).num_scheduled_tokens for _ in range(3)]
    assert runs[8][0] == {"a": 10} and runs[8][1] == {"b": 16}, runs[8]
    assert runs[None][0] == {"a": 10, "b": 6}, runs[None]
    sched = make_scheduler(budget=16, num_blocks=64, chunk_after_tokens=8)
    sched.add_request(make_request("c", 4, max_tokens=1))
    sched.add_request(make_request("d", 30, max_tokens=1, start=100))
    assert step(sched).num_scheduled_tokens == {"c": 4, "d": 12}, "under the threshold the step still chunks"
    # Decodes do not count: five of them (over a threshold of 3) still leave the long prompt its chunk.
    sched = make_scheduler(budget=16, num_blocks=64, chunk_after_tokens=3)
    for i in range(5):
        sched.add_request(make_request(f"dec{i}", 2, max_tokens=8, start=10 * i + 1))
    step(sched)
    sched.add_request(make_request("long", 30, max_tokens=1, start=200))
    out = step(sched).num_scheduled_tokens
    assert out == {**{f"dec{i}": 1 for i in range(5)}, "long": 11}, out


class _AlwaysChangedCache(KVCacheManager):
    """A prefix cache that reports a change on every look: the scheduler re-matches every time (no memo)."""

    _ticks = itertools.count()

    @property
    def cache_version(self) -> int:
        return next(self._ticks)


def _run_waiting_behind_a_long_request(kv: KVCacheManager) -> tuple[list[dict[str, int]], int]:
    """One request decodes in a small pool; three others compete for the rest of it, and one of them (preempted)
    waits, ordered again every step, until the long one ends."""
    sched = Scheduler(
        kv,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=64,
        eos_token_ids=frozenset([EOS]),
        policy=SchedulingPolicy.CACHE_AWARE,
        clock=lambda: 0.0,
    )
    sched.add_request(make_request("big", 20, max_tokens=12, start=1))
    step(sched)
    for i, tokens in enumerate((24, 22, 23)):
        sched.add_request(make_request(f"w{i}", tokens, max_tokens=2, start=1 if i != 1 else 100))
    steps = []
    while sched.has_unfinished_requests():
        steps.append(step(sched).num_scheduled_tokens)
    return steps, sched.stats.prefix_matches


def test_admission_order_reuses_prefix_matches_until_the_cache_changes():
    """Remembering each waiting sequence's match (until a block enters or leaves the prefix cache) changes
    nothing that is scheduled, and runs fewer matches than matching every waiting sequence every step."""
    remembered, matches = _run_waiting_behind_a_long_request(KVCacheManager(10, BS))
    every_time, matches_every_time = _run_waiting_behind_a_long_request(_AlwaysChangedCache(10, BS))
    assert remembered == every_time
    assert sum(1 for s in remembered if list(s) == ["big"]) >= 5, "a sequence waited for several steps"
    assert 0 < matches < matches_every_time, (matches, matches_every_time)


def test_prefix_cache_version_changes_when_a_key_enters_or_leaves():
    kv = KVCacheManager(4, BS)
    pool = kv.pool
    (block,) = pool.get_new_blocks(1)
    before = kv.cache_version
    assert pool.cache_block(block, b"k" * 16, b"p" * 16, (1, 2, 3, 4))
    assert kv.cache_version > before
    cached = kv.cache_version
    pool.touch([block])  # references do not change what a lookup returns
    pool.free_blocks([block, block])
    assert kv.cache_version == cached
    pool.get_new_blocks(4)  # reuses the freed block: its key leaves the cache
    assert kv.cache_version > cached
