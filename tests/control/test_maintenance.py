"""Maintenance waves through the real app (narwhal.control.maintenance, narwhal.web.admin).

Every test runs on the MockClock: a wave's drain, its placements and its end are asserted at
exact virtual times.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.config import AdminConfig, AdmissionConfig, MaintenanceConfig, MonitoringConfig
from narwhal.control.maintenance import Capacity, capacity_rps
from tests.conftest import MODEL, Fleet, StartFleet, engine_config
from tests.support import until

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# A stream of 100 tokens, 0.05 s apart after a 0.1 s first token: 5.05 s on its engine.
LONG = {"ttft_s": 0.1, "itl_s": 0.05, "output_tokens": 100}


async def fleet_of(
    start_fleet: StartFleet,
    waves: dict[str, str],
    *,
    min_share: float = 0.5,
    **engine: Any,
) -> Fleet:
    """Engines by name with their wave label; admission open, profiling off (the directives'
    times are not the profile's, and drift must not take an engine out)."""
    return await start_fleet(
        [engine_config(name, wave=wave, **engine) for name, wave in waves.items()],
        admission=AdmissionConfig(mode="open"),
        monitoring=MonitoringConfig(profiling=False),
        maintenance=MaintenanceConfig(min_capacity_share=min_share),
        admin=AdminConfig(token=TOKEN),
    )


async def admin(fleet: Fleet, method: str, path: str, **params: str) -> httpx.Response:
    return await fleet.client.request(method, path, headers=AUTH, params=params)


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "narwhal_sim": LONG,
        **extra,
    }


async def stream(fleet: Fleet, ended: list[float]) -> None:
    """One long stream, read to its end; its end time is appended to ``ended``."""
    async with fleet.client.stream("POST", "/v1/chat/completions", json=body()) as response:
        assert response.status_code == 200
        text = "".join([chunk async for chunk in response.aiter_text()])
    assert text.rstrip().endswith("data: [DONE]")
    assert '"error"' not in text
    ended.append(trio.current_time())


def depth(fleet: Fleet) -> int:
    return fleet.router.queue.statistics().depth


def received(fleet: Fleet, engine: str) -> int:
    return fleet.sims[engine].statistics().completion_requests


def engine_of(fleet: Fleet, name: str) -> Any:
    return next(engine for engine in fleet.router.pool if engine.name == name)


async def test_a_wave_drains_while_its_stream_finishes_and_takes_no_new_placement(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(start_fleet, {"sim-a": "a", "sim-b": "b"})
    ended: list[float] = []
    sent = trio.current_time()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, fleet, ended)
            await until(lambda: fleet.router.in_flight() == 1 and depth(fleet) == 0)
            busy = next(engine for engine in fleet.router.pool if engine.slots)
            wave = busy.config.wave
            other = next(engine for engine in fleet.router.pool if engine is not busy)
            started = trio.current_time()
            response = await admin(fleet, "POST", f"/admin/maintenance/{wave}")
            assert response.status_code == 200
            status = response.json()
            assert status["wave"] == wave and status["engines"] == [busy.name]
            assert status["in_maintenance"] and not status["forced"]
            assert (status["running"], status["drained"]) == (1, False)
            assert status["running_by_engine"] == {busy.name: 1}
            assert status["capacity"]["left_share"] == 0.5

            # /ready shows why the engine is out; it stays ready on the other one.
            ready = (await fleet.client.get("/ready")).json()
            entry = next(e for e in ready["engines"] if e["name"] == busy.name)
            assert (entry["eligible"], entry["reason"]) == (False, f"maintenance: {wave}")
            assert ready["state"] == "active"

            # New requests all go to the other engine while the stream runs on.
            before = received(fleet, busy.name), received(fleet, other.name)
            for _ in range(4):
                short = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
                assert (await fleet.client.post("/v1/chat/completions", json=short)).is_success
            assert received(fleet, busy.name) == before[0]
            assert received(fleet, other.name) == before[1] + 4

            # Waiting for the drain answers as the stream's last slot is given back.
            drained = await admin(fleet, "GET", f"/admin/maintenance/{wave}", wait_s="60")
            drained_at = trio.current_time()
    status = drained.json()
    assert (status["running"], status["drained"], status["in_maintenance"]) == (0, True, True)
    assert status["drained_after_s"] == pytest.approx(drained_at - started, abs=1e-9)
    assert ended == [pytest.approx(drained_at, abs=1e-9)]
    # The stream ran its whole 5.05 s: the wave cut nothing.
    assert ended[0] - sent == pytest.approx(5.05, abs=1e-9)
    assert fleet.counters()["completed"] == 5
    fleet.assert_quiescent()


