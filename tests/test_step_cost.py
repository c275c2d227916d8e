"""StepCost: the line through the last steps' times, and the budget it gives a target."""

from __future__ import annotations

import pytest

from pagoda.step_cost import MIN_STEP_TOKENS, StepCost


def test_the_fit_recovers_overhead_and_per_token_cost():
    cost = StepCost()
    for n in (10, 40, 100, 400, 25):
        cost.record(n, 0.02 + 0.003 * n)
    overhead, per_token = cost.fit()
    assert overhead == pytest.approx(0.02) and per_token == pytest.approx(0.003)
    assert cost.budget(0.2, 512) == 60  # (0.2 - 0.02) / 0.003
    assert cost.budget(10.0, 512) == 512  # never above the configured budget
    assert cost.budget(0.01, 512) == MIN_STEP_TOKENS  # the overhead alone is over the target


def test_no_fit_before_enough_steps_and_a_line_through_the_origin_for_one_size():
    cost = StepCost()
    cost.record(0, 1.0)  # a step that ran nothing is not evidence
    for _ in range(3):
        cost.record(32, 0.064)
    assert cost.fit() is None and cost.budget(0.1, 512) == 512
    cost.record(32, 0.064)
    assert cost.fit() == pytest.approx((0.0, 0.002))
    assert cost.budget(0.1, 512) == 50


def test_the_window_forgets_old_steps():
    cost = StepCost(window=4)
    for n in (10, 20, 30, 40):
        cost.record(n, 0.001 * n)  # a fast machine
    for n in (10, 20, 30, 40):
        cost.record(n, 0.010 * n)  # then something shares it
    assert cost.fit() == pytest.approx((0.0, 0.010))
