"""The admission benchmark's arithmetic: outcomes, goodput, bound, fractions, verdicts (pure)."""

from __future__ import annotations

import attrs
import pytest

from narwhal.bench.admission import sample_refusals
from narwhal.bench.admission_report import AdmissionReport, render_checks, render_runs
from narwhal.bench.goodput import (
    Bar,
    Capacity,
    Check,
    Displacement,
    FalseRefusals,
    Outcome,
    Prediction,
    PredictionError,
    ReplayFigures,
    Window,
    bound,
    displaced,
    engine_seconds,
    evaluate,
    outcome_label,
    overall_verdict,
    replay_figures,
    safe_ratio,
)
from narwhal.scheduling.profiles import EngineProfile

# One millisecond per prompt token, none for attention, a 1 ms decode step per token in a
# batch of one: engine seconds are easy to count by hand.
PROFILE = EngineProfile(
    name="test",
    prefill_base_ms=5.0,
    prefill_per_token_ms=1.0,
    prefill_quadratic_ms=0.0,
    decode_base_ms=0.0,
    decode_per_seq_ms=1.0,
    decode_per_kv_token_ms=0.0,
    max_num_seqs=1,
)


def served(index: int, at: float, ttft: float, *, prompt: int = 100, output: int = 11) -> Outcome:
    return Outcome(index, at, prompt, output, 200, None, ttft, at + ttft + 1.0)


def failed(index: int, at: float, status: int, code: str) -> Outcome:
    return Outcome(index, at, 100, 11, status, code, None, None)


def test_outcome_classes() -> None:
    assert served(0, 0.0, 0.5).admitted and served(0, 0.0, 0.5).completed
    refused = failed(1, 0.0, 429, "ttft_budget_exceeded")
    assert refused.refused and not refused.admitted
    assert not failed(2, 0.0, 429, "admission_queue_full").refused
    assert not failed(3, 0.0, 503, "backend_unavailable").admitted
    expired = failed(4, 0.0, 504, "admission_wait_expired")
    assert expired.admitted and not expired.in_budget(2.0)
    in_band = Outcome(5, 0.0, 100, 11, 200, "engine_error", 0.1, None)
    assert in_band.admitted and not in_band.completed and in_band.in_budget(2.0)
    assert served(6, 0.0, 2.0).in_budget(2.0)  # at the budget is inside it
    assert not served(6, 0.0, 2.001).in_budget(2.0)
    assert outcome_label(served(0, 0.0, 1.0)) == "200"
    assert outcome_label(refused) == "429 ttft_budget_exceeded"
    assert outcome_label(Outcome(7, 0.0, 1, 1, 0, None, None, None)) == "0"


def test_engine_seconds_prefill_work_plus_a_decode_share_per_later_token() -> None:
    # 100 prompt tokens at 1 ms (no fixed prefill cost), then 10 decode steps at 1 ms.
    assert engine_seconds(PROFILE, 100, 11) == pytest.approx(0.110)
    assert engine_seconds(PROFILE, 100, 1) == pytest.approx(0.100)
    assert engine_seconds(PROFILE, 0, 0) == 0.0


def test_bound_and_ratios() -> None:
    assert bound(10.0, 4.0) == 4.0
    assert bound(3.0, 4.0) == 3.0
    assert safe_ratio(1.0, 4.0) == 0.25
    assert safe_ratio(1.0, 0.0) is None
    assert safe_ratio(None, 1.0) is None


def test_window_leaves_out_the_warm_up() -> None:
    outcomes = [served(i, float(i), 0.1) for i in range(11)]
    window = Window.of(outcomes, 0.2)
    assert (window.start_s, window.end_s, window.length_s) == (2.0, 10.0, 8.0)
    assert window.holds(2.0) and window.holds(10.0) and not window.holds(1.9)
    assert not window.holds(None)
    assert Window.of([], 0.1).length_s == 0.0


