"""Engine health: the pure state machine, then polls and the breaker at exact virtual times."""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, cast

import attrs
import httpx
import pytest
import trio

from narwhal.config import (
    AdmissionConfig,
    Config,
    EngineConfig,
    MonitoringConfig,
    ServingConfig,
    UpstreamConfig,
)
from narwhal.errors import EngineError, EngineResponseError, EngineUnreachable
from narwhal.router import Router
from narwhal.scheduling.engines import Engine
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.health import EngineHealth, Failure
from narwhal.scheduling.profiles import PROFILES, get_profile
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.upstream.health import transport_failure
from tests.conftest import MODEL, Fleet, StartFleet
from tests.support import until

TIMEOUT = Failure("timeout", "no answer within 1 s")
REFUSED = Failure("connect", "unreachable (connection refused)")
HEALTH_503 = Failure("unhealthy", "/health answered 503")


# -- the state machine, by plain function calls -------------------------------------------------


def joined(**options: Any) -> EngineHealth:
    health = EngineHealth(**options)
    assert health.poll_succeeded(0.0) == "joined"
    return health


def test_an_engine_is_eligible_only_once_a_poll_succeeds() -> None:
    health = EngineHealth()
    assert not health.eligible and not health.joined
    assert health.reason(0.0) == "joining: waiting for /health and /v1/models"
    assert health.poll_failed(0.0, REFUSED) is None
    assert health.reason(1.0) == "joining: unreachable (connection refused)"
    assert health.poll_failed(1.0, TIMEOUT) is None
    assert health.reason(1.0) == "joining: no answer within 1 s"
    assert health.poll_succeeded(2.0) == "joined"
    assert health.eligible and health.joined and health.reason(2.0) is None
    assert health.statistics(2.0).state == "ready"


def test_consecutive_failures_open_the_circuit_at_the_threshold() -> None:
    health = joined(failure_threshold=3, open_s=5.0)
    assert health.poll_failed(1.0, TIMEOUT) is None
    assert health.request_failed(1.5, Failure("timeout", "timed out")) is None
    assert health.eligible and health.statistics(1.5).consecutive_failures == 2
    assert health.poll_failed(2.0, TIMEOUT) == "opened"
    assert not health.eligible
    assert health.reason(2.0) == "circuit open: 3 consecutive failures (timeout)"
    assert health.probe_at() == 7.0


def test_a_success_resets_the_count() -> None:
    health = joined(failure_threshold=3)
    health.poll_failed(1.0, TIMEOUT)
    health.poll_failed(2.0, TIMEOUT)
    health.poll_succeeded(3.0)
    health.poll_failed(4.0, TIMEOUT)
    health.request_failed(4.5, Failure("disconnect", "connection lost"))
    health.request_answered(4.6)
    health.poll_failed(5.0, TIMEOUT)
    health.poll_failed(6.0, TIMEOUT)
    assert health.eligible and health.statistics(6.0).consecutive_failures == 2


def test_a_decisive_failure_opens_the_circuit_at_once() -> None:
    for failure in (REFUSED, HEALTH_503):
        health = joined(failure_threshold=3)
        assert health.request_failed(1.0, failure) == "opened"
        assert health.reason(1.0) == f"circuit open: {failure.detail}"


def test_a_threshold_of_one_names_the_failure() -> None:
    health = joined(failure_threshold=1)
    assert health.request_failed(1.0, Failure("timeout", "timed out")) == "opened"
    assert health.reason(1.0) == "circuit open: timed out"


def test_after_the_cool_down_a_good_probe_closes_the_circuit() -> None:
    health = joined(open_s=5.0)
    health.poll_failed(10.0, HEALTH_503)
    assert health.state(14.9) == "open"
    assert health.poll_succeeded(14.9) is None  # no probe before the cool-down ends
    assert health.state(15.0) == "half_open" and not health.eligible
    assert health.reason(15.0) == "circuit half-open: probing (/health answered 503)"
    assert health.poll_succeeded(15.0) == "closed"
    assert health.eligible and health.reason(15.0) is None and health.probe_at() is None
    assert health.statistics(15.0).consecutive_failures == 0


def test_a_failed_probe_opens_the_circuit_for_another_cool_down() -> None:
    health = joined(open_s=5.0)
    health.poll_failed(10.0, REFUSED)
    assert health.poll_failed(12.0, TIMEOUT) is None  # not a probe yet
    assert health.poll_failed(15.0, TIMEOUT) == "reopened"
    assert health.probe_at() == 20.0
    assert health.reason(15.0) == "circuit open: probe failed: no answer within 1 s"
    assert health.poll_succeeded(20.0) == "closed"


