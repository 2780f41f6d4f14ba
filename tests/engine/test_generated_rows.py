"""Which rows of a step are generated tokens (engine/generated_rows.py): the model runner marks a row by its position
against its request's prompt length, in decode steps, mixed steps and recomputes alike, and `apply` sends each
row through its class's function and puts the rows back in place."""

from __future__ import annotations

import numpy as np
import torch

from engine.generated_rows import GeneratedRows
from engine.model_runner import ModelRunner
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tests.engine.test_scheduler import make_request


def _runner() -> ModelRunner:
    return ModelRunner(model=None, kv_caches=[], block_size=4, device="cpu", eos_token_ids=frozenset())


def test_rows_past_the_prompt_are_generated() -> None:
    decoding = make_request("d", 6)
    decoding.all_token_ids += [50, 51]  # two tokens generated; the step computes the last one
    prefilling = make_request("p", 10)
    recompute = make_request("r", 5)
    recompute.all_token_ids += [60, 61, 62]  # preempted after 3 tokens: prompt and output computed again
    out = SchedulerOutput(
        scheduled_running_reqs=[ScheduledRequest(decoding, [0, 1], 7, 1)],
        scheduled_new_reqs=[ScheduledRequest(prefilling, [2, 3, 6], 4, 6), ScheduledRequest(recompute, [4, 5], 0, 8)],
    )
    _, positions, _, rows = _runner().prepare_inputs(out)
    assert positions.tolist() == [7, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7]
    gen = [0, 12, 13, 14]  # the decode, and the recompute's three outputs
    assert rows.total == 15 and rows.count == 4
    assert rows.generated is not None and rows.generated.tolist() == gen


def test_apply_routes_each_row_and_keeps_the_order() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    mask = np.array([True, False, False, True, False, True])
    rows = GeneratedRows.from_mask(mask, torch.device("cpu"))
    generated_calls: list[int] = []
    got = rows.apply(x, lambda g: generated_calls.append(g.shape[0]) or g + 1000, lambda p: -p)
    assert generated_calls == [3], "the generated rows' function sees those rows only"
    want = torch.where(torch.from_numpy(mask)[:, None], x + 1000, -x)
    assert torch.equal(got, want)
    every = GeneratedRows.from_mask(np.ones(6, bool), torch.device("cpu"))
    assert every.generated is None and torch.equal(every.apply(x, lambda g: g + 1000, lambda p: -p), x + 1000)
    none = GeneratedRows.from_mask(np.zeros(6, bool), torch.device("cpu"))
    assert none.count == 0 and torch.equal(none.apply(x, lambda g: g + 1000, lambda p: -p), -x)


def test_select_keeps_each_chosen_rows_class_in_the_given_order() -> None:
    mask = np.array([False, True, False, False, True, True])
    rows = GeneratedRows.from_mask(mask, torch.device("cpu"))
    picked = rows.select(torch.tensor([5, 0, 3, 1]))
    assert (picked.total, picked.count) == (4, 2)
    assert picked.generated is not None and picked.generated.tolist() == [0, 3]
    only_prompt = rows.select(torch.tensor([0, 2]))
    assert (only_prompt.total, only_prompt.count, only_prompt.generated) == (2, 0, None)
    all_generated = GeneratedRows.from_mask(np.ones(3, dtype=bool), torch.device("cpu")).select(torch.tensor([2]))
    assert (all_generated.total, all_generated.count, all_generated.generated) == (1, 1, None)