def test_prediction_error_is_relative_to_the_observed_time() -> None:
    error = PredictionError.of([(1.1, 1.0), (0.5, 1.0), (2.0, 2.0), (1.0, 0.0)])
    assert error.count == 3  # the pair observed at 0 is skipped
    assert error.median_abs == pytest.approx(0.1)
    assert error.median_signed == pytest.approx(0.0)
    assert error.p90_abs == pytest.approx(0.42)
    assert PredictionError.of([]).median_abs is None


def test_false_refusals_as_a_share_of_offered() -> None:
    false = FalseRefusals(
        refused=10, offered=1000, sampled=(1, 2, 3, 4), met_budget=(2, 3), false=(2,), horizon_s=10
    )
    assert false.false_share == 0.25  # met the budget without taking as much from others
    assert false.met_share == 0.5  # beside it: met the budget, whatever it took
    # Not watched past the forced request: what met the budget counts (the stricter count).
    assert attrs.evolve(false, horizon_s=None).false_share == 0.5
    assert false.rate == pytest.approx(10 / 1000 * 0.25)
    assert FalseRefusals(refused=0, offered=1000).rate == 0.0
    assert FalseRefusals(refused=5, offered=100).false_share is None
    assert false.as_json()["rate"] == pytest.approx(0.0025)


def test_a_refusal_is_false_when_admitting_it_gained_in_budget_work_around_it() -> None:
    # Each request here is 0.11 s of work (100 prompt tokens, 11 out); the budget is 2 s.
    base = [served(i, float(i), 1.0) for i in range(20)]
    base[10] = failed(10, 10.0, 429, "ttft_budget_exceeded")

    def rerun(*changes: Outcome) -> list[Outcome]:
        outcomes = {outcome.index: outcome for outcome in base}
        outcomes.update({outcome.index: outcome for outcome in changes})
        return list(outcomes.values())

    def change(*outcomes: Outcome, horizon_s: float = 5.0) -> Displacement:
        return displaced(
            base, rerun(*outcomes), 10, budget_s=2.0, horizon_s=horizon_s, work=PROFILE
        )

    harmless = change(served(10, 10.0, 1.5))
    assert harmless == Displacement(pytest.approx(0.11), 0.0, 0, 0)
    assert harmless.met_budget and harmless.false
    # It met its budget by pushing one request behind it out of its own: an even trade of
    # work, not a loss to refuse.
    even = change(served(10, 10.0, 1.5), served(12, 12.0, 2.5))
    assert (even.lost, even.gained) == (1, 0) and even.others_s == pytest.approx(-0.11)
    assert even.met_budget and not even.false
    # A longer request pushed out (1,000 prompt tokens): more lost than it brought.
    longer = [served(13, 13.0, 1.0, prompt=1000)]
    base[13] = longer[0]
    costly = change(served(10, 10.0, 1.5), served(13, 13.0, 2.5, prompt=1000))
    assert costly.others_s == pytest.approx(-1.01) and not costly.false
    # One pushed out beyond the horizon, or before the budget ahead of it, is not its doing.
    assert change(served(10, 10.0, 1.5), served(16, 16.0, 2.5)).false
    assert change(served(10, 10.0, 1.5), served(7, 7.0, 2.5)).false
    assert not change(served(10, 10.0, 1.5), served(16, 16.0, 2.5), horizon_s=6.0).false
    # A request refused in the rerun (admission saw the longer queue) is out of its budget.
    refused = change(served(10, 10.0, 1.5), failed(11, 11.0, 429, "ttft_budget_exceeded"))
    assert (refused.lost, refused.gained) == (1, 0) and not refused.false
    # Missed its own budget: never false, whatever happened around it.
    assert not change(served(10, 10.0, 2.5)).false
    assert not change(failed(10, 10.0, 504, "admission_wait_expired")).met_budget
    with pytest.raises(ValueError, match="not in both runs"):
        displaced(base, base[:5], 10, budget_s=2.0, horizon_s=5.0, work=PROFILE)