def test_requests_failing_on_an_open_circuit_change_nothing() -> None:
    health = joined()
    health.poll_failed(1.0, REFUSED)
    assert health.request_failed(2.0, Failure("timeout", "timed out")) is None
    stats = health.statistics(2.0)
    assert (stats.probe_at, stats.times_opened, stats.failed_requests) == (6.0, 1, 1)


def test_statistics_are_a_frozen_snapshot() -> None:
    health = joined()
    health.poll_failed(1.0, TIMEOUT)
    stats = health.statistics(1.0)
    assert (stats.polls, stats.failed_polls, stats.last_good_poll_at) == (2, 1, 0.0)
    assert stats.last_failure == TIMEOUT
    health.poll_succeeded(2.0)
    assert stats.consecutive_failures == 1  # the snapshot did not move
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.polls = 0  # type: ignore[misc]


def test_the_engine_wakes_the_pool_when_its_eligibility_changes() -> None:
    engine = Engine(
        EngineConfig(name="a", url="http://a.test"),
        client=cast(Any, None),
        prefill_limit=4,
        decode_limit=128,
        forecast=PrefillForecast(PROFILES["h100-llama3-8b"], prefill_limit=4),
    )
    woken: list[bool] = []
    engine.pool_changed = lambda: woken.append(engine.eligible)
    engine.poll_failed(0.0, REFUSED)  # still joining: nothing placeable changed
    engine.poll_succeeded(1.0)
    engine.poll_failed(2.0, TIMEOUT)  # counted, still eligible
    engine.request_failed(3.0, REFUSED)
    engine.poll_succeeded(8.0)
    assert woken == [True, False, True]


# -- what a failure says of the engine ----------------------------------------------------------


def _raised(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


REQUEST = httpx.Request("GET", "http://engine.test/health")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            _raised(EngineUnreachable("x"), httpx.ConnectError("refused", request=REQUEST)),
            REFUSED,
        ),
        (
            _raised(
                httpx.ConnectError("all attempts to connect to 10.0.0.1:80 failed"),
                _raised(OSError("all attempts failed"), ConnectionRefusedError(111, "refused")),
            ),
            REFUSED,
        ),
        (
            _raised(httpx.ConnectError("x"), socket.gaierror("nodename nor servname")),
            Failure("connect", "unreachable (name not resolved)"),
        ),
        (httpx.ConnectTimeout("x"), Failure("connect", "unreachable (connect timed out)")),
        (_raised(EngineError("x"), httpx.ReadTimeout("x")), Failure("timeout", "timed out")),
        (_raised(EngineError("x"), httpx.PoolTimeout("x")), None),
        (
            _raised(EngineError("x"), httpx.RemoteProtocolError("malformed status line")),
            Failure("protocol", "malformed HTTP answer"),
        ),
        (
            _raised(EngineError("x"), httpx.RemoteProtocolError("the engine closed the conn")),
            Failure("disconnect", "connection lost"),
        ),
        (_raised(EngineError("x"), httpx.ReadError("reset")), Failure("disconnect", "lost")),
        (EngineError("engine a answered HTTP 500: boom"), None),
        (EngineResponseError("not JSON", param=None, code="malformed_engine_response"), None),
    ],
)
def test_only_transport_failures_count(exc: BaseException, expected: Failure | None) -> None:
    failure = transport_failure(exc)
    if expected is not None and expected.detail == "lost":
        expected = Failure("disconnect", "connection lost")
    assert failure == expected
    if failure is not None:
        assert "10.0.0.1" not in failure.detail and "(" not in failure.detail.split(" ", 1)[0]


# -- polls and the breaker in virtual time ------------------------------------------------------


