"""The benchmark's engines behave as their truth says, not as the router's prior says."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import trio
import trio.testing

from narwhal.bench.admission_report import _engines
from narwhal.bench.cli import _admission_arguments, admission_settings, main
from narwhal.bench.inprocess import EngineTruth, Slowdown, open_fleet
from narwhal.bench.replay import default_router
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.calibration import VARIATION, engine_type
from narwhal.sim.timing import StepTiming


def test_a_slowdown_reads_engine_at_factor() -> None:
    slowdown = Slowdown.parse("engine-b@0.5:2.0")
    assert slowdown == Slowdown("engine-b", 0.5, 2.0)
    assert str(slowdown) == "engine-b@0.5:2"
    for text in ("engine-b", "engine-b@0.5", "@0.5:2", "engine-b@x:2", "e@1.5:2", "e@0.5:0"):
        with pytest.raises(ValueError):
            Slowdown.parse(text)


def test_the_truth_picks_each_engines_type_scale_and_variation() -> None:
    truth = EngineTruth(types=("h100", "a100"), scale=2.0)
    assert [truth.engine_type("h100-llama3-8b", i) for i in range(3)] == [
        "h100-llama3-8b",
        "a100-llama3-8b",
        "h100-llama3-8b",
    ]
    timing = truth.timing("a100-llama3-8b", seed=4)
    assert isinstance(timing, StepTiming)
    assert timing.profile == engine_type("a100").varied(4, VARIATION).scaled(2.0)
    assert EngineTruth().engine_type("a100-llama3-8b", 5) == "a100-llama3-8b"
    prior = EngineTruth(prior=True, scale=2.0).timing("h100-llama3-8b", seed=4, time_scale=0.5)
    assert isinstance(prior, StepTiming)
    assert prior.profile is get_profile("h100-llama3-8b") and prior.time_scale == 1.0
    assert EngineTruth(slowdowns=(Slowdown("engine-b", 0.5, 2.0),)).as_json() == {
        "types": [],
        "scale": 1.0,
        "variation": VARIATION,
        "prior": False,
        "slowdowns": ["engine-b@0.5:2"],
    }


def test_the_router_is_told_each_engines_type() -> None:
    router = default_router(3, types=("h100", "a100"))
    assert [e.profile for e in router.engines] == [
        "h100-llama3-8b",
        "a100-llama3-8b",
        "h100-llama3-8b",
    ]
    assert {e.profile for e in default_router(2).engines} == {"h100-llama3-8b"}


def _settings(*argv: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    _admission_arguments(parser)
    return admission_settings(parser.parse_args(["--jobs", "1", *argv]))


def test_the_command_line_options() -> None:
    plain = _settings()
    assert len(plain.setup.router.engines) == 2 and plain.setup.truth == EngineTruth()
    headline = _settings(
        "--engines", "h100,a100", "--truth-scale", "2", "--slowdown", "engine-b@0.5:2.0"
    )
    setup = headline.setup
    assert [e.profile for e in setup.router.engines] == ["h100-llama3-8b", "a100-llama3-8b"]
    assert setup.truth == EngineTruth(
        types=("h100", "a100"), scale=2.0, slowdowns=(Slowdown("engine-b", 0.5, 2.0),)
    )
    assert headline.as_json()["engine_truth"]["scale"] == 2.0
    assert _settings("--engine-truth", "prior").setup.truth.prior
    for argv in (
        ["--engines", "h100,tpu"],
        ["--engines", "0"],
        ["--slowdown", "engine-z@0.5:2"],
        ["--slowdown", "engine-b@2:2"],
    ):
        with pytest.raises(ValueError):
            _settings(*argv)
    assert main(["admission", "--engines", "tpu"]) == 2


def test_a_narwhal_config_without_engines_sets_admission(tmp_path: Path) -> None:
    # The benchmark supplies the engines: the file a user writes holds the settings it tries.
    base = tmp_path / "base.toml"
    base.write_text("[admission]\nqueue_limit = 64\n")
    settings = _settings("--narwhal-config", str(base))
    assert settings.setup.router.admission.queue_limit == 64
    assert len(settings.setup.router.engines) == 2


def test_placement_keeps_no_tpot_target_unless_asked() -> None:
    # The bound is the engines' full-batch capacity: a TPOT target that a 2x-slow engine's
    # full batch misses would hold every mode below it (the wrong-prior headline lost 10
    # points of goodput at 2x to it).
    plain = _settings()
    assert math.isinf(plain.setup.router.admission.tpot_target_s)
    assert plain.as_json()["admission"]["tpot_target_s"] is None
    held = _settings("--tpot-target-s", "0.1")
    assert held.setup.router.admission.tpot_target_s == 0.1
    assert held.as_json()["admission"]["tpot_target_s"] == 0.1


async def test_a_fleet_of_two_engine_types_and_a_slowdown_half_way(
    autojump_clock: trio.testing.MockClock,
) -> None:
    truth = EngineTruth(
        types=("h100", "a100"), scale=2.0, slowdowns=(Slowdown("engine-b", 0.5, 3.0),)
    )
    config = default_router(2, types=truth.types)
    with trio.fail_after(600):
        async with open_fleet(config, truth=truth, seed=10, span_s=100.0) as fleet:
            start = trio.current_time()
            a, b = fleet.engines["engine-a"], fleet.engines["engine-b"]
            assert isinstance(a.timing, StepTiming) and isinstance(b.timing, StepTiming)
            assert a.timing.profile == engine_type("h100").varied(10).scaled(2.0)
            assert b.timing.profile == engine_type("a100").varied(11).scaled(2.0)
            assert b.slowdown == 1.0
            await trio.sleep_until(start + 50.0)
            assert b.slowdown == 3.0 and a.slowdown == 1.0
            fleet.nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="engine-z"):
        bad = EngineTruth(slowdowns=(Slowdown("engine-z", 0.5, 2.0),))
        async with open_fleet(config, truth=bad):
            pass


def test_the_report_names_each_engine_type() -> None:
    headline = _settings("--engines", "h100,a100").as_json()
    assert _engines(headline) == "h100-llama3-8b + a100-llama3-8b"
    assert _engines(_settings().as_json()) == "2 x h100-llama3-8b"
