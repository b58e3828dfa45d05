"""The watchdog: its rules by plain calls, then its Trio shell and a fleet at exact virtual times.

Times are multiples of 1/8 s (the default check period) so that virtual times compare exactly.
"""

from __future__ import annotations

from functools import partial

import attrs
import httpx
import pytest
import trio

from narwhal.config import MonitoringConfig
from narwhal.control.state import ControlState
from narwhal.control.watchdog import Watchdog
from tests.conftest import StartFleet

LAG = "router_monitoring_degraded: event loop lag over 0.25 s for at least 1 s"
BLIND = (
    "router_monitoring_degraded: no fresh health or metrics poll from any eligible engine "
    "(stale after 5 s)"
)


@attrs.frozen
class View:
    eligible: bool = True
    health_age_s: float | None = 0.5
    metrics_age_s: float | None = 0.5
    metrics_expected: bool = True


def dog() -> Watchdog:
    return Watchdog(max_loop_lag_s=0.25, stale_after_s=5.0, lag_sustain_s=1.0, recover_after_s=2.0)


def ticks(watchdog: Watchdog, start: float, end: float, *, lag: float = 0.0) -> float:
    """Checks every 1/8 s from ``start`` to ``end``, each ``lag`` late; the last ``now``."""
    due = start
    now = start
    while due <= end:
        now = due + lag
        watchdog.check(due=due, now=now, engines=[View()])
        due = now + watchdog.tick_s
    return now


# -- the rules ----------------------------------------------------------------------------------


def test_the_check_period_is_an_eighth_of_a_second_or_half_the_lag_threshold() -> None:
    assert dog().tick_s == 0.125
    assert Watchdog(max_loop_lag_s=0.125).tick_s == 0.0625
    assert Watchdog.for_config(MonitoringConfig()) == dog()


def test_a_lag_spike_does_not_degrade() -> None:
    watchdog = dog()
    assert watchdog.check(due=1.0, now=1.875, engines=[View()]) is None  # 0.875 s late
    assert watchdog.check(due=2.0, now=2.0, engines=[View()]) is None
    assert watchdog.statistics().loop_lag_s == 0.0
    assert watchdog.statistics().worst_loop_lag_s == 0.875


def test_a_lag_sustained_for_a_second_degrades_at_the_check_that_shows_it() -> None:
    watchdog = dog()
    # Each check 0.375 s late, the first one due at 1.0: at 1.375, 1.875, 2.375 (the third
    # late one, 1.375 s after 1.0).
    assert watchdog.check(due=1.0, now=1.375, engines=[View()]) is None
    assert watchdog.check(due=1.5, now=1.875, engines=[View()]) is None
    assert watchdog.check(due=2.0, now=2.375, engines=[View()]) == LAG
    assert watchdog.statistics().degraded
    assert watchdog.statistics().times_degraded == 1


def test_late_checks_degrade_only_once_they_span_the_sustain() -> None:
    watchdog = attrs.evolve(dog(), lag_sustain_s=2.0)
    for due in (1.0, 1.5, 2.0, 2.5):  # the last one runs 1.875 s after 1.0
        assert watchdog.check(due=due, now=due + 0.375, engines=[View()]) is None
    assert watchdog.check(due=3.0, now=3.375, engines=[View()]) == LAG.replace("1 s", "2 s")


def test_a_single_block_however_long_is_a_spike() -> None:
    watchdog = dog()
    assert watchdog.check(due=1.0, now=11.0, engines=[View()]) is None  # the loop stood 10 s
    assert watchdog.check(due=11.125, now=11.125, engines=[View()]) is None


def test_lag_exactly_at_the_threshold_is_not_lag() -> None:
    watchdog = dog()
    ticks(watchdog, 1.0, 20.0, lag=0.25)
    assert watchdog.reason is None
    assert watchdog.statistics().worst_loop_lag_s == 0.25


def degraded_by_lag(watchdog: Watchdog) -> None:
    """Three checks half a second late, due at 0.5, 1.125, 1.75: degraded at 2.25."""
    for due in (0.5, 1.125):
        assert watchdog.check(due=due, now=due + 0.5, engines=[View()]) is None
    assert watchdog.check(due=1.75, now=2.25, engines=[View()]) == LAG


