"""The router's state from its conditions (narwhal.control.state)."""

from __future__ import annotations

import trio
import trio.testing

from narwhal.control.state import ControlState


def test_active_by_default() -> None:
    control = ControlState()
    assert (control.state, control.reason) == ("active", None)
    assert control.admitting and control.placing


def test_first_condition_in_spec_order_wins() -> None:
    control = ControlState()
    control.set_maintenance("router_maintenance")
    assert control.state == "maintenance"
    control.set_degraded("router_monitoring_degraded: loop lag 0.4 s")
    assert control.state == "monitoring_degraded"
    assert control.reason == "router_monitoring_degraded: loop lag 0.4 s"
    control.set_lease("standby")
    assert (control.state, control.reason) == ("standby", "router_standby")
    control.set_lease("fenced", "router_fenced: lease not renewed")
    assert control.state == "fenced" and not control.placing
    control.begin_drain()
    assert (control.state, control.reason) == ("draining", "router_draining")


def test_conditions_do_not_overwrite_each_other() -> None:
    control = ControlState()
    control.set_maintenance("router_maintenance")
    control.set_degraded("router_monitoring_degraded")
    control.set_degraded(None)
    assert control.state == "maintenance"
    control.set_maintenance(None)
    assert control.state == "active" and control.admitting


def test_placing_goes_on_outside_lease_states() -> None:
    control = ControlState()
    control.set_degraded("router_monitoring_degraded")
    assert not control.admitting and control.placing
    control.set_maintenance("router_maintenance")
    assert control.placing


def test_history_keeps_state_changes_only() -> None:
    control = ControlState()
    control.set_degraded("a")
    control.set_degraded("b")  # same state, new reason: not a transition
    control.set_degraded(None)
    assert [(t.old, t.new, t.reason) for t in control.history] == [
        ("active", "monitoring_degraded", "a"),
        ("monitoring_degraded", "active", None),
    ]


async def test_a_change_wakes_waiters(autojump_clock: trio.testing.MockClock) -> None:
    control = ControlState()
    woken: list[float] = []

    async def waiter() -> None:
        await control.wait_changed()
        woken.append(trio.current_time())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(1.5)
            control.set_maintenance(None)  # no change: nobody wakes
            await trio.sleep(1.0)
            control.set_lease("standby")
    assert woken == [2.5]
    assert [t.at for t in control.history] == [2.5]
