"""An HA pair on a real etcd (narwhal.control.etcd), on the real clock with a 1 s TTL.

Two routers run in this process, each before its own in-process engine, under one leader key.
Every completion request that reaches an engine is recorded with its time and its fencing
token (``x-narwhal-fence``): the evidence that the routers never placed work at the same time
is that the routers' active spans never overlap and that, in arrival order, the tokens never go
down. Run with ``-s`` to see the figures (failover times, gaps)::

    python -m pytest -q -s -p no:cacheprovider tests/control/test_lease_etcd.py
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.config import AdmissionConfig, ControlConfig, MonitoringConfig, ServingConfig
from narwhal.control.etcd import EtcdStore, leader_key
from narwhal.control.lease import Leader
from narwhal.upstream.client import FENCE_HEADER
from tests.conftest import MODEL, Fleet, StartFleet
from tests.control.conftest import EtcdServer, Proxy

pytestmark = pytest.mark.realtime

TTL = 1.0
DEADLINE_S = 15.0  # any wait on a condition below; a pass takes a few seconds


@attrs.define(eq=False)
class Arrival:
    at: float
    router: str
    fence: int | None


@attrs.define(eq=False)
class Engine(httpx.AsyncBaseTransport):
    """The engine's side: records the client requests (not the probes) that reach it."""

    inner: httpx.AsyncBaseTransport
    arrivals: list[Arrival]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request_id = request.headers.get("x-request-id", "")
        if request_id.startswith("ha-"):
            fence = request.headers.get(FENCE_HEADER)
            router = request_id.split("-")[1]
            self.arrivals.append(Arrival(trio.current_time(), router, _int(fence)))
        return await self.inner.handle_async_request(request)


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


@attrs.define(eq=False)
class Side:
    """One router of the pair."""

    name: str
    fleet: Fleet
    served: int = 0
    refused: int = 0

    @property
    def state(self) -> str:
        return self.fleet.router.state

    def at(self, state: str) -> list[float]:
        return [t.at for t in self.fleet.router.control.history if t.new == state]

    def spans(self) -> list[tuple[float, float]]:
        spans, since = [], None
        for transition in self.fleet.router.control.history:
            if transition.new == "active" and since is None:
                since = transition.at
            elif transition.new != "active" and since is not None:
                spans.append((since, transition.at))
                since = None
        if since is not None:
            spans.append((since, math.inf))
        return spans

    async def load(self) -> None:
        """Requests one after another, as a client of this router would send them."""
        for number in itertools.count():
            response = await self.fleet.client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "narwhal_sim": {"output_tokens": 2},
                },
                headers={"x-request-id": f"ha-{self.name}-{number}"},
            )
            if response.status_code == 200:
                self.served += 1
            else:
                assert response.json()["error"]["code"] in (
                    "router_standby",
                    "router_fenced",
                    "router_draining",
                )
                self.refused += 1
                await trio.sleep(0.005)


StartSide = Callable[..., Awaitable[Side]]


@pytest.fixture
def arrivals() -> list[Arrival]:
    return []


@pytest.fixture
def start_side(
    start_fleet: StartFleet, arrivals: list[Arrival], request: pytest.FixtureRequest
) -> StartSide:
    cluster = f"test-{request.node.name[:40]}"

    async def start(name: str, endpoint: str, *, port: int = 0) -> Side:
        fleet = await start_fleet(
            [("sim-a", "vllm")],
            wait_ready=False,
            serving=ServingConfig(model=MODEL, bind=f"127.0.0.1:{port or 8000 + ord(name[0])}"),
            admission=AdmissionConfig(mode="open"),
            # The engine joins on its first poll, unprofiled: these tests are about the lease.
            monitoring=MonitoringConfig(poll_interval_s=0.1, profiling=False),
            control=ControlConfig(
                lease="etcd", etcd_endpoints=(endpoint,), lease_ttl_s=TTL, cluster=cluster
            ),
        )
        plug = fleet.plugs["sim-a"]
        plug.inner = Engine(plug.inner, arrivals)
        with trio.fail_after(DEADLINE_S):
            while not fleet.router.pool.eligible():  # noqa: ASYNC110 - engine joins by polls
                await trio.sleep(0.01)
        return Side(name, fleet)

    return start


