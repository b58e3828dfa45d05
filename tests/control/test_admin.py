"""The admin API's guard and its engine listing, through the real app (narwhal.web.admin)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import AdminConfig, Config, MonitoringConfig, ServingConfig
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.web import admin as admin_module
from narwhal.web.admin import is_loopback
from narwhal.web.app import create_app, get_router
from tests.conftest import MODEL, StartFleet, engine_config

TOKEN = "s3cret-admin-token"
ROUTES = [
    ("GET", "/admin/engines"),
    ("GET", "/admin/maintenance"),
    ("GET", "/admin/maintenance/a"),
    ("POST", "/admin/maintenance/a?force=true"),  # the engines have not joined yet
    ("DELETE", "/admin/maintenance/a"),
]

Connect = Callable[..., Awaitable[httpx.AsyncClient]]


@pytest.fixture
async def connect(nursery: trio.Nursery) -> AsyncIterator[Connect]:
    """Start a router with one simulated engine (wave ``a``) under ``[admin]`` settings; the
    client it returns reaches the app as a peer at ``host``."""
    clients: list[httpx.AsyncClient] = []

    async def start(admin: AdminConfig, host: str = "127.0.0.1") -> httpx.AsyncClient:
        config = Config(
            serving=ServingConfig(model=MODEL),
            engines=(engine_config("sim-a"), engine_config("sim-b", wave="b")),
            monitoring=MonitoringConfig(profiling=False),
            admin=admin,
        )
        sims = {
            name: SimTransport(SimEngine(MODEL, timing=StepTiming(get_profile("h100-llama3-8b"))))
            for name in ("sim-a", "sim-b")
        }
        app = create_app(config, transports=sims)
        await nursery.start(partial(run_lifespan, app))

        async def as_peer(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await app({**scope, "client": (host, 50000)}, receive, send)

        client = httpx.AsyncClient(
            transport=ASGIStreamTransport(as_peer, nursery), base_url="http://narwhal.test"
        )
        client.router = get_router(app)  # type: ignore[attr-defined]
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.aclose()


def assert_envelope(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert response.headers["x-request-id"]
    return dict(error)


async def test_without_a_token_the_admin_api_is_off(
    connect: Connect, autojump_clock: trio.testing.MockClock
) -> None:
    client = await connect(AdminConfig())
    for method, path in ROUTES:
        response = await client.request(method, path)
        error = assert_envelope(response, 403, "admin_disabled")
        assert error["type"] == "permission_error"
        assert "admin.token" in error["message"]
    assert not client.router.maintenance.status("a").in_maintenance  # type: ignore[attr-defined]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
async def test_loopback_callers_may_go_without_a_token_where_allowed(
    connect: Connect, autojump_clock: trio.testing.MockClock, host: str
) -> None:
    client = await connect(AdminConfig(allow_loopback_without_token=True), host)
    for method, path in ROUTES:
        assert (await client.request(method, path)).status_code == 200, (method, path)


@pytest.mark.parametrize("host", ["10.0.0.7", "192.168.1.2", "2001:db8::1", "::ffff:10.0.0.7"])
async def test_other_callers_are_refused_without_a_token_even_where_loopback_is_allowed(
    connect: Connect, autojump_clock: trio.testing.MockClock, host: str
) -> None:
    client = await connect(AdminConfig(allow_loopback_without_token=True), host)
    for method, path in ROUTES:
        error = assert_envelope(await client.request(method, path), 403, "admin_disabled")
        assert "not on loopback" in error["message"]


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", f"Basic {TOKEN}", "Bearer wrong", f"Bearer {TOKEN}x", TOKEN],
)
async def test_a_missing_or_bad_token_is_a_401(
    connect: Connect, autojump_clock: trio.testing.MockClock, authorization: str | None
) -> None:
    # A configured token is needed even from loopback where loopback is allowed without one.
    client = await connect(AdminConfig(token=TOKEN, allow_loopback_without_token=True))
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in ROUTES:
        response = await client.request(method, path, headers=headers)
        error = assert_envelope(response, 401, "admin_unauthorized")
        assert error["type"] == "authentication_error"
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert TOKEN not in response.text
    assert not client.router.maintenance.status("a").in_maintenance  # type: ignore[attr-defined]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_right_token_lets_any_caller_in(
    connect: Connect, autojump_clock: trio.testing.MockClock, scheme: str
) -> None:
    client = await connect(AdminConfig(token=TOKEN), "203.0.113.9")
    headers = {"Authorization": f"{scheme} {TOKEN}", "X-Request-Id": "op-42"}
    for method, path in ROUTES:
        response = await client.request(method, path, headers=headers)
        assert response.status_code == 200, (method, path, response.text)
        assert response.headers["x-request-id"] == "op-42"


async def test_the_token_is_compared_in_constant_time(
    connect: Connect, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[object, object]] = []
    real = admin_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(admin_module.hmac, "compare_digest", spy)
    client = await connect(AdminConfig(token=TOKEN))
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert (await client.get("/admin/engines", headers=good)).status_code == 200
    bad = {"Authorization": "Bearer nope"}
    assert (await client.get("/admin/engines", headers=bad)).status_code == 401
    assert calls == [(TOKEN.encode(), TOKEN.encode()), (b"nope", TOKEN.encode())]


async def test_nothing_secret_is_logged(
    connect: Connect, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    client = await connect(AdminConfig(token=TOKEN), "10.1.2.3")
    for value in ("Bearer almost-" + TOKEN, f"Bearer {TOKEN}", "Bearer guess-123"):
        await client.post("/admin/maintenance/a", headers={"Authorization": value})
    await client.get("/admin/engines")
    assert TOKEN not in caplog.text and "guess-123" not in caplog.text
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 3  # each refusal is logged, with its peer and code
    assert all("10.1.2.3" in r.getMessage() for r in refusals)
    assert all("admin_unauthorized" in r.getMessage() for r in refusals)


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.255.0.1", "::1", "::ffff:127.0.0.1", "::1%lo"):
        assert is_loopback(host), host
    for host in (None, "", "10.0.0.1", "0.0.0.0", "::", "localhost", "::ffff:8.8.8.8", "bogus"):
        assert not is_loopback(host), host


async def test_the_engine_listing(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(
        [engine_config("sim-a", wave="a"), engine_config("sim-b", wave="b")],
        admin=AdminConfig(token=TOKEN),
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert (await fleet.chat()).status_code == 200
    listing = (await fleet.client.get("/admin/engines", headers=auth)).json()
    assert (listing["state"], listing["reason"]) == ("active", None)
    assert listing["capacity"]["serving_rps"] == listing["capacity"]["total_rps"] > 0
    assert [engine["name"] for engine in listing["engines"]] == ["sim-a", "sim-b"]
    sim_a = listing["engines"][0]
    assert sim_a["url"] == "http://sim-a.test" and sim_a["dialect"] == "vllm"
    assert (sim_a["wave"], sim_a["maintenance"]) == ("a", False)
    assert (sim_a["state"], sim_a["eligible"], sim_a["reason"]) == ("ready", True, None)
    assert [model["id"] for model in sim_a["models"]] == [MODEL]
    assert sim_a["profiled"] and sim_a["token_accounting"] == "token_ids"
    engine = fleet.router.pool.engines[0]
    assert sim_a["speed"] == {
        "prefill_scale": round(engine.forecast.scale, 4),
        "latency_s": round(engine.forecast.latency_s, 6),
        "decode_scale": round(engine.forecast.decode_scale, 4),
        "decode_slope": round(engine.forecast.decode_slope, 4),
        "step_fill": round(engine.forecast.fill, 4),
        "profiled_prefill_scale": round(engine.profiled_scale, 4),
        "profiled_decode_scale": round(engine.profiled_decode_scale, 4),
        "capacity_rps": pytest.approx(listing["capacity"]["total_rps"] / 2, rel=0.2),
        "profile": "h100-llama3-8b",
    }
    assert set(sim_a["drift"]) == {"ttft", "tpot", "state"}
    assert sim_a["occupancy"] == {
        "prefill": 0,
        "decode": 0,
        "prefill_limit": 4,
        "decode_limit": 128,
    }
    assert sum(engine["completed"] for engine in listing["engines"]) == 1

    assert (await fleet.client.post("/admin/maintenance/a", headers=auth)).status_code == 200
    listing = (await fleet.client.get("/admin/engines", headers=auth)).json()
    sim_a = listing["engines"][0]
    assert (sim_a["maintenance"], sim_a["eligible"], sim_a["reason"]) == (
        True,
        False,
        "maintenance: a",
    )
    assert sim_a["state"] == "ready"  # its health is its own
    assert listing["capacity"]["serving_rps"] < listing["capacity"]["total_rps"]
    fleet.assert_quiescent()