async def test_post_with_wait_answers_when_drained_and_delete_brings_the_engine_back(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(start_fleet, {"sim-a": "a", "sim-b": "b"})
    ended: list[float] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, fleet, ended)
            await until(lambda: fleet.router.in_flight() == 1 and depth(fleet) == 0)
            busy = next(engine for engine in fleet.router.pool if engine.slots)
            started = trio.current_time()
            response = await admin(
                fleet, "POST", f"/admin/maintenance/{busy.config.wave}", wait_s="60"
            )
    status = response.json()
    assert status["drained"] and status["drained_after_s"] == pytest.approx(ended[0] - started)
    assert trio.current_time() == pytest.approx(ended[0], abs=1e-9)

    ended_wave = await admin(fleet, "DELETE", f"/admin/maintenance/{busy.config.wave}")
    assert ended_wave.status_code == 200
    assert not ended_wave.json()["in_maintenance"]
    assert busy.eligible and busy.maintenance is None
    listed = (await admin(fleet, "GET", "/admin/maintenance")).json()
    assert [w["in_maintenance"] for w in listed["waves"]] == [False, False]
    fleet.assert_quiescent()


async def test_ending_a_wave_places_queued_work_there_at_once(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    # One request per engine: with sim-a in maintenance and sim-b busy, a request queues.
    fleet = await fleet_of(
        start_fleet,
        {"sim-a": "a", "sim-b": "b"},
        min_share=0.0,
        prefill_concurrency=1,
        decode_concurrency=1,
    )
    sim_a, sim_b = engine_of(fleet, "sim-a"), engine_of(fleet, "sim-b")
    assert (await admin(fleet, "POST", "/admin/maintenance/a")).status_code == 200
    ended: list[float] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, fleet, ended)
            await until(lambda: len(sim_b.slots) == 1)
            nursery.start_soon(stream, fleet, ended)
            await until(lambda: depth(fleet) == 1)
            await trio.sleep(1.0)  # it waits: sim-b is full, sim-a in maintenance
            assert depth(fleet) == 1 and not sim_a.slots
            ending = trio.current_time()
            response = await admin(fleet, "DELETE", "/admin/maintenance/a")
            assert response.status_code == 200
            await until(lambda: depth(fleet) == 0)
            (slot,) = sim_a.slots
            assert slot.placed_at == ending  # woken by the end of the wave, not by a timer
    # The queued one ends on sim-a before sim-b's first stream would have freed it.
    assert ended[0] < ended[1] - 1.0
    fleet.assert_quiescent()


async def test_the_guard_counts_learned_speed_not_engines_and_force_overrides(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(start_fleet, {"sim-a": "a", "sim-b": "b", "sim-c": "b"})
    # sim-a's forecast has learned it four times faster than its profile: it is 4/6 of the
    # pool's capacity, though one engine of three.
    fast = engine_of(fleet, "sim-a")
    fast.forecast.scale = fast.forecast.decode_scale = 0.25
    assert capacity_rps(fast) == pytest.approx(4 * capacity_rps(engine_of(fleet, "sim-b")))

    # Wave b is two engines of three, but only a third of the capacity: allowed.
    allowed = await admin(fleet, "POST", "/admin/maintenance/b")
    assert allowed.status_code == 200
    assert allowed.json()["capacity"]["left_share"] == pytest.approx(4 / 6, abs=1e-4)
    assert (await admin(fleet, "DELETE", "/admin/maintenance/b")).status_code == 200

    # Wave a is one engine of three, but two thirds of the capacity: refused.
    refused = await admin(fleet, "POST", "/admin/maintenance/a")
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"], error["param"]) == (
        "capacity_guard",
        "invalid_request_error",
        "force",
    )
    assert "33.3%" in error["message"] and "50.0%" in error["message"]
    assert "?force=true" in error["message"]
    assert fast.eligible and fast.maintenance is None  # refused: nothing changed

    forced = await admin(fleet, "POST", "/admin/maintenance/a", force="true")
    assert forced.status_code == 200
    assert forced.json()["forced"] and not fast.eligible
    # With wave a out, wave b would leave nothing: refused too, whatever its engine count.
    assert (await admin(fleet, "POST", "/admin/maintenance/b")).status_code == 409
    fleet.assert_quiescent()


def test_capacity_share_and_guard_figures() -> None:
    capacity = Capacity(total=6.0, left=2.0, min_share=0.5)
    assert capacity.share == pytest.approx(1 / 3) and not capacity.enough
    assert Capacity(total=6.0, left=3.0, min_share=0.5).enough  # exactly the share is enough
    assert Capacity(total=0.0, left=0.0, min_share=0.5).share == 1.0