@attrs.define
class Faulty(httpx.AsyncBaseTransport):
    """An engine's transport with switchable faults, recording what was asked and when.

    ``mode``: ``None`` (pass through), ``"black_hole"`` (every request is accepted and never
    answered; after ``read_timeout_s`` the caller gets the read timeout a real transport would
    raise), ``"wedged"`` (only completions black-hole) or ``"health_503"``.
    """

    inner: httpx.AsyncBaseTransport
    read_timeout_s: float = math.inf
    mode: str | None = None
    seen: list[tuple[float, str, str | None]] = attrs.field(factory=list)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.seen.append((trio.current_time(), path, self.mode))
        completion = request.method == "POST"
        if self.mode == "black_hole" or (self.mode == "wedged" and completion):
            await trio.sleep(self.read_timeout_s)
            raise httpx.ReadTimeout("the engine sent nothing in time", request=request)
        if self.mode == "health_503" and path == "/health":
            return httpx.Response(503, content=b"engine dead", request=request)
        return await self.inner.handle_async_request(request)

    def polls(self, since: float = 0.0) -> list[float]:
        return [at for at, path, _ in self.seen if path == "/health" and at >= since]

    def completions(self, since: float = 0.0) -> int:
        return sum(1 for at, path, _ in self.seen if path.startswith("/v1/c") and at >= since)


def faulty(fleet: Fleet, name: str, *, read_timeout_s: float = math.inf) -> Faulty:
    plug = fleet.plugs[name]
    wrapper = Faulty(plug.inner, read_timeout_s=read_timeout_s)
    plug.inner = wrapper
    return wrapper


def reasons(fleet: Fleet) -> dict[str, str | None]:
    ready = fleet.router.statistics().as_json()
    return {engine["name"]: engine["reason"] for engine in ready["engines"]}


def engine(fleet: Fleet, name: str) -> Engine:
    return next(e for e in fleet.router.pool if e.name == name)


async def at(when: float) -> None:
    await trio.sleep_until(when)


