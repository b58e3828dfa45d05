"""Drift (pure): the running ratios, their states and the placement penalty."""

from __future__ import annotations

import pytest
import trio

from narwhal.config import EngineConfig
from narwhal.scheduling.drift import FLOOR_S, Drift
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.health import Failure
from narwhal.scheduling.profiles import get_profile


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


def test_tpot_drift_acts_and_re_profiles_without_a_ttft_penalty() -> None:
    # The decode probes fit the batch slope, so TPOT drift acts: severe here (3.4x), asking
    # for a re-profiling. The placement penalty is TTFT's residual, 1.0 here.
    drift = Drift()
    for _ in range(20):
        drift.observe_tpot(0.04, 0.01 - FLOOR_S / 3)
        drift.observe_ttft(0.1, 0.1)
    stats = drift.statistics()
    assert stats.tpot > 3 and stats.state == "severe" and drift.wants_profile
    assert drift.penalty == 1.0
    assert stats.as_json() == {"ttft": 1.0, "tpot": round(stats.tpot, 3), "state": "severe"}


def test_tpot_alone_can_leave_warming() -> None:
    drift = Drift()  # no TTFT sample at all
    for _ in range(9):
        drift.observe_tpot(0.025, 0.01)  # 2x, with the floor
    assert drift.state == "warming"
    for _ in range(11):
        drift.observe_tpot(0.025, 0.01)
    assert drift.state == "sustained" and drift.tpot.above >= drift.sustain


def test_tiny_predictions_are_not_drift() -> None:
    drift = Drift()
    for _ in range(20):
        drift.observe_ttft(0.004, 0.002)  # twice the prediction, but only 2 ms apart
    assert drift.state == "ok"


def test_a_slowdown_the_forecast_learned_is_still_drift_but_no_longer_penalised() -> None:
    drift = Drift()
    feed(drift, 1.0, 10)
    # The engine runs 2x slower than its profiling, and the forecast has learned it: its
    # predictions are right (residual 1), but the engine is not what was measured.
    for _ in range(11):
        drift.observe_ttft(0.2, 0.2, learned=2.0)
    assert drift.state == "sustained" and drift.wants_profile
    assert drift.ttft.ratio > 1.8 and drift.ttft.residual == pytest.approx(1.0)
    assert drift.penalty == 1.0


class _Client:
    async def aclose(self) -> None:
        pass


def pool_of(count: int) -> list[Engine]:
    engines = [
        Engine(
            EngineConfig(name=f"e{n}", url=f"http://e{n}.test"),
            _Client(),
            prefill_limit=4,
            decode_limit=64,
            forecast=PrefillForecast(get_profile("h100-llama3-8b")),
            reprofiled_on_drift=True,
        )
        for n in range(count)
    ]
    EnginePool(engines)
    for engine in engines:
        engine.poll_succeeded(0.0)
    return engines


def severe(engine: Engine) -> None:
    # The forecast has learned the engine 4x slower than its profiling, and it runs slower
    # still: 0.5 s where 0.4 s was predicted, 0.1 s at the profiling's speed.
    engine.forecast.scale = 4 * engine.profiled_scale
    for _ in range(20):
        engine.observe_ttft(0.5, 0.4)


def test_severe_drift_holds_the_engine_unless_it_is_the_last_eligible_one() -> None:
    drifting, other = pool_of(2)
    severe(drifting)
    assert drifting.held_for_drift and not drifting.eligible
    assert drifting.health.reason(0.0) == ("drift: severe (ttft 4.48x, tpot 1.00x its profiling)")
    severe(other)  # the last eligible engine keeps serving
    assert other.eligible and other.drift.state == "severe"
    # The re-profiling ends the hold and starts the drift again.
    assert drifting.profiled_now() == "released"
    assert drifting.eligible and drifting.drift.state == "warming"


def test_an_engine_held_for_drift_serves_again_when_no_other_is_eligible() -> None:
    drifting, other = pool_of(2)
    severe(drifting)
    assert not drifting.eligible
    other.poll_failed(1.0, Failure("connect", "unreachable (connection refused)"))
    assert not other.eligible
    assert drifting.eligible and drifting.health.held is None


def test_without_re_profiling_severe_drift_only_penalises() -> None:
    drifting, _ = pool_of(2)
    drifting.reprofiled_on_drift = False
    severe(drifting)
    assert drifting.drift.state == "severe" and drifting.eligible
    assert drifting.placement_penalty == pytest.approx(drifting.drift.ttft.residual)