def test_refusal_samples_are_seeded_and_bounded() -> None:
    refused = list(range(100, 200))
    first = sample_refusals(refused, 5, seed=1, key="0.5")
    assert first == sample_refusals(refused, 5, seed=1, key="0.5")
    assert first != sample_refusals(refused, 5, seed=1, key="1")
    assert first == sorted(first) and len(set(first)) == 5
    assert sample_refusals(refused[:3], 5, seed=1, key="x") == [100, 101, 102]
    assert sample_refusals([], 5, seed=1, key="x") == []


def light_load_run() -> list[Outcome]:
    # 21 requests, one a second; all served in budget except one refusal and one slow one.
    outcomes = [served(i, float(i), 0.5) for i in range(21)]
    outcomes[5] = failed(5, 5.0, 429, "ttft_budget_exceeded")
    outcomes[7] = served(7, 7.0, 3.0)
    return outcomes


def test_figures_of_a_light_load() -> None:
    capacity = Capacity(rps=4.0, engine_s_per_s=1.0)
    figures = replay_figures(
        light_load_run(),
        load=0.25,
        mode="predictive",
        budget_s=2.0,
        offered_rps=1.0,
        capacity=capacity,
        work=PROFILE,
        warmup_fraction=0.0,
        books={"offered": 21},
    )
    assert (figures.offered, figures.admitted, figures.in_budget, figures.completed) == (
        21,
        20,
        19,
        20,
    )
    assert figures.admitted_fraction == pytest.approx(20 / 21)
    assert figures.in_budget_fraction == pytest.approx(19 / 20)
    assert figures.in_budget_window == pytest.approx(19 / 20)
    # The window runs from 0 to 20 s: 21 arrivals, 19 good, counted by arrival in requests.
    assert figures.goodput_rps == pytest.approx(19 / 20)
    assert figures.bound_rps == pytest.approx(21 / 20)  # offered, under the capacity
    assert figures.goodput_ratio == pytest.approx(19 / 21)
    # In engine work, where it was done: each request prefills (0.100 s of work) from its
    # arrival to its first token 0.5 s later and decodes (0.010 s) for 1 s after. The 17 good
    # requests arriving at 0 to 18 s are done inside the window; the one at 19 s decodes half
    # outside it (0.100 + 0.005); the one at 20 s starts as the window ends (nothing).
    assert figures.goodput_engine == pytest.approx((17 * 0.110 + 0.105) / 20)
    # Offered, the same way: the refusal at 5 s counts whole at its arrival, the slow one at
    # 7 s where it was served (inside).
    assert figures.bound_engine == pytest.approx((19 * 0.110 + 0.105) / 20)
    assert figures.goodput_engine_ratio == pytest.approx((17 * 0.110 + 0.105) / 2.195)
    assert figures.outcomes == {"200": 20, "429 ttft_budget_exceeded": 1}
    assert figures.refused == 1
    assert figures.ttft_p50_s == pytest.approx(0.5)
    assert figures.ttft_p99_s is not None and 0.5 < figures.ttft_p99_s <= 3.0
    assert figures.as_json()["books"] == {"offered": 21}


def test_engine_goodput_counts_only_the_work_done_inside_the_window() -> None:
    # Ten requests arrive in the window [0, 9] s, in budget, but each decodes for 20 s: most
    # of their work is done after the window ends, and does not count in it.
    outcomes = [Outcome(i, float(i), 100, 11, 200, None, 0.5, float(i) + 20.5) for i in range(10)]
    figures = replay_figures(
        outcomes,
        load=1.0,
        mode="open",
        budget_s=2.0,
        offered_rps=1.0,
        capacity=Capacity(rps=1.0, engine_s_per_s=1.0),
        work=PROFILE,
        warmup_fraction=0.0,
    )
    window = Window(0.0, 9.0)
    decode_inside = sum(max(0.0, 9.0 - (i + 0.5)) / 20 for i in range(10)) * 0.010
    prefill_inside = 9 * 0.100  # the one arriving at 9 s prefills after the window
    assert figures.window == window
    assert figures.goodput_engine == pytest.approx((prefill_inside + decode_inside) / 9)
    assert figures.goodput_rps == pytest.approx(10 / 9)  # requests still count by arrival
    # Whatever the latency, engine goodput is at most the offered work counted alike.
    assert figures.goodput_engine <= figures.bound_engine