async def test_a_black_hole_leaves_placement_after_three_polls_and_comes_back(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    hole = faulty(fleet, "sim-a")
    sim_a = engine(fleet, "sim-a")
    await at(10.5)
    hole.mode = "black_hole"
    # Polls start every second on the second; each waits at most poll_timeout_s (1 s).
    with trio.fail_after(10):
        await until(lambda: not sim_a.eligible)
    assert trio.current_time() == pytest.approx(14.0, abs=0.002)
    assert hole.polls(10.5) == [11.0, 12.0, 13.0]
    assert reasons(fleet)["sim-a"] == "circuit open: 3 consecutive failures (timeout)"
    assert (await fleet.client.get("/ready")).status_code == 200  # sim-b serves

    # Placement skips it: requests are answered by sim-b at once, none waits a read timeout.
    sent_at = trio.current_time()
    for _ in range(4):
        response = await fleet.chat(narwhal_sim={"output_tokens": 2, "ttft_s": 0.01})
        assert response.status_code == 200
    assert trio.current_time() - sent_at < 0.5
    assert hole.completions(sent_at) == 0

    # The cool-down ends at 19.0; that probe still meets the black hole (reopened until 25.0).
    await at(19.5)
    half_open = "circuit half-open: probing (3 consecutive failures (timeout))"
    assert reasons(fleet)["sim-a"] == half_open
    await at(20.5)
    assert sim_a.health.probe_at() == 25.0
    assert reasons(fleet)["sim-a"] == "circuit open: probe failed: no answer within 1 s"
    hole.mode = None
    with trio.fail_after(10):
        await until(lambda: sim_a.eligible)
    assert trio.current_time() == pytest.approx(25.0, abs=0.002)
    assert hole.polls(10.5) == [11.0, 12.0, 13.0, 19.0, 25.0]
    assert reasons(fleet)["sim-a"] is None
    await at(27.5)
    assert hole.polls(25.5) == [26.0, 27.0]  # polling every second again
    fleet.assert_quiescent()


async def test_an_engine_answering_503_to_health_leaves_placement_at_the_next_poll(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    sick = faulty(fleet, "sim-a")
    sim_a = engine(fleet, "sim-a")
    await at(5.5)
    sick.mode = "health_503"
    with trio.fail_after(10):
        await until(lambda: not sim_a.eligible)
    assert trio.current_time() == pytest.approx(6.0, abs=0.002)
    ready = fleet.router.statistics().as_json()
    assert ready["engines"][0] == {
        "name": "sim-a",
        "eligible": False,
        "reason": "circuit open: /health answered 503",
        "token_accounting": "token_ids",
        "wave": "a",
        "occupancy": {"prefill": 0, "decode": 0},
        "profiled": True,
        "drift": {"ttft": 1.0, "tpot": 1.0, "state": "warming"},
    }
    sent_at = trio.current_time()
    for _ in range(3):
        assert (await fleet.chat(narwhal_sim={"output_tokens": 2})).status_code == 200
    assert sick.completions(sent_at) == 0
    sick.mode = None
    with trio.fail_after(10):
        await until(lambda: sim_a.eligible)
    assert trio.current_time() == pytest.approx(11.0, abs=0.002)  # the probe after 5 s


async def test_a_request_that_times_out_counts_at_once_and_its_retry_goes_elsewhere(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    # The engine answers its polls but no completion (a wedged engine core).
    fleet = await start_fleet(
        upstream=UpstreamConfig(read_timeout_s=30),
        monitoring=MonitoringConfig(failure_threshold=1),
    )
    wedged = faulty(fleet, "sim-a", read_timeout_s=30)
    faulty(fleet, "sim-b")
    sim_a = engine(fleet, "sim-a")
    wedged.mode = "wedged"
    sent_at = trio.current_time()
    for _ in range(4):  # whichever engine is tried first, sim-b answers
        response = await fleet.chat(narwhal_sim={"output_tokens": 2, "ttft_s": 0.01})
        assert response.status_code == 200
    assert wedged.completions(sent_at) == 1  # only the first to land there waited
    assert not sim_a.eligible
    assert reasons(fleet)["sim-a"] == "circuit open: timed out"
    elapsed = trio.current_time() - sent_at
    assert 30.0 <= elapsed < 31.0  # one read timeout, then every answer from sim-b at once
    fleet.assert_quiescent()


async def test_a_closing_circuit_wakes_the_dispatcher(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(admission=AdmissionConfig(mode="open", prefill_concurrency=1))
    sick = faulty(fleet, "sim-a")
    sim_a = engine(fleet, "sim-a")
    await at(3.5)
    sick.mode = "health_503"
    await at(4.5)
    assert not sim_a.eligible  # open until 9.0
    sick.mode = None
    done: list[httpx.Response] = []

    async def chat(sim: dict[str, Any]) -> None:
        done.append(await fleet.chat(narwhal_sim=sim))

    nursery.start_soon(chat, {"output_tokens": 2, "fault": "stall", "stall_s": 20.0})
    await trio.sleep(0.1)  # sim-b's one prefill slot is taken
    nursery.start_soon(chat, {"output_tokens": 2, "ttft_s": 0.01})
    await trio.sleep(0.1)
    assert fleet.router.queue.statistics().depth == 1
    with trio.fail_after(10):
        await until(lambda: len(done) == 1)
    assert done[0].status_code == 200
    placed = [when for when, path, _ in sick.seen if path == "/v1/chat/completions"]
    assert placed == [pytest.approx(9.0, abs=0.002)]  # placed on sim-a by its good probe


# -- joining: the console says when an engine cannot be reached --------------------------------


@attrs.define
class Refusing(httpx.AsyncBaseTransport):
    """An engine host that refuses every connection until ``up``."""

    inner: httpx.AsyncBaseTransport
    up: bool = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.fixture
async def router_with(
    nursery: trio.Nursery,
) -> AsyncIterator[Callable[[dict[str, httpx.AsyncBaseTransport]], Any]]:
    routers: list[Router] = []

    async def start(transports: dict[str, httpx.AsyncBaseTransport]) -> Router:
        engines = tuple(EngineConfig(name=name, url=f"http://{name}.test") for name in transports)
        router = Router(
            Config(serving=ServingConfig(model=MODEL), engines=engines), transports=transports
        )
        await router.start(nursery)
        routers.append(router)
        return router

    yield start
    for router in routers:
        await router.aclose()


def sim() -> SimTransport:
    return SimTransport(SimEngine(MODEL, timing=StepTiming(get_profile("h100-llama3-8b"))))


async def test_unreachable_engines_at_start_are_told_once_on_the_console(
    router_with: Any, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="narwhal")
    hosts = {"engine-a": Refusing(sim()), "engine-b": Refusing(sim())}
    router = await router_with(hosts)
    await at(3.5)
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert warnings == [
        "engine engine-a has not joined yet: unreachable (connection refused); retrying every 1 s",
        "engine engine-b has not joined yet: unreachable (connection refused); retrying every 1 s",
    ]
    ready = router.statistics()
    assert not ready.ready and ready.why_not_ready() == "backend_unavailable"
    assert [e.reason for e in ready.engines] == ["joining: unreachable (connection refused)"] * 2
    assert all(e.health.failed_polls == 4 for e in ready.engines)  # at 0, 1, 2 and 3 s
    hosts["engine-b"].up = True
    with trio.fail_after(5):
        await router.wait_ready()
    assert caplog.records[-1].getMessage() == "engine engine-b joined (token_accounting=token_ids)"
    assert caplog.records[-1].levelno == logging.WARNING  # the recovery of a warning shows too


async def test_an_engine_that_never_answers_at_start_is_joining_with_the_poll_timeout(
    router_with: Any, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    hole = Faulty(sim(), mode="black_hole")
    router = await router_with({"engine-a": hole, "engine-b": sim()})
    with trio.fail_after(5):
        await router.wait_ready()
    await at(3.5)
    a, b = router.statistics().engines
    assert (a.eligible, a.reason) == (False, "joining: no answer within 1 s")
    assert (b.eligible, b.reason) == (True, None)
    assert hole.polls() == [0.0, 1.0, 2.0, 3.0]  # one poll a second, each cut after 1 s
    told = [r.getMessage() for r in caplog.records if "engine-a" in r.getMessage()]
    assert told == ["engine engine-a has not joined yet: no answer within 1 s; retrying every 1 s"]


# -- a real black hole: a socket that accepts and never answers --------------------------------


@pytest.mark.realtime
async def test_polls_of_a_real_black_hole_are_cut_and_hold_no_connection(
    nursery: trio.Nursery,
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    accepted: list[trio.SocketStream] = []
    open_now: list[int] = []

    async def hold(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        try:
            while await stream.receive_some():  # read the request, never answer
                pass
        finally:
            accepted.remove(stream)

    async def measure() -> None:
        while True:
            open_now.append(len(accepted))
            await trio.sleep(0.05)

    nursery.start_soon(partial(trio.serve_listeners, hold, listeners))
    nursery.start_soon(measure)
    port = listeners[0].socket.getsockname()[1]
    config = Config(
        serving=ServingConfig(model=MODEL),
        engines=(
            EngineConfig(name="hole", url=f"http://127.0.0.1:{port}"),
            EngineConfig(name="sim", url="http://sim.test"),
        ),
        monitoring=MonitoringConfig(poll_interval_s=0.2, poll_timeout_s=0.2),
    )
    router = Router(config, transports={"sim": sim()})
    try:
        await router.start(nursery)
        with trio.fail_after(10):
            await router.wait_ready()
        deadline = trio.current_time() + 10
        while router.pool.engines[0].health.statistics(0).failed_polls < 5:
            assert trio.current_time() < deadline
            await trio.sleep(0.05)
        hole, ready = router.statistics().engines
        assert (hole.eligible, hole.reason) == (False, "joining: no answer within 0.2 s")
        assert ready.eligible
        assert max(open_now) <= 2  # each cut poll closed its connection
    finally:
        await router.aclose()


async def test_requests_waiting_on_an_engine_whose_circuit_opens_are_retried_at_once(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    hole = faulty(fleet, "sim-a", read_timeout_s=600)
    await at(10.5)
    hole.mode = "black_hole"
    # Placed before anything is known: both engines idle, sim-a first.
    with trio.fail_after(30):
        response = await fleet.chat(narwhal_sim={"output_tokens": 2, "ttft_s": 0.01})
    assert response.status_code == 200
    assert hole.completions(10.5) == 1
    # The circuit opened at 14.0 (polls at 11, 12, 13); the attempt was cut then and retried
    # on sim-b, instead of waiting the 600 s read timeout.
    assert trio.current_time() == pytest.approx(14.0 + 0.01, abs=0.01)
    assert fleet.counters()["completed"] == 1
    fleet.assert_quiescent()


async def test_a_closed_router_polls_no_more_its_clients_are_closed_after_its_pollers(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """``aclose`` stops the pollers before it closes the clients they poll with: a poll due
    after the close used to fail on the closed client and take the app's nursery down with it
    (CI, at an HA router's graceful stop)."""
    engines = (EngineConfig(name="a", url="http://a.test"),)
    router = Router(
        Config(serving=ServingConfig(model=MODEL), engines=engines), transports={"a": sim()}
    )
    await router.start(nursery)
    await router.wait_ready()
    polls = router.pool.engines[0].statistics().health_age_s
    assert polls is not None
    await router.aclose()
    await trio.sleep(10 * MonitoringConfig().poll_interval_s)  # a crash would end the nursery
    assert router.pool.engines[0].client.http.is_closed