def test_recovery_needs_two_seconds_of_clean_checks() -> None:
    watchdog = dog()
    degraded_by_lag(watchdog)
    assert watchdog.check(due=2.125, now=2.125, engines=[View()]) == LAG  # passing since 2.125
    ticks(watchdog, 2.25, 4.0)
    assert watchdog.reason == LAG
    assert watchdog.check(due=4.125, now=4.125, engines=[View()]) is None  # 2 s after 2.125


def test_no_flapping_while_the_lag_hovers_at_the_threshold() -> None:
    watchdog = dog()
    degraded_by_lag(watchdog)
    # For ten seconds every other check is late (0.375 s, never sustained): active routers
    # would not degrade on it, and a degraded one does not recover on it.
    due, late = 2.125, False
    while due < 12.0:
        now = due + (0.375 if late else 0.0)
        assert watchdog.check(due=due, now=now, engines=[View()]) == LAG
        due, late = now + 0.125, not late
    clean_from = due
    last = ticks(watchdog, clean_from, clean_from + 1.875)
    assert watchdog.reason == LAG
    assert watchdog.check(due=last + 0.125, now=last + 0.125, engines=[View()]) is None
    assert watchdog.statistics().times_degraded == 1

    # An active router meeting the same hovering lag stays active.
    due, late = 20.0, False
    while due < 30.0:
        now = due + (0.375 if late else 0.0)
        assert watchdog.check(due=due, now=now, engines=[View()]) is None
        due, late = now + 0.125, not late


def test_stale_polls_of_every_eligible_engine_degrade() -> None:
    watchdog = dog()
    stale = View(health_age_s=5.125)
    assert watchdog.check(due=10.0, now=10.0, engines=[View(health_age_s=5.0)]) is None
    assert watchdog.check(due=10.0, now=10.0, engines=[stale, stale]) == BLIND


def test_one_fresh_eligible_engine_is_enough() -> None:
    watchdog = dog()
    stale = View(health_age_s=30.0)
    assert watchdog.check(due=10.0, now=10.0, engines=[stale, View()]) is None


def test_ineligible_engines_do_not_count() -> None:
    watchdog = dog()
    gone = View(eligible=False, health_age_s=30.0, metrics_age_s=30.0)
    assert watchdog.check(due=10.0, now=10.0, engines=[gone]) is None  # empty, not blind
    assert watchdog.check(due=10.0, now=10.0, engines=[gone, View(health_age_s=6.0)]) == BLIND


def test_stale_metrics_count_only_where_they_are_polled() -> None:
    watchdog = dog()
    no_metrics = View(metrics_age_s=None, metrics_expected=False)
    assert watchdog.check(due=10.0, now=10.0, engines=[no_metrics]) is None
    assert watchdog.check(due=10.0, now=10.0, engines=[View(metrics_age_s=5.5)]) == BLIND


def test_metrics_never_read_count_from_the_start() -> None:
    watchdog = dog()
    watchdog.started_at = 100.0
    never = View(metrics_age_s=None)
    assert watchdog.check(due=105.0, now=105.0, engines=[never]) is None
    assert watchdog.check(due=105.125, now=105.125, engines=[never]) == BLIND


def test_a_late_check_while_recovering_from_blindness_restarts_the_count() -> None:
    watchdog = dog()
    assert watchdog.check(due=10.0, now=10.0, engines=[View(health_age_s=6.0)]) == BLIND
    assert watchdog.check(due=10.125, now=10.125, engines=[View()]) == BLIND  # passing since
    assert watchdog.check(due=11.0, now=11.5, engines=[View()]) == BLIND  # a late check
    assert watchdog.check(due=13.375, now=13.375, engines=[View()]) == BLIND  # passing since
    assert watchdog.check(due=15.25, now=15.25, engines=[View()]) == BLIND
    assert watchdog.check(due=15.375, now=15.375, engines=[View()]) is None
    assert watchdog.statistics().times_degraded == 1


# -- the Trio shell -----------------------------------------------------------------------------


async def change(control: ControlState) -> float:
    await control.wait_changed()
    return trio.current_time()


async def hog(clock: trio.testing.MockClock, *, times: int, block_s: float) -> float:
    """Block the loop ``block_s`` (the clock jumps while nothing runs) every 1/16 s after the
    watchdog's check, ``times`` times; when the last block ended."""
    for _ in range(times):
        clock.jump(block_s)
        ended = trio.current_time()
        await trio.sleep(0.0625)
    return ended