def test_the_bound_is_the_capacity_under_overload() -> None:
    outcomes = [served(i, i / 10, 0.5) for i in range(101)]  # 10 req/s offered
    figures = replay_figures(
        outcomes,
        load=2.5,
        mode="open",
        budget_s=2.0,
        offered_rps=10.0,
        capacity=Capacity(rps=4.0, engine_s_per_s=0.2),
        work=PROFILE,
        warmup_fraction=0.0,
    )
    assert figures.bound_rps == 4.0
    assert figures.bound_engine == 0.2
    assert figures.goodput_ratio == pytest.approx(101 / 10 / 4.0)


def figures(load: float, mode: str, **values: object) -> ReplayFigures:
    base = replay_figures(
        light_load_run(),
        load=load,
        mode=mode,
        budget_s=2.0,
        offered_rps=1.0,
        capacity=Capacity(rps=4.0, engine_s_per_s=1.0),
        work=PROFILE,
        warmup_fraction=0.0,
    )
    # The verdicts' tests count engine work by hand: 0.110 s a request, by arrival.
    hand = {
        "goodput_engine": base.goodput_rps * 0.110,
        "bound_engine": base.bound_rps * 0.110,
        "deadline_engine": base.bound_rps * 0.110,
    }
    return attrs.evolve(base, **{**hand, **values})  # type: ignore[arg-type]


def test_verdicts_for_predictive_mode_with_open_mode_beside_them() -> None:
    bound_2x = figures(2.0, "predictive").bound_engine
    runs = [
        figures(
            0.5,
            "predictive",
            false_refusals=FalseRefusals(
                10, 1000, tuple(range(10)), (2, 3), false=(2,), horizon_s=10.0
            ),
            projection_pairs=((1.05, 1.0),) * 8 + ((1.25, 1.0),) * 2,
            placement_pairs=((1.01, 1.0),) * 10,
        ),
        figures(0.5, "open"),
        figures(2.0, "predictive", in_budget=20, deadline_engine=0.6 * bound_2x),
        figures(2.0, "open"),
    ]
    checks = {check.name: check for check in evaluate(runs, Bar(), memory_added_bytes=50_000_000)}
    good = checks["goodput / bound (engine work) at 0.5x"]
    assert good.passed is True and good.measured == "90.5 %" and good.open_mode == "90.5 %"
    assert good.note == "requests 90.5 %"  # beside it, not checked
    # Where the deadline bound is under the headline, the note says how far any policy reaches.
    beyond = checks["goodput / bound (engine work) at 2x"]
    assert beyond.note == "requests 90.5 %; no policy above 60.0 % (the deadline bound)"
    assert not any("(requests)" in name for name in checks)
    false = checks["false refusals at 0.5x (share of offered)"]
    assert false.passed is True and false.measured == "0.1 %"  # 10 / 1000 refused, 1 in 10 false
    assert false.note == (
        "all 10 refusals forced in (fewer than 50); 2 met the budget, 1 without taking as much "
        "from those around them"
    )
    assert checks["admitted in budget at 2x"].passed is True
    assert "admitted in budget at 0.5x" not in checks
    # The projection at arrival is scored; the prediction at placement is beside it.
    median = checks["TTFT projection at arrival, median abs error"]
    assert (median.passed, median.measured, median.note) == (True, "5.0 %", "at placement 1.0 %")
    p90 = checks["TTFT projection at arrival, p90 abs error"]
    assert (p90.passed, p90.measured, p90.target) == (True, "25.0 %", "<= 30.0 %")
    assert checks["memory, 1024 retained / 256 queued"].verdict == "PASS"
    # 1x and 3x were not run: their targets are not run, and so is the whole bar.
    assert checks["goodput / bound (engine work) at 1x"].verdict == "NOT RUN"
    assert checks["admitted in budget at 3x"].verdict == "NOT RUN"
    assert overall_verdict(check.passed for check in checks.values()) == "INCOMPLETE"