@asynccontextmanager
async def _loading(*sides: Side) -> AsyncIterator[None]:
    """Clients sending to every side while the block runs."""
    async with trio.open_nursery() as nursery:
        for side in sides:
            nursery.start_soon(side.load)
        yield
        nursery.cancel_scope.cancel()


async def _until(predicate: Callable[[], bool], what: str) -> None:
    with trio.fail_after(DEADLINE_S):
        while not predicate():  # noqa: ASYNC110 - states on two routers
            await trio.sleep(0.002)


def _assert_never_both(sides: list[Side], arrivals: list[Arrival]) -> None:
    """Active spans never overlap, each router's requests reached the engines inside its own
    spans, and the tokens never go down in arrival order."""
    for one, other in itertools.combinations(sides, 2):
        for a in one.spans():
            for b in other.spans():
                assert a[1] <= b[0] or b[1] <= a[0], (one.name, a, other.name, b)
    by_name = {side.name: side for side in sides}
    for arrival in arrivals:
        spans = by_name[arrival.router].spans()
        assert any(start <= arrival.at <= end for start, end in spans), (arrival, spans)
    tokens = [arrival.fence for arrival in sorted(arrivals, key=lambda a: a.at)]
    assert None not in tokens
    assert tokens == sorted(tokens), tokens  # type: ignore[type-var]


def _report(title: str, **figures: Any) -> None:
    text = ", ".join(
        f"{key}={value:.3f} s" if isinstance(value, float) else f"{key}={value}"
        for key, value in figures.items()
    )
    print(f"\nHA {title}: {text}")


async def test_the_store_speaks_etcd(etcd: EtcdServer) -> None:
    store = EtcdStore([etcd.url], leader_key("probe"), timeout_s=1.0)
    try:
        mine = await store.grant(TTL)
        assert mine.ttl_s == TTL  # the test etcd's minimum TTL allows 1 s
        other = await store.grant(5)
        won = await store.campaign(mine.id, "mine")
        assert (won.lease_id, won.value) == (mine.id, "mine")
        lost = await store.campaign(other.id, "other")
        assert (lost.lease_id, lost.token, lost.value) == (mine.id, won.token, "mine")
        assert await store.keep_alive(mine.id) == TTL
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.watch, lost)
                await store.revoke(mine.id)
        assert await store.keep_alive(mine.id) == 0
        again = await store.campaign(other.id, "other")
        assert again.lease_id == other.id and again.token > won.token
        await store.revoke(other.id)
        await store.revoke(other.id)  # a lease already gone is given up
    finally:
        await store.aclose()
    unreachable = EtcdStore(["http://127.0.0.1:9"], leader_key("probe"), timeout_s=1.0)
    try:
        with pytest.raises(Exception, match="etcd unreachable"):
            await unreachable.grant(TTL)
        with pytest.raises(Exception, match="etcd watch failed"):
            await unreachable.watch(Leader(1, 1, 1, "x"))
    finally:
        await unreachable.aclose()


async def test_failover_when_the_active_router_stops(
    etcd: EtcdServer, start_side: StartSide, arrivals: list[Arrival]
) -> None:
    a = await start_side("a", etcd.url)
    await _until(lambda: a.state == "active", "a active")
    b = await start_side("b", etcd.url)
    assert b.state == "standby"
    async with _loading(a, b):
        await _until(lambda: a.served >= 20, "a serves")
        stopped_at = trio.current_time()
        a.fleet.router.begin_drain()  # a graceful shutdown: the lease is revoked
        await _until(lambda: b.state == "active", "b takes over")
        await _until(lambda: b.served >= 20, "b serves")
    took_over = b.at("active")[0] - stopped_at
    _report("graceful stop", takeover=took_over)
    assert took_over < TTL / 2  # the standby saw the key go; no TTL to wait out
    _assert_never_both([a, b], arrivals)