async def test_every_engine_in_maintenance_is_whole_wave_maintenance(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(start_fleet, {"sim-a": "a", "sim-b": "b"})
    router = fleet.router
    assert (await admin(fleet, "POST", "/admin/maintenance/a")).status_code == 200
    assert router.state == "active"  # one wave of two: the other engine serves
    forced = await admin(fleet, "POST", "/admin/maintenance/b", force="true")
    assert forced.status_code == 200
    assert (router.state, router.state_reason) == ("maintenance", "router_maintenance")

    ready = await fleet.client.get("/ready")
    assert ready.status_code == 503
    assert (ready.json()["state"], ready.json()["reason"]) == ("maintenance", "router_maintenance")
    refused = await fleet.chat()
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "router_maintenance"
    assert fleet.counters()["unavailable"] == 1

    # One wave back is enough to serve again.
    assert (await admin(fleet, "DELETE", "/admin/maintenance/b")).status_code == 200
    assert (router.state, router.state_reason) == ("active", None)
    assert (await fleet.client.get("/ready")).status_code == 200
    assert (await fleet.chat()).status_code == 200
    assert [t.new for t in router.control.history] == ["maintenance", "active"]
    fleet.assert_quiescent()


async def test_a_wait_for_the_drain_ends_with_the_wave(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(start_fleet, {"sim-a": "a", "sim-b": "b"})
    ended: list[float] = []
    answers: list[httpx.Response] = []

    async def wait_for(wave: str) -> None:
        answers.append(await admin(fleet, "GET", f"/admin/maintenance/{wave}", wait_s="600"))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, fleet, ended)
            await until(lambda: fleet.router.in_flight() == 1 and depth(fleet) == 0)
            busy = next(engine for engine in fleet.router.pool if engine.slots)
            wave = busy.config.wave
            await admin(fleet, "POST", f"/admin/maintenance/{wave}")
            nursery.start_soon(wait_for, wave)
            await trio.sleep(1.0)
            assert not answers  # still draining
            ending = trio.current_time()
            await admin(fleet, "DELETE", f"/admin/maintenance/{wave}")
            await until(lambda: bool(answers))
            assert trio.current_time() - ending < 0.01
    (answer,) = answers
    assert answer.status_code == 200
    assert answer.json()["in_maintenance"] is False
    assert ended and fleet.counters()["completed"] == 1
    fleet.assert_quiescent()


async def test_starting_twice_and_ending_a_wave_not_started_change_nothing(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(start_fleet, {"sim-a": "a", "sim-b": "b"})
    first = (await admin(fleet, "POST", "/admin/maintenance/a")).json()
    await trio.sleep(2.0)
    again = (await admin(fleet, "POST", "/admin/maintenance/a")).json()
    assert again["in_maintenance"] and again["started_s"] == pytest.approx(first["started_s"] + 2.0)
    assert again["drained_after_s"] == 0.0  # nothing was running
    idle = await admin(fleet, "DELETE", "/admin/maintenance/b")
    assert idle.status_code == 200 and not idle.json()["in_maintenance"]
    assert fleet.router.maintenance.status("a").in_maintenance


async def test_unknown_waves_and_bad_parameters_are_envelopes(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(start_fleet, {"sim-a": "a", "sim-b": "b"})
    for method in ("GET", "POST", "DELETE"):
        response = await admin(fleet, method, "/admin/maintenance/zz")
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("wave_not_found", "wave")
        assert "a, b" in error["message"]
    for params, param in (({"force": "maybe"}, "force"), ({"wait_s": "-1"}, "wait_s")):
        response = await admin(fleet, "POST", "/admin/maintenance/a", **params)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param
    for value in ("nan", "601", "soon"):
        response = await admin(fleet, "GET", "/admin/maintenance/a", wait_s=value)
        assert response.status_code == 400
    assert not fleet.router.maintenance.status("a").in_maintenance  # a 400 started nothing


async def test_whole_wave_maintenance_lets_streams_finish_and_refuses_the_queue(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await fleet_of(
        start_fleet, {"sim-a": "a", "sim-b": "b"}, prefill_concurrency=1, decode_concurrency=1
    )
    ended: list[float] = []
    queued: list[httpx.Response] = []

    async def queue_one() -> None:
        queued.append(await fleet.chat())

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, fleet, ended)
            nursery.start_soon(stream, fleet, ended)
            await until(lambda: all(engine.slots for engine in fleet.router.pool))
            sent = trio.current_time()
            nursery.start_soon(queue_one)
            await until(lambda: depth(fleet) == 1)
            for wave in ("a", "b"):
                response = await admin(fleet, "POST", f"/admin/maintenance/{wave}", force="true")
                assert response.status_code == 200 and response.json()["running"] == 1
            assert fleet.router.state == "maintenance"
            await until(lambda: bool(queued))
            assert trio.current_time() - sent < 0.01  # refused at once, not at its deadline
    (refused,) = queued
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "backend_unavailable"
    assert len(ended) == 2  # both streams ran to their end
    statuses = (await admin(fleet, "GET", "/admin/maintenance")).json()
    assert [w["drained"] for w in statuses["waves"]] == [True, True]
    assert statuses["state"] == "maintenance"
    fleet.assert_quiescent()