def test_false_refusals_are_not_checked_on_fewer_than_50_samples() -> None:
    def check(false: FalseRefusals) -> Check:
        run = figures(0.5, "predictive", false_refusals=false)
        found = {c.name: c for c in evaluate([run], Bar())}
        return found["false refusals at 0.5x (share of offered)"]

    few = check(FalseRefusals(200, 1000, tuple(range(20)), ()))  # 20 of 200: too few
    assert few.verdict == "NOT RUN" and "20 of 200 refusals sampled, fewer than 50" in (
        few.note or ""
    )
    enough = check(FalseRefusals(200, 1000, tuple(range(50)), ()))
    assert enough.verdict == "PASS"
    assert enough.note == "50 of 200 refusals forced in; 0 met the budget"
    every = check(FalseRefusals(30, 1000, tuple(range(30)), tuple(range(15))))
    assert every.verdict == "FAIL"
    assert every.note == "all 30 refusals forced in (fewer than 50); 15 met the budget"
    # What the verdict counts: those that met the budget without taking as much from others.
    watched = check(
        FalseRefusals(50, 1000, tuple(range(50)), tuple(range(40)), false=(1,), horizon_s=10.0)
    )
    assert watched.verdict == "PASS" and watched.measured == "0.1 %"
    assert watched.note == (
        "50 of 50 refusals forced in; 40 met the budget, 1 without taking as much from those "
        "around them"
    )
    assert check(FalseRefusals(0, 1000)).verdict == "PASS"  # nothing refused: nothing false
    assert check(FalseRefusals(200, 1000)).verdict == "NOT RUN"


def test_predictive_must_beat_every_baseline_at_every_load() -> None:
    runs = [
        figures(1.0, "predictive", goodput_engine=0.9, bound_engine=1.0, in_budget=19),
        # a tie in share: beaten
        figures(1.0, "queue-cap", goodput_engine=0.8, bound_engine=1.0, in_budget=19),
        figures(1.0, "engine-cap", goodput_engine=0.95, bound_engine=1.0, in_budget=15),
    ]
    checks = {c.name: c for c in evaluate(runs, Bar(goodput_loads=(1.0, 2.0)))}
    queue = checks["goodput / bound (engine work) at 1x: predictive vs queue-cap"]
    assert (queue.verdict, queue.measured, queue.target) == ("PASS", "90.0 %", ">= 80.0 %")
    assert checks["in-budget share at 1x: predictive vs queue-cap"].verdict == "PASS"
    engine = checks["goodput / bound (engine work) at 1x: predictive vs engine-cap"]
    assert engine.verdict == "FAIL" and engine.note == "engine-cap 95.0 %"
    share = checks["in-budget share at 1x: predictive vs engine-cap"]
    assert (share.verdict, share.measured, share.target) == ("PASS", "95.0 %", ">= 75.0 %")
    # A load (or a baseline) not run is not run.
    missing = checks["goodput / bound (engine work) at 2x: predictive vs queue-cap"]
    assert missing.verdict == "NOT RUN" and missing.note == "queue-cap not run"
    # Each over its own bound: the same goodput against a larger offered load is less.
    offered_more = attrs.evolve(runs[1], goodput_engine=0.9, bound_engine=1.2)
    checks = {c.name: c for c in evaluate([runs[0], offered_more], Bar(goodput_loads=(1.0,)))}
    assert checks["goodput / bound (engine work) at 1x: predictive vs queue-cap"].passed


def test_an_easy_placement_prediction_does_not_pass_a_poor_projection() -> None:
    run = figures(
        1.0,
        "predictive",
        projection_pairs=((1.2, 1.0),) * 10,  # 20 % off at arrival
        placement_pairs=((1.0, 1.0),) * 10,  # exact after the queue wait
    )
    checks = {check.name: check for check in evaluate([run], Bar())}
    median = checks["TTFT projection at arrival, median abs error"]
    assert median.verdict == "FAIL" and median.note == "at placement 0.0 %"