async def test_a_slow_loop_degrades_the_router_and_it_recovers_by_itself(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    control = ControlState()
    watchdog = dog()
    await nursery.start(watchdog.run, control, list)
    with trio.fail_after(60):
        await trio.sleep_until(10.0625)
        # Each block of 0.5 s makes the next check 0.4375 s late: the checks due at 10.125,
        # 10.6875 and 11.25 run at 10.5625, 11.125 and 11.6875 (1.5625 s after 10.125).
        last_block_ended = await hog(autojump_clock, times=8, block_s=0.5)
        await trio.sleep_until(30.0)
    assert watchdog.statistics().worst_loop_lag_s == 0.4375
    # The check after the last block is late too; clean checks from 1/8 s later, for 2 s.
    assert [(t.at, t.new) for t in control.history] == [
        (11.6875, "monitoring_degraded"),
        (last_block_ended + 0.125 + 2.0, "active"),
    ]
    assert control.history[0].reason == LAG
    assert last_block_ended == 10.0625 + 8 * 0.5 + 7 * 0.0625


async def test_one_long_block_is_a_spike(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    control = ControlState()
    watchdog = dog()
    await nursery.start(watchdog.run, control, list)
    with trio.fail_after(60):
        await trio.sleep_until(10.0625)
        autojump_clock.jump(5.0)
        await trio.sleep_until(30.0)
    assert control.state == "active" and not control.history
    assert watchdog.statistics().worst_loop_lag_s == 4.9375


async def test_checks_keep_their_pace_without_a_burst_after_a_block(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    watchdog = dog()
    await nursery.start(watchdog.run, ControlState(), list)
    with trio.fail_after(60):
        await trio.sleep_until(1.0625)
        before = watchdog.statistics().checks
        autojump_clock.jump(1.0)
        await trio.sleep_until(3.0)
    # 1.0625 -> 2.0625: one (late) check; then one every 1/8 s from 2.1875: seven to 3.0.
    assert watchdog.statistics().checks - before == 8


# -- a fleet ------------------------------------------------------------------------------------


class MetricsFault(httpx.AsyncBaseTransport):
    """Wraps an engine: ``/metrics`` answers 500 while ``broken``, and is answered 1/16 s late
    (so that polls and the watchdog's checks never fall on the same instant)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.broken = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            await trio.sleep(0.0625)
            if self.broken:
                return httpx.Response(500, content=b"metrics broke")
        return await self.inner.handle_async_request(request)


async def test_stale_engine_metrics_refuse_new_requests_until_they_are_fresh_again(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    faults = {}
    for name, plug in fleet.plugs.items():
        faults[name] = plug.inner = MetricsFault(plug.inner)
    control = fleet.router.control
    with trio.fail_after(60):
        await trio.sleep_until(10.5)
        for fault in faults.values():
            fault.broken = True
        # The last good metrics were read at 10.0625; stale once older than 5 s: the check at
        # 15.125 is the first to see it.
        assert await change(control) == 15.125
        assert control.state == "monitoring_degraded"
        response = await fleet.chat()
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "router_monitoring_degraded"
        ready = await fleet.client.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["state"] == "monitoring_degraded"
        assert ready.json()["reason"] == BLIND
        metrics = (await fleet.client.get("/metrics")).text
        assert "narwhal_monitoring_degraded 1.0" in metrics
        assert 'narwhal_engine_poll_age_seconds{engine="sim-a",poll="metrics"}' in metrics

        await trio.sleep_until(20.5)
        for fault in faults.values():
            fault.broken = False
        # Fresh at 21.0625; the check at 21.125 passes; two seconds of them clear it.
        assert await change(control) == 23.125
    assert control.state == "active"
    assert (await fleet.chat()).status_code == 200
    assert fleet.counters()["unavailable"] == 1
    fleet.assert_quiescent()


async def test_the_watchdog_leaves_a_healthy_fleet_alone(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(partial(fleet.chat, narwhal_sim={"output_tokens": 50}))
        await trio.sleep_until(30.0)
    assert fleet.router.control.state == "active" and not fleet.router.control.history
    stats = fleet.router.watchdog.statistics()
    assert stats.checks == pytest.approx(30.0 / 0.125, abs=2)
    assert stats.times_degraded == 0
