"""The projection-cost benchmark builds the loaded state it claims and reports what it timed."""

from __future__ import annotations

import pytest

from narwhal.bench.cli import main
from narwhal.bench.projection import TARGET_US, ProjectionSettings, measure_projection_cost


def test_it_times_projections_and_dispatcher_passes_on_the_state_asked_for() -> None:
    settings = ProjectionSettings(engines=2, running=40, queued=12, projections=20)
    cost = measure_projection_cost(settings)
    report = cost.as_json()
    assert report["settings"]["running"] == 40 and report["settings"]["queued"] == 12
    for kind in ("projection_us", "dispatch_us"):
        figures = report[kind]
        assert 0 < figures["p50"] <= figures["p99"]
        assert figures["mean"] > 0
    assert report["verdict"] == ("PASS" if cost.projection_mean_us <= TARGET_US else "FAIL")
    assert "2 engines, 40 running, 12 queued" in cost.render()


def test_the_command_line_refuses_an_empty_pool() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["projection", "--engines", "0"])
    assert exited.value.code == 2