def test_a_missing_figure_is_not_run_never_passed() -> None:
    runs = [figures(0.5, "predictive", false_refusals=None, admitted=0)]
    checks = {check.name: check for check in evaluate(runs, Bar())}
    assert checks["false refusals at 0.5x (share of offered)"].verdict == "NOT RUN"
    assert checks["TTFT projection at arrival, median abs error"].verdict == "NOT RUN"
    memory = checks["memory, 1024 retained / 256 queued"]  # not measured
    assert (memory.verdict, memory.measured) == ("NOT RUN", "n/a")
    assert Check("x", None, "n/a", "-").as_json()["verdict"] == "NOT RUN"
    # Without a memory target (the real-time confirmation), there is no such check.
    assert not any("memory" in c.name for c in evaluate(runs, Bar(memory_bytes=None)))


def test_overall_verdict_passes_only_when_every_target_was_checked_and_passed() -> None:
    assert overall_verdict([True, True]) == "PASS"
    assert overall_verdict([True, None]) == "INCOMPLETE"
    assert overall_verdict([None, False, True]) == "FAIL"
    assert overall_verdict([]) == "INCOMPLETE"


def test_goodput_above_the_bound_fails_in_every_mode() -> None:
    outcomes = [served(i, i / 10, 0.5) for i in range(101)]  # 10 req/s offered, all good
    capacity = Capacity(rps=4.0, engine_s_per_s=0.2)  # a capacity measured too low
    runs = [
        replay_figures(
            outcomes,
            load=2.5,
            mode=mode,
            budget_s=2.0,
            offered_rps=10.0,
            capacity=capacity,
            work=PROFILE,
            warmup_fraction=0.0,
        )
        for mode in ("predictive", "open")
    ]
    checks = {check.name: check for check in evaluate(runs, Bar(goodput_loads=()))}
    for mode in ("predictive", "open"):
        bound_check = checks[f"goodput within the bound (engine work) at 2.5x {mode}"]
        ratio = runs[0].goodput_engine_ratio
        assert ratio is not None and ratio > 5  # about 1 engine-s/s done against 0.2
        assert bound_check.verdict == "FAIL" and bound_check.measured == f"{ratio * 100:.1f} %"
    # The capacity's own noise widens the bound by two standard errors, and says so.
    noisy = attrs.evolve(runs[0], goodput_engine=0.202, capacity_noise=0.005)
    check = {c.name: c for c in evaluate([noisy], Bar(goodput_loads=()))}[
        "goodput within the bound (engine work) at 2.5x predictive"
    ]
    assert (check.passed, check.measured, check.target) == (True, "101.0 %", "<= 101.0 %")
    assert check.note == "above: the bound is wrong; 2 x the capacity's noise 0.5 %"
    # Goodput at the bound passes; a tolerance, when given, is what it says.
    at_bound = attrs.evolve(runs[0], goodput_engine=0.2)
    checks = {c.name: c for c in evaluate([at_bound], Bar(goodput_loads=(), bound_excess=0.01))}
    assert checks["goodput within the bound (engine work) at 2.5x predictive"].passed is True


def test_requests_that_cannot_meet_the_budget_on_an_idle_engine_leave_the_bound() -> None:
    # 21 arrivals, one a second; 5 of them take 3 s alone on an idle engine: unattainable
    # (and served in 3 s).
    outcomes = [
        attrs.evolve(served(i, float(i), 3.0), idle_ttft_s=3.0)
        if i % 4 == 0 and i < 20
        else attrs.evolve(served(i, float(i), 0.5), idle_ttft_s=0.1)
        for i in range(21)
    ]
    assert not outcomes[0].attainable(2.0) and outcomes[1].attainable(2.0)
    assert served(0, 0.0, 0.5).attainable(2.0)  # not known: attainable
    figures = replay_figures(
        outcomes,
        load=0.25,
        mode="open",
        budget_s=2.0,
        offered_rps=1.0,
        capacity=Capacity(rps=4.0, engine_s_per_s=1.0),
        work=PROFILE,
        warmup_fraction=0.0,
    )
    assert figures.unattainable == 5
    assert figures.bound_rps == pytest.approx(16 / 20)
    # In engine work: 14 attainable requests done inside the window, the one at 19 s half its
    # decode (0.105), the one at 20 s nothing yet.
    assert figures.bound_engine == pytest.approx((14 * 0.110 + 0.105) / 20)
    assert figures.as_json()["unattainable"] == 5


