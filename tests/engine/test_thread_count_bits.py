"""An engine gives the same greedy tokens and logprobs, bit for bit, on one thread as on every core: each kernel's
row bits do not depend on the thread count, and every kernel choice is made for the host's count, not the process's
(ucm_kernels/cpu/choice_threads.py). A node of a split on a small host runs on 1 thread, an engine alone on all of
them, and the governor moves a step between the two: KV one of them stores is what the other would compute."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ADAPTIVE_THREADS_ENV
from ucm_kernels.cpu import choice_threads as ct


def _greedy(dtype: str, threads: int) -> list[tuple]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # from the model's load on: packing makes choices too
    try:
        llm = LLM(model="smollm2-135m", dtype=dtype, enable_prefix_caching=False, kv_cache_memory="64MiB")
        rng = random.Random(3)
        prompts = [[rng.randrange(1000, 40000) for _ in range(40 + 60 * i)] for i in range(4)]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.close()
    finally:
        torch.set_num_threads(before)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_one_thread_and_every_core_give_the_same_bits(dtype, monkeypatch) -> None:
    monkeypatch.setenv(ADAPTIVE_THREADS_ENV, "0")  # each engine on the count given it
    host = ct.choice_threads()
    if host < 2:
        pytest.skip("one CPU here: no second thread count to compare")
    widest, one = _greedy(dtype, host), _greedy(dtype, 1)
    assert [t for t, _ in one] == [t for t, _ in widest], "greedy tokens changed with the thread count"
    assert one == widest, "logprobs changed with the thread count: some kernel or choice follows it"


def test_a_measurement_runs_at_the_hosts_count_and_gives_the_callers_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ct.measuring_at(3):
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 1, "the caller's count restored"
        with pytest.raises(RuntimeError), ct.measuring_at(2):
            raise RuntimeError("a failed measurement")
        assert torch.get_num_threads() == 1, "restored after a failure too"
    finally:
        torch.set_num_threads(before)
