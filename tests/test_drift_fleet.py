"""Drift end to end, in virtual time: a router before two step-timed simulated engines.

The engines' timing comes from the continuous-batching model (no per-request directives), so
what drift sees is what a real engine that turns slower would show.
"""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from narwhal.config import AdmissionConfig
from narwhal.scheduling.engines import Engine
from narwhal.sim.calibration import ENGINE_TYPES
from narwhal.sim.timing import StepTiming
from tests.conftest import Fleet, StartFleet
from tests.support import until

PROMPT = list(range(100, 612))  # 512 token IDs: the size is exact
SPACING_S = 0.02


def placed(engine: Engine) -> int:
    """Requests placed on ``engine`` so far (ended, or holding a slot)."""
    return engine.completed + engine.failed + len(engine.slots)


@attrs.define
class Load:
    """Steady load: one 512-token completion every :data:`SPACING_S`, ``max_tokens`` each."""

    fleet: Fleet
    max_tokens: int = 16
    sent: int = 0
    statuses: list[int] = attrs.field(factory=list)

    async def run(self, count: int) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(self.one)
                self.sent += 1
                await trio.sleep(SPACING_S)

    async def one(self) -> None:
        response = await self.fleet.completion(prompt=PROMPT, max_tokens=self.max_tokens)
        self.statuses.append(response.status_code)


def shares(engines: list[Engine], before: list[int]) -> list[int]:
    return [placed(engine) - count for engine, count in zip(engines, before, strict=True)]