def test_prediction_pooled_at_arrival_and_at_placement() -> None:
    runs = [
        figures(1.0, "predictive", projection_pairs=((1.1, 1.0),), placement_pairs=((1.0, 1.0),)),
        figures(2.0, "predictive", projection_pairs=((0.7, 1.0),), placement_pairs=((1.0, 1.0),)),
    ]
    pooled = Prediction.pooled(runs)
    assert pooled.arrival.count == 2 and pooled.arrival.median_abs == pytest.approx(0.2)
    assert pooled.placement.median_abs == 0.0
    assert pooled.as_json()["arrival"]["count"] == 2


def report(runs: list[ReplayFigures], checks: list[Check]) -> AdmissionReport:
    return AdmissionReport(
        settings={"engines": 2, "profile": "test", "budget_s": 2.0, "seed": 0, "jobs": 1},
        environment={"cpu_cores": 2},
        trace={"name": "conv", "requests": 21, "span_s": 20.0, "mean_rate": 1.0},
        capacity=Capacity(rps=4.0, engine_s_per_s=1.0, warmup_s=3.0, completed_rps=4.1, mix=1.0),
        runs=tuple(runs),
        memory=None,
        checks=tuple(checks),
        wall_s={"total": 1.0},
    )


def test_report_verdict_is_incomplete_while_a_target_is_unchecked() -> None:
    runs = [figures(1.0, "predictive"), figures(1.0, "open")]
    incomplete = report(runs, evaluate(runs, Bar()))
    assert incomplete.verdict == "INCOMPLETE" and not incomplete.passed
    text = incomplete.render()
    assert "verdict: INCOMPLETE (" in text and " not run of " in text
    assert "NOT RUN" in text and "mix 1.00 of the trace's mean work" in text
    data = incomplete.as_json()
    assert data["verdict"] == "INCOMPLETE" and data["passed"] is False
    assert "goodput / bound (engine work) at 0.5x" in data["not_run"]
    assert data["prediction_error"]["arrival"]["count"] == 0
    bar = Bar(goodput_loads=(1.0,), in_budget_loads=(), false_refusal_loads=(), memory_bytes=None)
    bar = attrs.evolve(bar, baselines=())
    bar = attrs.evolve(bar, prediction_median=1.0, prediction_p90=1.0)
    ran = [attrs.evolve(run, projection_pairs=((1.0, 1.0),)) for run in runs]
    complete = report(ran, evaluate(ran, bar))
    assert complete.verdict == "PASS" and complete.passed
    assert complete.render().endswith("verdict: PASS")
    failing = report(runs, [Check("x", False, "1", "2"), Check("y", None, "n/a", "2")])
    assert failing.render().endswith("verdict: FAIL (1 failed, 1 not run of 2)")


def test_rendering_shows_every_run_and_verdict() -> None:
    runs = [figures(1.0, "predictive"), figures(1.0, "open")]
    lines = render_runs(runs)
    assert len(lines) == 3 and "predictive" in lines[1] and "open" in lines[2]
    assert "arrival" in lines[0] and "place" in lines[0] and "unatt" in lines[0]
    verdicts = render_checks(evaluate(runs, Bar()))
    assert verdicts[0].startswith("check")
    assert any(" PASS " in line for line in verdicts)
    assert any(" NOT RUN " in line for line in verdicts)
