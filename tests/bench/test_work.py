"""Engine work is weighed with the engines' true cost, in one unit for capacity and goodput."""

from __future__ import annotations

import attrs
import pytest

from narwhal.bench.admission import capacity_phases
from narwhal.bench.goodput import Capacity, Work, engine_seconds
from narwhal.bench.inprocess import EngineTruth, Slowdown
from narwhal.bench.replay import CapacityJob, VirtualSetup, default_router, measure_capacity
from narwhal.scheduling.profiles import EngineProfile, get_profile
from narwhal.sim.calibration import VARIATION, engine_type

UNIT = EngineProfile(
    name="unit",
    prefill_base_ms=5.0,
    prefill_per_token_ms=1.0,
    prefill_quadratic_ms=0.0,
    decode_base_ms=0.0,
    decode_per_seq_ms=1.0,
    decode_per_kv_token_ms=0.0,
    max_num_seqs=1,
)


def test_a_request_is_its_true_cost_averaged_over_the_pool() -> None:
    # 100 prompt tokens at 1 ms, 10 decode steps at 1 ms: 0.110 s on one engine, 0.220 s on an
    # engine twice as slow; the pool of both weighs it 0.165 s wherever it runs.
    work = Work(((UNIT, 1.0), (UNIT, 2.0)))
    assert work.parts(100, 11) == pytest.approx((0.150, 0.015))
    assert work.seconds(100, 11) == pytest.approx(0.165)
    assert Work.of(UNIT).seconds(100, 11) == pytest.approx(engine_seconds(UNIT, 100, 11))
    assert work.mean([]) == 0.0


def test_the_setup_weighs_work_with_each_engines_truth_not_the_routers_profile() -> None:
    mixed = VirtualSetup(default_router(types=("h100", "a100")), truth=EngineTruth(types=()))
    work = mixed.work()
    assert work.names == ("h100-llama3-8b", "a100-llama3-8b")
    h100 = engine_type("h100").varied(0, VARIATION)
    a100 = engine_type("a100").varied(1, VARIATION)
    expected = (engine_seconds(h100, 1000, 200) + engine_seconds(a100, 1000, 200)) / 2
    assert work.seconds(1000, 200) == pytest.approx(expected)
    # The router's profile of the same engines says otherwise, and plays no part.
    prior = get_profile("h100-llama3-8b")
    assert work.seconds(1000, 200) != pytest.approx(engine_seconds(prior, 1000, 200), rel=0.01)
    # Engines really twice as slow are twice the work per request; the capacity in the same
    # unit halves, so the ratios are unchanged.
    slow = attrs.evolve(mixed, truth=EngineTruth(scale=2.0))
    assert slow.work().seconds(1000, 200) == pytest.approx(2 * work.seconds(1000, 200))
    # Only with the prior as the truth is the router's profile the cost (times the scale).
    as_prior = attrs.evolve(mixed, truth=EngineTruth(prior=True, scale=2.0))
    h100_prior, a100_prior = get_profile("h100-llama3-8b"), get_profile("a100-llama3-8b")
    expected = engine_seconds(h100_prior, 1000, 200) + engine_seconds(a100_prior, 1000, 200)
    assert as_prior.work().seconds(1000, 200) == pytest.approx(expected)
    assert work.as_json()["engines"] == ["h100-llama3-8b", "a100-llama3-8b"]


def test_the_capacity_is_time_weighted_over_the_states_of_a_slowdown() -> None:
    # A replay's window is its span after the first 20 %; engine-b turns 2x slower half way:
    # the window spends (0.5 - 0.2) / 0.8 of its length before, the rest after.
    slow = Slowdown.parse("engine-b@0.5:2.0")
    phases = capacity_phases([slow], 0.2)
    assert [(p.slowdowns, p.share) for p in phases] == [
        ((), pytest.approx(0.375)),
        (("engine-b@0.5:2",), pytest.approx(0.625)),
    ]
    assert [(p.slowdowns, p.share) for p in capacity_phases([], 0.2)] == [((), 1.0)]
    # One in the warm-up is in force the whole window; two make three states.
    early = Slowdown.parse("engine-a@0.1:3")
    assert [p.slowdowns for p in capacity_phases([early], 0.2)] == [("engine-a@0.1:3",)]
    both = capacity_phases([slow, Slowdown.parse("engine-a@0.6:1.5")], 0.2)
    assert [p.slowdowns for p in both] == [
        (),
        ("engine-b@0.5:2",),
        ("engine-b@0.5:2", "engine-a@0.6:1.5"),
    ]
    fast = Capacity(rps=20.0, engine_s_per_s=2.0, completed=100)
    slower = Capacity(rps=15.0, engine_s_per_s=1.5, completed=80)
    weighted = Capacity.time_weighted([(phases[0], fast), (phases[1], slower)])
    assert weighted.engine_s_per_s == pytest.approx(0.375 * 2.0 + 0.625 * 1.5)
    assert weighted.rps == pytest.approx(0.375 * 20 + 0.625 * 15)
    assert weighted.completed == 100  # the other figures: the first state's
    assert [p.engine_s_per_s for p in weighted.phases] == [2.0, 1.5]
    assert weighted.as_json()["phases"][1]["slowdowns"] == ["engine-b@0.5:2"]


def test_the_capacity_loop_runs_with_its_slowdowns_in_force() -> None:
    setup = VirtualSetup(default_router(), duration_s=30.0)
    job = CapacityJob(setup, concurrency=96, warmup_s=2.0, window_s=4.0)
    slowed = attrs.evolve(
        setup,
        truth=attrs.evolve(setup.truth, slowdowns=(Slowdown.parse("engine-b@0.5:2.0"),)),
    )
    base = measure_capacity(job)
    after = measure_capacity(attrs.evolve(job, setup=slowed))
    # One engine of two at half speed: between half and all of the requests per second (the
    # load axis, by the cost model).
    assert 0.6 * base.rps < after.rps < 0.9 * base.rps
    # In engine time the slowed engine is still an engine, busy all the time: the ledger
    # charges its requests the longer time they take.
    assert after.busy_s_per_s is not None and after.busy_s_per_s > 1.95
