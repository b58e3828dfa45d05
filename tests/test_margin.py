"""The learned safety margin of predictive admission."""

from __future__ import annotations

import pytest

from narwhal.admission.margin import SafetyMargin


def test_until_enough_requests_taught_it_the_factor_is_the_prior() -> None:
    margin = SafetyMargin()
    for _ in range(31):
        margin.observe(1.0, 1.0, budget_s=2.0)
    assert margin.factor == 2.0
    margin.observe(1.0, 1.0, budget_s=2.0)
    assert margin.factor == margin.least


def test_the_factor_is_the_99th_percentile_of_observed_over_projected() -> None:
    margin = SafetyMargin(window=100)
    for number in range(100):
        margin.observe(1.0, 1.0 + number / 50, budget_s=2.0)  # ratios 1.00 .. 2.98
    assert margin.factor == pytest.approx(2.98)


def test_short_projections_do_not_teach() -> None:
    # A 40 ms projection that took 80 ms says nothing about a queue near the budget.
    margin = SafetyMargin(min_samples=1)
    margin.observe(0.04, 0.08, budget_s=2.0)
    assert margin.samples == 0 and margin.factor == margin.prior


def test_the_factor_never_goes_below_its_floor() -> None:
    margin = SafetyMargin(min_samples=1)
    for _ in range(50):
        margin.observe(1.0, 0.5, budget_s=2.0)
    assert margin.factor == margin.least == 1.1


def test_the_window_forgets_old_errors() -> None:
    margin = SafetyMargin(window=10, min_samples=1)
    for _ in range(10):
        margin.observe(1.0, 3.0, budget_s=2.0)
    assert margin.factor == 3.0
    for _ in range(10):
        margin.observe(1.0, 1.5, budget_s=2.0)
    assert margin.factor == 1.5