async def test_a_router_cut_off_from_etcd_fences_before_the_standby_takes_over(
    etcd: EtcdServer,
    start_side: StartSide,
    arrivals: list[Arrival],
    proxy_to: Callable[[int], Awaitable[Proxy]],
) -> None:
    proxy = await proxy_to(etcd.client_port)
    a = await start_side("a", proxy.url)
    await _until(lambda: a.state == "active", "a active")
    b = await start_side("b", etcd.url)
    async with _loading(a, b):
        await _until(lambda: a.served >= 20, "a serves")
        cut_at = trio.current_time()
        proxy.cut = True  # a partition: nothing gets through, nothing is refused
        await _until(lambda: b.state == "active", "b takes over")
        await _until(lambda: b.served >= 20, "b serves")
    fenced_at, active_at = a.at("fenced")[0], b.at("active")[0]
    last_a = max(x.at for x in arrivals if x.router == "a")
    first_b = min(x.at for x in arrivals if x.router == "b")
    _report(
        "partition",
        fenced_after_cut=fenced_at - cut_at,
        takeover_after_cut=active_at - cut_at,
        fence_to_takeover=active_at - fenced_at,
        last_a_to_first_b=first_b - last_a,
        a_requests=sum(x.router == "a" for x in arrivals),
        b_requests=sum(x.router == "b" for x in arrivals),
    )
    assert last_a <= fenced_at < active_at <= first_b
    assert a.state == "fenced"
    assert (a.fleet.router.statistics().why_not_ready() or "").startswith("router_fenced")
    _assert_never_both([a, b], arrivals)
    # Back on the network: the key is b's now, a stands by.
    proxy.cut = False
    await _until(lambda: a.state == "standby", "a stands by")
    _assert_never_both([a, b], arrivals)


async def test_etcd_restarting_leaves_one_router_active(
    etcd: EtcdServer, start_side: StartSide, arrivals: list[Arrival]
) -> None:
    a = await start_side("a", etcd.url)
    await _until(lambda: a.state == "active", "a active")
    b = await start_side("b", etcd.url)
    async with _loading(a, b):
        await _until(lambda: a.served >= 20, "a serves")
        down_at = trio.current_time()
        await etcd.stop()
        await _until(lambda: a.state == "fenced", "a fences")  # no renewal for 0.8 TTL
        etcd.start()
        await etcd.wait_ready()
        back_at = trio.current_time()
        served = a.served + b.served
        await _until(lambda: "active" in (a.state, b.state), "one active again")
        await _until(lambda: a.served + b.served >= served + 20, "served again")
    active = a if a.state == "active" else b
    _report(
        "etcd restart",
        outage=back_at - down_at,
        fenced_after_down=a.at("fenced")[0] - down_at,
        active_again_after_back=active.at("active")[-1] - back_at,
        active_again=active.name,
    )
    assert {a.state, b.state} == {"active", "standby"}
    _assert_never_both([a, b], arrivals)


async def test_two_routers_started_at_the_same_instant(
    etcd: EtcdServer, start_side: StartSide, arrivals: list[Arrival]
) -> None:
    sides: list[Side] = []

    async def start(name: str) -> None:
        sides.append(await start_side(name, etcd.url))

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as starting:
            starting.start_soon(start, "a")
            starting.start_soon(start, "b")
    await _until(lambda: any(side.state == "active" for side in sides), "one active")
    winner = next(side for side in sides if side.state == "active")
    async with _loading(*sides):
        await _until(lambda: winner.served >= 50, "the winner serves")  # over renewals
    assert sorted(side.state for side in sides) == ["active", "standby"]
    loser = next(side for side in sides if side is not winner)
    assert loser.at("active") == [] and loser.served == 0
    _assert_never_both(sides, arrivals)
