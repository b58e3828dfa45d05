"""The admission benchmark's virtual-time runs: a minute of trace through the whole stack.

These run the real router in front of simulated engines under the MockClock (each in its own
``trio.run``), so they take the CPU time of their requests: a few seconds.
"""

from __future__ import annotations

import attrs
import orjson
import pytest

from narwhal.bench.cli import admission_settings, main, parse_floats
from narwhal.bench.goodput import Capacity, displaced, replay_figures
from narwhal.bench.inprocess import CoalescingSimEngine
from narwhal.bench.replay import (
    CapacityJob,
    MemoryJob,
    ReplayJob,
    VirtualSetup,
    default_router,
    measure_capacity,
    measure_memory,
    run_replay,
)
from narwhal.sim.timing import profile

# What `narwhal bench admission` measured for two h100-llama3-8b engines on this trace.
CAPACITY = Capacity(rps=38.4, engine_s_per_s=1.86)
SETUP = VirtualSetup(default_router(), duration_s=60.0)


@pytest.fixture(scope="module")
def one_minute() -> dict[str, object]:
    runs = {}
    for mode in ("predictive", "open"):
        runs[mode] = run_replay(ReplayJob(SETUP, mode, CAPACITY.rps, 2.0))  # type: ignore[arg-type]
    return runs


@pytest.mark.parametrize("mode", ["predictive", "open"])
def test_a_minute_of_trace_at_capacity_balances_the_books(
    one_minute: dict[str, object], mode: str
) -> None:
    result = one_minute[mode]
    assert result.deterministic  # type: ignore[attr-defined]
    outcomes = result.outcomes  # type: ignore[attr-defined]
    books = result.books  # type: ignore[attr-defined]
    assert len(outcomes) == len(SETUP.rows()) > 150
    assert books["offered"] == len(outcomes)
    assert books["in_flight"] == 0
    terminal = ("completed", "rejected", "refused", "invalid_requests", "expired")
    terminal += ("unavailable", "failed", "cancelled")
    assert books["offered"] == sum(books[name] for name in terminal)
    # The client's view agrees with the router's books.
    assert books["completed"] == sum(1 for outcome in outcomes if outcome.completed)
    assert books["refused"] == sum(1 for outcome in outcomes if outcome.refused)
    admitted = sum(1 for outcome in outcomes if outcome.admitted)
    assert admitted + books["refused"] + books["rejected"] + books["unavailable"] == len(outcomes)
    if mode == "open":
        assert books["refused"] == 0
        assert all(outcome.projected_ttft_s is None for outcome in outcomes)


def test_predictive_mode_keeps_admitted_requests_in_budget(one_minute: dict[str, object]) -> None:
    figures = {
        mode: replay_figures(
            result.outcomes,  # type: ignore[attr-defined]
            load=1.0,
            mode=mode,
            budget_s=2.0,
            offered_rps=CAPACITY.rps,
            capacity=CAPACITY,
            work=SETUP.work(),
        )
        for mode, result in one_minute.items()
    }
    predictive = figures["predictive"]
    assert predictive.in_budget_fraction is not None
    assert predictive.in_budget_fraction >= 0.95
    assert predictive.placement.count == predictive.completed
    assert predictive.projection.count == predictive.admitted
    assert figures["open"].admitted == figures["open"].offered


