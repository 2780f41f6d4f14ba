"""The node's JobRunner in process, with each role's worker: jobs in, wire messages out, no sockets.

Mostly on tests/node_helpers.FakeEngine (no model, steps on demand); one test on the real engine with the embedded
model checks the seam the fake stands in for (EngineCore.add_request's block keys, load(), the first token)."""

from __future__ import annotations

import pytest

from common.keys import block_keys, root_key
from decode_node.worker import DecodeWorker
from node.job import RoleWorker
from node.key_cache import RecentKeys
from node.runner import JobRunner
from prefill_node.worker import PrefillWorker
from protocol import messages as P
from tests.node_helpers import EXPLODE, HOLD, VOCAB, FakeEngine

PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16


def _runner(worker: RoleWorker, engine=None) -> tuple[JobRunner, FakeEngine]:
    engine = engine or FakeEngine()
    return JobRunner(engine, worker, RecentKeys(64)), engine


def _drain(runner: JobRunner, max_steps: int = 10_000) -> list[P.Message]:
    """Step until the runner holds nothing; fails past `max_steps` (the fake's jobs end in a few)."""
    out: list[P.Message] = []
    for _ in range(max_steps):
        if not runner.busy:
            return out
        out += runner.step()
    raise AssertionError(f"the runner still holds jobs after {max_steps} steps")


def test_prefill_worker_answers_prefill_done_and_publishes_the_prompt_keys() -> None:
    runner, engine = _runner(PrefillWorker())
    assert runner.submit(P.PrefillJob("r1", PROMPT, P.SamplingSpec(max_tokens=8), cache_salt="t")) == []
    (done,) = _drain(runner)
    assert isinstance(done, P.PrefillDone) and done.request_id == "r1" and done.first_token_id == 1
    assert not done.finished and done.finish_reason is None  # max_tokens=1 ends with "length", not the request
    assert done.cache.prompt_tokens == len(PROMPT)
    ns = engine.namespace
    assert runner.recent_keys.snapshot() == block_keys(root_key(ns, "t"), PROMPT, ns.block_size)
    assert runner.counters.prefill_started == 1 and not runner.jobs


@pytest.mark.parametrize("first", [7, None], ids=["from-the-store", "local-prefill"])
def test_decode_worker_streams_token_batches(first: int | None) -> None:
    runner, engine = _runner(DecodeWorker())
    job = P.DecodeJob("r1", PROMPT, P.SamplingSpec(max_tokens=100), first_token_id=first)
    assert runner.submit(job) == []
    assert engine.scheduler.running[0].prompt == (PROMPT + [first] if first is not None else PROMPT)
    batches = _drain(runner)
    assert all(isinstance(b, P.TokenBatch) for b in batches) and len(batches) == 2  # 64 tokens per fake step
    assert sum(len(b.token_ids) for b in batches) == 100
    assert [b.finished for b in batches] == [False, True] and batches[-1].finish_reason is P.FinishReason.LENGTH
    assert batches[0].cache is not None and batches[1].cache is None  # where the prompt came from: once
    assert (runner.counters.decode_started, runner.counters.local_prefill_started) == (1, int(first is None))


def test_jobs_the_role_does_not_take_or_out_of_bounds_or_duplicate_are_refused() -> None:
    runner, engine = _runner(DecodeWorker(colocated=True))
    spec = P.SamplingSpec(max_tokens=2)
    (wrong,) = runner.submit(P.PrefillJob("p", PROMPT, spec))
    assert isinstance(wrong, P.JobFailed) and "both node takes no PrefillJob" in wrong.message
    (bad,) = runner.submit(P.DecodeJob("b", [VOCAB], spec))
    assert isinstance(bad, P.JobFailed) and bad.message.startswith("bad job")
    assert runner.submit(P.DecodeJob("d", PROMPT, spec)) == []
    (dup,) = runner.submit(P.DecodeJob("d", PROMPT, spec))
    assert isinstance(dup, P.JobFailed) and "duplicate" in dup.message
    assert engine.added == ["d"] and runner.counters.refused == 3


def test_a_step_that_raises_fails_the_running_jobs_only() -> None:
    runner, engine = _runner(DecodeWorker())
    spec = P.SamplingSpec(max_tokens=4)
    runner.submit(P.DecodeJob("held", PROMPT, spec, cache_salt=HOLD))
    runner.submit(P.DecodeJob("bomb", PROMPT, spec, cache_salt=EXPLODE))
    (failed,) = runner.step()
    assert isinstance(failed, P.JobFailed) and failed.request_id == "bomb" and "engine step failed" in failed.message
    assert list(runner.jobs) == ["held"] and engine.aborted == ["bomb"]
    assert (runner.counters.step_errors, runner.counters.failed) == (1, 1)


def test_an_aborted_job_sends_nothing_more() -> None:
    runner, engine = _runner(DecodeWorker())
    runner.submit(P.DecodeJob("r1", PROMPT, P.SamplingSpec(max_tokens=500)))
    assert runner.step()  # first tokens
    runner.abort(["r1", "unknown"])
    assert _drain(runner) == [] and engine.aborted == ["r1"] and runner.counters.aborted == 1


def test_on_the_real_engine(smollm2_fp32) -> None:
    from engine import EngineCore
    from engine.config import CacheConfig, EngineConfig

    config = EngineConfig(model="smollm2-135m", dtype="float32", cache=CacheConfig(kv_cache_memory="16MiB"))
    engine = EngineCore(config, loaded_model=smollm2_fp32)
    runner, _ = _runner(PrefillWorker(), engine)
    prompt = smollm2_fp32.tokenizer.encode("The capital of France is the city of Paris, and the capital of Italy is")
    runner.submit(P.PrefillJob("r1", prompt, P.SamplingSpec(max_tokens=4, temperature=0.0)))
    load = engine.load()
    assert (load.running, load.waiting, load.connector) == (0, 1, None) and load.free_blocks == load.num_blocks
    assert runner.recent_keys.snapshot() == block_keys(root_key(engine.namespace), prompt, 16)
    (done,) = _drain(runner)
    assert isinstance(done, P.PrefillDone) and done.kv_transfer_params is None  # no connector, nothing to hand on
    assert smollm2_fp32.tokenizer.decode([done.first_token_id]).strip() == "Rome"
    assert engine.load().stats.prompt_tokens == len(prompt) and engine.load().kv_usage < 1.0
