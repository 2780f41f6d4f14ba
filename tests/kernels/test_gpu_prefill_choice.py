"""The CUDA prefill choice's rules (ucm_kernels/gpu_prefill_choice.py) on given timings; test_kernels_gpu.py runs the
dispatch itself on a GPU."""

from __future__ import annotations

import pytest

from ucm_kernels.cpu.calibration import ShapeClass
from ucm_kernels.gpu_prefill_choice import LENGTHS, GpuPrefillPlan, LengthTiming, crossover


def timings(torch_wins: set[int]) -> tuple[LengthTiming, ...]:
    return tuple(LengthTiming(n, 2.0, 1.0 if n in torch_wins else 3.0) for n in LENGTHS)


def test_crossover_is_where_torch_wins_from_on():
    assert crossover(timings({2048, 4096, 8192})) == 2048
    assert crossover(timings(set())) is None
    assert crossover(timings(set(LENGTHS))) == LENGTHS[0]


def test_a_win_the_longer_lengths_lose_again_is_not_a_crossover():
    assert crossover(timings({256, 512, 8192})) == 8192
    assert crossover(timings({256, 512})) is None, "Triton won the longest: no length runs torch"


def test_a_tie_goes_to_triton():
    tied = tuple(LengthTiming(n, 1.0, 1.0) for n in LENGTHS)
    assert crossover(tied) is None


def test_short_calls_run_triton_without_asking_for_the_sync():
    plan = GpuPrefillPlan({ShapeClass.PROMPT: timings({4096, 8192}), ShapeClass.CHUNK: timings({8192})})

    def no_sync() -> bool:
        raise AssertionError("the whole-prompt check syncs the device: short calls must not ask")

    assert not plan.runs_torch(4095 * 3, 3, no_sync)
    assert not plan.runs_torch(100, 0, no_sync)


@pytest.mark.parametrize(
    "per_seq,whole,want",
    [(4096, True, True), (4096, False, False), (8192, False, True), (8192, True, True), (2048, True, False)],
)
def test_long_calls_go_by_their_class(per_seq, whole, want):
    plan = GpuPrefillPlan({ShapeClass.PROMPT: timings({4096, 8192}), ShapeClass.CHUNK: timings({8192})})
    asked = []

    def whole_prompts() -> bool:
        asked.append(True)
        return whole

    assert plan.runs_torch(per_seq * 2, 2, whole_prompts) is want
    assert asked == ([True] if per_seq >= 4096 else []), "asked only past the shortest crossover"


def test_a_plan_covers_both_prefill_classes():
    with pytest.raises(AssertionError, match="covers"):
        GpuPrefillPlan({ShapeClass.PROMPT: timings(set())})
