"""Drift (pure): the running ratios, their states and the placement penalty."""

from __future__ import annotations

import pytest

from narwhal.scheduling.drift import FLOOR_S, Drift


def feed(drift: Drift, ratio: float, count: int, *, predicted: float = 0.1) -> list[str]:
    observed = (predicted + FLOOR_S) * ratio - FLOOR_S
    return [drift.observe_ttft(observed, predicted) for _ in range(count)]


def test_on_the_forecast_it_warms_up_then_is_ok() -> None:
    drift = Drift()
    states = feed(drift, 1.0, 10)
    assert states == ["warming"] * 9 + ["ok"]
    assert drift.penalty == 1.0 and not drift.wants_profile


def test_a_2x_slowdown_is_sustained_drift_within_a_dozen_requests() -> None:
    drift = Drift()
    feed(drift, 1.0, 20)
    states = feed(drift, 2.0, 30)
    # The average is 2 - 0.8**n after n slow requests: above 1.5 from the 4th, 8 in a row at
    # the 11th.
    assert states.index("sustained") == 10
    assert drift.wants_profile
    assert drift.penalty == pytest.approx(drift.ttft.ratio) and drift.penalty > 1.9


def test_beyond_3x_is_severe_and_a_reset_starts_again() -> None:
    drift = Drift()
    feed(drift, 1.0, 10)
    assert feed(drift, 4.0, 30)[-1] == "severe"
    drift.reset()
    assert drift.state == "warming" and drift.penalty == 1.0


def test_a_faster_engine_is_fast_and_not_penalised() -> None:
    drift = Drift()
    assert feed(drift, 0.5, 20)[-1] == "fast"
    assert drift.penalty == 1.0 and drift.wants_profile


def test_tpot_drift_counts_too_and_the_snapshot_shows_both() -> None:
    drift = Drift()
    for _ in range(20):
        drift.observe_tpot(0.02, 0.01 - FLOOR_S / 3)
    stats = drift.statistics()
    assert stats.state == "sustained"
    assert stats.as_json() == {"ttft": 1.0, "tpot": round(stats.tpot, 3), "state": "sustained"}


def test_tiny_predictions_are_not_drift() -> None:
    drift = Drift()
    for _ in range(20):
        drift.observe_ttft(0.004, 0.002)  # twice the prediction, but only 2 ms apart
    assert drift.state == "ok"