def test_a_refused_request_forced_in_on_the_same_seeded_run() -> None:
    tight = 0.05  # a budget a busy engine often misses: refusals guaranteed
    job = ReplayJob(attrs.evolve(SETUP, duration_s=20.0), "predictive", CAPACITY.rps, tight)
    baseline = run_replay(job)
    refused = [outcome for outcome in baseline.outcomes if outcome.refused]
    assert refused
    target = refused[len(refused) // 2]
    forced = run_replay(attrs.evolve(job, forced=target.index))
    assert forced.forced_would_refuse is True  # the same projection, let through
    mine = next(outcome for outcome in forced.outcomes if outcome.index == target.index)
    assert not mine.refused and mine.projected_ttft_s == target.projected_ttft_s
    if forced.forced_ttft_s is None:
        assert mine.ttft_s is None or mine.ttft_s > tight
    else:
        assert forced.forced_ttft_s == mine.ttft_s <= tight
    # The same seeded run up to the forced request: what ended before it ended the same way.
    rerun = {outcome.index: outcome for outcome in forced.outcomes}
    ended = [
        outcome
        for outcome in baseline.outcomes
        if outcome.arrival_s < target.arrival_s
        and (outcome.end_s is None or outcome.end_s < target.arrival_s)
        and outcome.status != 0
    ]
    assert len(ended) > 5
    assert all(rerun[outcome.index] == outcome for outcome in ended)
    # Without a horizon it stops once the forced request's budget has run out.
    assert forced.virtual_s == pytest.approx(target.arrival_s + tight)
    assert not any(outcome.arrival_s > forced.virtual_s for outcome in forced.outcomes)


def test_a_forced_in_rerun_watches_the_requests_behind_it_for_its_horizon() -> None:
    job = ReplayJob(SETUP, "predictive", CAPACITY.rps, 0.5)
    baseline = run_replay(job)
    target = baseline.outcomes[len(baseline.outcomes) // 3]
    assert target.ttft_s is not None and target.ttft_s < 0.5
    forced = run_replay(attrs.evolve(job, forced=target.index, horizon_s=0.3))
    assert forced.forced_ttft_s == pytest.approx(target.ttft_s)
    # It ran until every request arriving up to 0.3 s after it had had its budget, and no
    # further: the trace goes on.
    assert forced.virtual_s == pytest.approx(target.arrival_s + 0.3 + 0.5)
    assert baseline.virtual_s > forced.virtual_s + 0.5
    behind = [
        o for o in forced.outcomes if target.arrival_s < o.arrival_s <= target.arrival_s + 0.3
    ]
    assert len(behind) > 5 and all(o.status == 200 for o in behind)
    # Forcing in one that was admitted anyway changes nothing around it.
    change = displaced(
        baseline.outcomes,
        forced.outcomes,
        target.index,
        budget_s=0.5,
        horizon_s=0.3,
        work=SETUP.work(),
    )
    assert (change.lost, change.gained, change.others_s) == (0, 0, 0.0)


def test_capacity_is_what_a_saturated_closed_loop_completes_of_the_traces_mix() -> None:
    rows = SETUP.rows()
    job = CapacityJob(SETUP, concurrency=96, warmup_s=2.0, window_s=4.0)
    capacity = measure_capacity(job)
    assert capacity.concurrency == 96
    # The warm-up lasts until the first wave has ended, the window until a pass has completed.
    assert capacity.warmup_s > 2.0 and capacity.window_s >= 4.0
    assert capacity.completed >= len(rows)
    assert capacity.completed_rps == capacity.completed / capacity.window_s
    # Its request rate is that of the trace's own mix: its work by the cost model over the
    # trace's mean.
    mean = SETUP.work().mean(rows)
    assert capacity.model_s_per_s is not None
    assert capacity.rps == pytest.approx(capacity.model_s_per_s / mean)
    # In engine time, from the step ledger: the two engines are busy all the time, but 96 in
    # flight fill only 48 of each engine's 256 seats, and the empty seats' share of each decode
    # step is charged to nobody (overhead), so much less than that is charged to requests.
    assert capacity.engines == 2 and capacity.ceiling == 2.0
    assert capacity.busy_s_per_s is not None
    assert 1.95 < capacity.busy_s_per_s <= 2.0 + 1e-9
    assert 0.3 * capacity.busy_s_per_s < capacity.engine_s_per_s < 0.8 * capacity.busy_s_per_s
    assert capacity.mix is not None and 0.8 < capacity.mix < 1.25
    assert capacity.mean_batch is not None and capacity.mean_batch > 20
    assert 0 < capacity.noise < 0.1  # its own relative standard error


def test_a_lone_request_on_idle_engines_takes_their_idle_first_token(
    one_minute: dict[str, object],
) -> None:
    for result in one_minute.values():
        outcomes = result.outcomes  # type: ignore[attr-defined]
        assert all(outcome.idle_ttft_s is not None for outcome in outcomes)
        first = outcomes[0]  # nothing else on the engines yet: an idle engine's first token,
        # the fastest engine's (the idle figure) or another's (the engines vary by a few %)
        assert first.idle_ttft_s * (1 - 1e-9) <= first.ttft_s <= first.idle_ttft_s * 1.1


def test_memory_measurement_fills_the_retention_and_queue_limits() -> None:
    result = measure_memory(MemoryJob(SETUP, retained=40, queued=8, warmup=4))
    assert (result.retained, result.queued, result.placed) == (40, 8, 32)
    assert result.before > 0 and result.holding > 0


def test_memory_measurement_fills_even_where_the_tpot_target_would_bind() -> None:
    # The router's TPOT target keeps a batch below its limit (a fitted batch slope makes the
    # predicted step grow fast); the memory run is to hold every request all the same.
    router = default_router()
    router = attrs.evolve(router, admission=attrs.evolve(router.admission, tpot_target_s=0.001))
    result = measure_memory(MemoryJob(attrs.evolve(SETUP, router=router), retained=40, queued=8))
    assert (result.retained, result.queued, result.placed) == (40, 8, 32)


def test_coalescing_engine_sends_the_first_token_alone() -> None:
    engine = CoalescingSimEngine(
        "m", timing=profile("h100-llama3-8b"), tokens_per_chunk=16, name="e"
    )
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "abcd" * 10}],
        "stream": True,
        "stream_interval": 1,
        "return_token_ids": True,
        "narwhal_sim": {"output_tokens": 40},
    }
    plan = engine.respond("POST", "/v1/chat/completions", orjson.dumps(body))
    counts = []
    for frame in plan.frames:
        for line in frame.data.split(b"\n\n"):
            if line.startswith(b"data: {"):
                choices = orjson.loads(line[6:]).get("choices") or [{}]
                ids = choices[0].get("token_ids")
                if ids:
                    counts.append(len(ids))
    assert counts == [1, 16, 16, 7]


def test_cli_settings() -> None:
    assert parse_floats("0.5, 1,2", "--loads") == (0.5, 1.0, 2.0)
    with pytest.raises(ValueError, match="positive"):
        parse_floats("1,-2", "--loads")
    import argparse

    from narwhal.bench.cli import _admission_arguments

    parser = argparse.ArgumentParser()
    _admission_arguments(parser)
    quick = admission_settings(parser.parse_args(["--quick", "--jobs", "1"]))
    assert quick.setup.duration_s == 300.0
    assert quick.samples_at(0.5) == 50 and quick.samples_at(2.0) == 2
    assert quick.capacity_window_s == 30.0 and quick.jobs == 1
    full = admission_settings(
        parser.parse_args(["--loads", "1,3", "--capacity", "40", "--false-refusal-samples", "7"])
    )
    assert full.setup.duration_s == 1200.0 and full.loads == (1.0, 3.0)
    assert full.capacity is not None and not full.capacity.measured
    assert full.samples_at(0.5) == 7 and full.samples_at(3.0) == 7
    assert main(["admission", "--modes", "closed"]) == 2
