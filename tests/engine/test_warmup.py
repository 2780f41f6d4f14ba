"""The warm-up a node runs before it registers (engine/warmup.py): afterwards the first requests measure nothing,
nothing reached the store, the counters start at zero, and outputs are those of an engine that never warmed up."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import SamplingParams
from engine.warmup import thread_counts, warm_up
from tests.engine_helpers import make_llm
from ucm_kernels.choice_memo import ChoiceMemo


def forget_every_choice() -> None:
    """This process forgets what it measured (each choice is then read from its cache file, or measured, again)."""
    # type(o), not isinstance: isinstance asks every object for __class__, and torch.distributed.reduce_op warns on it
    for memo in [o for o in gc.get_objects() if issubclass(type(o), ChoiceMemo)]:
        memo.clear()


@pytest.fixture
def made_choices(monkeypatch):
    """Every choice a ChoiceMemo had to make (measure, or read from the cache file) rather than remember."""
    made: list[object] = []
    original = ChoiceMemo.get_or_make

    def recording(self, key, make):
        def noted():
            made.append(key)
            return make()

        return original(self, key, noted)

    monkeypatch.setattr(ChoiceMemo, "get_or_make", recording)
    return made


def test_thread_counts_cover_what_the_governor_can_pick() -> None:
    assert thread_counts(1) == (1,) and thread_counts(2) == (2, 1) and thread_counts(4) == (4, 3, 2, 1)
    assert thread_counts(16) == (16, 8, 1)


def _requests(llm):
    prompts = [[1000 + (37 * i * j) % 30000 for j in range(n)] for i, n in enumerate((300, 40, 75, 5), start=1)]
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    sampled = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=3)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy, sampled, greedy, sampled])


def test_after_the_warm_up_the_first_requests_measure_nothing(smollm2_fp32, made_choices, tmp_path) -> None:
    # At every thread count the governor may switch to (the choices are the host's, ucm_kernels/cpu/choice_threads.py,
    # but oneDNN builds its primitives per thread count): mid-serving, on a host busy enough to have made the
    # governor switch, nothing is measured or built.
    cold = make_llm(smollm2_fp32, kv_store=f"embedded?disk_path={tmp_path / 'a'}")
    try:
        expected = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in _requests(cold)]
    finally:
        cold.close()
    before, widest = torch.get_num_threads(), 2  # a 2-core machine's count
    torch.set_num_threads(widest)
    llm = make_llm(smollm2_fp32, kv_store=f"embedded?disk_path={tmp_path / 'b'}")
    try:
        engine = llm.engine
        forget_every_choice()  # what the engine's construction chose: the warm-up's steps must choose it again
        made_choices.clear()
        report = warm_up(engine)
        assert made_choices, "the warm-up made the choices this process had forgotten"
        assert report.thread_counts == thread_counts(widest) and report.steps > 0
        assert engine.stats().steps == 0 and engine.stats().computed_tokens == 0, "the counters start at zero"
        engine.kv_store.flush()
        assert sum(t.blocks for t in engine.kv_store.stats().tiers.values()) == 0, "the warm-up saved nothing"
        assert engine.kv_manager.pool.stats().num_cached == 0, "nor left a block in the device prefix cache"
        made_choices.clear()
        governor, engine.governor = engine.governor, None  # the counts are the test's to set
        runs = {}
        for threads in report.thread_counts:
            torch.set_num_threads(threads)
            runs[threads] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in _requests(llm)]
            assert made_choices == [], f"requests at {threads} thread(s) still made choices: {made_choices}"
            engine.kv_manager.pool.reset_prefix_cache()
        engine.governor = governor
    finally:
        torch.set_num_threads(before)
        llm.close()
    assert runs[widest] == expected, "a warmed-up engine answers as a cold one"