async def test_a_2x_slowdown_is_detected_within_30_requests_and_its_share_drops(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(admission=AdmissionConfig(mode="open"))
    engines = list(fleet.router.pool.engines)
    load = Load(fleet)
    with trio.fail_after(600):
        await load.run(200)  # warm up: both engines leave "warming"
        assert [e.drift.state for e in engines] == ["ok", "ok"]
        start = [placed(e) for e in engines]
        await load.run(200)
        before = shares(engines, start)
        slow_index = max(range(2), key=lambda i: before[i])  # the busier one turns slower
        slow = engines[slow_index]
        fleet.sims[slow.name].engine.set_slowdown(2.0)
        at_slowdown = placed(slow)
        detected: list[int] = []

        async def watch() -> None:
            await until(lambda: slow.drift.state not in ("ok", "warming"))
            detected.append(placed(slow) - at_slowdown)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await load.run(200)
            nursery.cancel_scope.cancel()
        assert detected, "the slowdown was never detected"
        start = [placed(e) for e in engines]
        await load.run(200)
        after = shares(engines, start)
    assert load.statuses.count(200) == len(load.statuses)
    share_before = before[slow_index] / sum(before)
    share_after = after[slow_index] / sum(after)
    print(
        f"detected after {detected[0]} requests; share before {share_before:.3f} "
        f"({before}), after {share_after:.3f} ({after}); state {slow.drift.state}, "
        f"scale {slow.forecast.scale:.3f}, decode scale {slow.forecast.decode_scale:.3f}"
    )
    assert detected[0] <= 30
    assert share_after < share_before


async def warmed_up(start_fleet: StartFleet, **config: object) -> tuple[Fleet, Load]:
    fleet = await start_fleet(admission=AdmissionConfig(mode="open"), **config)
    load = Load(fleet)
    await load.run(200)
    assert [e.drift.state for e in fleet.router.pool] == ["ok", "ok"]
    return fleet, load


async def test_sustained_drift_re_profiles_the_engine_when_idle_and_starts_its_drift_again(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(600):
        fleet, load = await warmed_up(start_fleet)
        slow = fleet.router.pool.engines[0]
        sim = fleet.sims[slow.name]
        assert slow.forecast.scale == pytest.approx(1.0, rel=0.05)
        fleet.sims[slow.name].engine.set_slowdown(2.0)
        profilings: list[tuple[float, int]] = []  # (time, requests placed there) when held

        async def watch() -> None:
            await until(lambda: slow.drift.state == "sustained")
            await until(lambda: slow.health.held == "profiling")
            profilings.append((trio.current_time(), len(slow.slots)))

        received, placed_before = sim.statistics().completion_requests, placed(slow)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await load.run(200)
            nursery.cancel_scope.cancel()
        assert len(profilings) == 1
        assert profilings[0][1] == 0  # it was idle when its probes ran
        await until(lambda: slow.eligible)
    # The profiling refitted the forecast (PrefillForecast.calibrate) to the engine as it is
    # now, and drift starts again from there.
    assert slow.forecast.scale == pytest.approx(2.0, rel=0.02)
    assert slow.forecast.decode_scale == pytest.approx(2.0, rel=0.02)
    assert slow.profiled_scale == slow.forecast.scale
    assert slow.drift.state == "warming" and slow.placement_penalty == 1.0
    ready = fleet.router.statistics().as_json()["engines"][0]
    assert ready["drift"] == {"ttft": 1.0, "tpot": 1.0, "state": "warming"}
    assert ready["reason"] is None
    # 47 probes went to the engine (those it received beyond what was placed there: two of each
    # prompt size, then decode batches of 1, 8 and 32), none through the router's books.
    received = sim.statistics().completion_requests - received
    assert received - (placed(slow) - placed_before) == 6 + 1 + 8 + 32
    assert fleet.router.statistics().accounting.offered == load.sent
    assert load.statuses.count(200) == len(load.statuses) == load.sent


async def test_severe_drift_takes_the_engine_out_until_it_is_re_profiled(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(600):
        fleet, load = await warmed_up(start_fleet)
        slow = fleet.router.pool.engines[0]
        fleet.sims[slow.name].engine.set_slowdown(5.0)
        load.max_tokens = 400  # long answers: the engine is busy when its drift turns severe
        reasons: list[str | None] = []

        async def watch() -> None:
            await until(lambda: (slow.health.held or "").startswith("drift"))
            reasons.append(fleet.router.statistics().as_json()["engines"][0]["reason"])
            await until(lambda: slow.health.held == "profiling")
            reasons.append(slow.health.held)
            await until(lambda: slow.eligible)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await load.run(400)
        assert slow.eligible and slow.drift.state == "warming"
    assert reasons[0] is not None and reasons[0].startswith("drift: severe (ttft ")
    assert reasons[1] == "profiling"
    assert slow.forecast.scale == pytest.approx(5.0, rel=0.02)
    assert load.statuses.count(200) == len(load.statuses) == load.sent


async def test_severe_drift_never_takes_out_the_last_eligible_engine(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(600):
        fleet, load = await warmed_up(start_fleet)
        slow, other = fleet.router.pool.engines
        fleet.sims[slow.name].engine.set_slowdown(5.0)
        fleet.plugs[other.name].down = True  # the other engine's circuit opens at its next poll
        await until(lambda: not other.eligible)
        await load.run(200)
        assert load.statuses.count(200) == len(load.statuses) == load.sent
        assert slow.drift.state == "severe"
        assert slow.eligible and slow.health.held is None  # serving slowly, not refusing
        # The other engine comes back: under load, the severe one is taken out at its next
        # poll (idle, it would be re-profiled at once)...
        fleet.plugs[other.name].down = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run, 200)
            await until(lambda: other.eligible)
            await until(lambda: slow.held_for_drift)
            # ...and released at once when the other leaves placement again.
            fleet.plugs[other.name].down = True
            await until(lambda: not other.eligible)
            assert slow.eligible
    # Requests in flight on the unplugged engine fail; none is refused for want of an engine.
    assert 503 not in load.statuses


# The simulator's own H100 physics (narwhal.sim.calibration), its decode step growing 20x
# faster with the batch than the router's profile says.
TRUTH = ENGINE_TYPES["h100-llama3-8b"]
STEEP = attrs.evolve(
    TRUTH,
    decode_per_seq_ms=TRUTH.decode_per_seq_ms * 20,
    decode_per_kv_token_ms=TRUTH.decode_per_kv_token_ms * 20,
)


async def test_a_healthy_engine_steeper_than_its_profile_reads_1x_tpot_at_a_full_batch(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(
        admission=AdmissionConfig(mode="open", queue_limit=1024), timing=lambda _: StepTiming(STEEP)
    )
    engines = list(fleet.router.pool.engines)
    # The decode probes at 1, 8 and 32 sequences fitted the slope: the forecast's step at a
    # full batch is the engine's, where a one-sequence fit would be 2.5x short of it.
    batch, context = 200, 200 * 300
    truth_s = STEEP.decode_step_ms(batch, context) / 1000
    for engine in engines:
        forecast = engine.forecast
        assert forecast.decode_scale == pytest.approx(
            STEEP.decode_base_ms / forecast.profile.decode_base_ms, rel=0.01
        )
        assert forecast.decode_step_s(batch, context) == pytest.approx(truth_s, rel=0.01)
        one_sequence = forecast.profile.decode_step_ms(batch, context) / 1000
        assert truth_s / (one_sequence * forecast.decode_scale) > 2.5
    received = [sim.statistics().completion_requests for sim in fleet.sims.values()]

    async def one() -> None:
        response = await fleet.completion(prompt=PROMPT[:64], max_tokens=300)
        assert response.status_code == 200, response.text

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for _ in range(400):  # about 200 sequences decoding on each engine
                nursery.start_soon(one)
                await trio.sleep(0.001)
    for engine, sim, before in zip(engines, fleet.sims.values(), received, strict=True):
        stats = engine.drift.statistics()
        assert stats.tpot == pytest.approx(1.0, abs=0.1), stats
        assert stats.ttft == pytest.approx(1.0, abs=0.25), stats
        assert stats.state == "ok" and engine.drift.tpot.samples >= 10, engine.drift
        # Nothing re-profiled it: the engine received only the 400 requests between them.
        assert engine.eligible and engine.health.held is None
        assert placed(engine) == sim.statistics().completion_requests - before
    assert sum(placed(e) for e in engines) == 400
