"""benchmarks.mixed_steps' table: what prompt tokens add to a decode step, per token and against a prompt step's."""

from __future__ import annotations

import pytest

from benchmarks.mixed_steps import mixed_rows


def test_rows_take_each_arms_median_over_the_decodes_alone() -> None:
    steps = {0: [80.0, 90.0, 85.0], 64: [150.0, 160.0, 155.0], 512: [650.0, 640.0], 2040: [2400.0, 2480.0, 2525.0]}
    rows = mixed_rows(steps)
    assert [r.prompt_tokens for r in rows] == [0, 64, 512, 2040]
    assert rows[0].step_ms == 85.0 and rows[0].added_ms == 0.0
    assert rows[1].added_ms == pytest.approx(70.0) and rows[1].per_token_ms == pytest.approx(70.0 / 64)
    # The baseline is the cheapest prompt step per token (512 here: 560 / 512 < 2395 / 2040).
    assert rows[2].of_prompt_step == pytest.approx(1.0)
    assert rows[3].of_prompt_step == pytest.approx((2395.0 / 2040) / (560.0 / 512))
    # Reads hiding products would show as a small P's tokens costing well under a prompt step's.
    assert rows[1].of_prompt_step == pytest.approx((70.0 / 64) / (560.0 / 512))


def test_without_a_prompt_step_the_largest_p_is_the_baseline() -> None:
    rows = mixed_rows({0: [80.0], 64: [150.0], 256: [400.0]})
    assert rows[2].of_prompt_step == pytest.approx(1.0)
    assert rows[1].of_prompt_step == pytest.approx((70.0 / 64) / (320.0 / 256))


def test_rows_need_the_decodes_alone_and_a_prompt_arm() -> None:
    with pytest.raises(ValueError, match="P = 0"):
        mixed_rows({64: [150.0]})
    with pytest.raises(ValueError, match="P = 0"):
        mixed_rows({0: [80.0]})
    with pytest.raises(ValueError, match="P = 0"):
        mixed_rows({0: [80.0], 64: []})