def test_severe_drift_the_forecast_does_not_share_only_penalises() -> None:
    drifting, _ = pool_of(2)
    for _ in range(20):  # 5x the predictions, at the profiling's speed: the forecast's error
        drifting.observe_ttft(0.5, 0.1)
    assert drifting.drift.state == "severe" and drifting.learned_slowdown == 1.0
    assert drifting.eligible and drifting.placement_penalty > 3


def test_a_decode_scale_risen_beside_heavy_prefill_does_not_vouch_for_a_ttft_hold() -> None:
    # Under heavy prefill the decode scale learned from every gap rises (the steps also
    # prefill), while the gaps of steps that only decoded show no TPOT drift: a severe TTFT
    # ratio is then the forecast's queueing error, and only penalises.
    drifting, _ = pool_of(2)
    drifting.forecast.decode_scale = 2 * drifting.profiled_decode_scale
    for _ in range(20):
        drifting.observe_ttft(0.5, 0.1)
        # 10 ms predicted at the learned (doubled) decode scale: 5.5 ms is the profiling's.
        drifting.observe_tpot(0.0055, 0.01)
    assert drifting.drift.state == "severe" and drifting.learned_slowdown == 1.0
    assert drifting.eligible and not drifting.held_for_drift
    # Where the TPOT drift shows the slowdown too, the decode scale vouches for it.
    for _ in range(20):
        drifting.observe_tpot(0.02, 0.01)
    assert drifting.learned_slowdown == pytest.approx(2.0)
    assert drifting.held_for_drift and not drifting.eligible


def first_sample(observed: float, predicted: float) -> float:
    """The TTFT ratio after one sample from 1.0: the moving average's first step."""
    return 1.0 + 0.2 * ((observed + FLOOR_S) / (predicted + FLOOR_S) - 1.0)


async def test_what_the_forecast_learns_after_a_placement_is_not_counted_against_it(
    autojump_clock: object,
) -> None:
    # An engine turns 2x slower; the forecast learns it (from other requests) while this one
    # waits for its first token, which comes 2x late. Taking the prediction back to the
    # profiling's speed by what the forecast learned since read it 4x: severe drift, and the
    # engine was taken out of placement for a 2x slowdown.
    (engine,) = pool_of(1)
    slot = Slot.take(engine, 2048)
    predicted = slot.predicted_ttft_s
    engine.forecast.scale = 2 * engine.profiled_scale
    await trio.sleep(2 * predicted)
    slot.to_decode()
    assert engine.drift.ttft.ratio == pytest.approx(first_sample(2 * predicted, predicted))
    assert engine.drift.ttft.residual == engine.drift.ttft.ratio
    slot.release()


async def test_what_the_forecast_learns_after_a_gap_is_not_counted_against_it(
    autojump_clock: object,
) -> None:
    (engine,) = pool_of(1)
    slot = Slot.take(engine, 64)
    await trio.sleep(1.0)
    slot.to_decode()
    per_token = engine.forecast.tpot_s()  # as profiled: the forecast has learned nothing
    await trio.sleep(1.0)
    slot.observe_gap(2 * per_token, 1)
    engine.forecast.decode_scale = 3 * engine.profiled_decode_scale  # learned since
    slot.release()
    assert engine.drift.tpot.ratio == pytest.approx(first_sample(2 * per_token, per_token))


async def test_a_burst_that_shares_one_step_is_neither_slowness_nor_drift(
    autojump_clock: object,
) -> None:
    # Four prompts arrive at once and share one step: each one placed after the first makes
    # the step longer, so the first tokens all come at the end of the longer step. The engine
    # runs exactly as profiled; judged by the first placement's prediction alone, the burst
    # read as a slower engine (the scale rose 8 % on this one burst, and drift saw it too).
    (engine,) = pool_of(1)
    slots = [Slot.take(engine, 1024) for _ in range(4)]
    assert slots[0].expected_first_token_at > slots[0].predicted_first_token_at
    await trio.sleep_until(slots[-1].expected_first_token_at)
    for slot in slots:
        slot.to_decode()
    assert engine.forecast.scale == pytest.approx(1.0)
    assert engine.drift.ttft.ratio == pytest.approx(1.0, abs=1e-3)
    for slot in slots:
        slot.release()
