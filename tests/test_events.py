"""The live event feed and the dashboard (narwhal.web.events).

The messages are plain functions of snapshots (tested without a loop); the feed itself runs
under the autojump clock through Quart's WebSocket test client, with exact virtual times; a few
tests serve the router on a real socket (Narwhal's own server) and read the feed with
trio-websocket and raw bytes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from quart.testing.connections import WebsocketDisconnectError, WebsocketResponseError
from quart_trio import QuartTrio
from trio_websocket import ConnectionClosed

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import (
    AdminConfig,
    Config,
    EngineConfig,
    MonitoringConfig,
    ServingConfig,
)
from narwhal.control.maintenance import Capacity, WaveStatistics
from narwhal.demo import demo_transports
from narwhal.router import Router
from narwhal.scheduling.profiles import get_profile
from narwhal.server import CLOSE_GRACE_S, serve
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.top import open_feed
from narwhal.web.app import create_app, get_router
from narwhal.web.events import (
    DASHBOARD_HTML,
    FEED_PATH,
    OUTBOX_SIZE,
    FeedClientLagging,
    Outbox,
    Sample,
    quantile,
    summary_message,
    wave_messages,
)
from narwhal.web.http11 import HTTP11Protocol
from tests.conftest import MODEL, engine_config
from tests.support import until, wait_ready

TOKEN = "feed-s3cret"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
LOOPBACK = {"client": ("127.0.0.1", 50000)}
REMOTE = {"client": ("10.0.0.7", 50000)}


# -- the pure part ---------------------------------------------------------------------------------


def test_quantile_reads_buckets_as_histogram_quantile_does() -> None:
    inf = math.inf
    assert quantile([(0.1, 0), (0.5, 0), (inf, 0)], 0.5) is None
    assert quantile([], 0.5) is None
    # 4 observations in (0.1, 0.5]: the median is halfway through that bucket.
    assert quantile([(0.1, 0), (0.5, 4), (inf, 4)], 0.5) == pytest.approx(0.3)
    # 1 below 0.1, 3 in (0.1, 0.5]: rank 2 is a third of the way into the second bucket.
    assert quantile([(0.1, 1), (0.5, 4), (inf, 4)], 0.5) == pytest.approx(0.1 + 0.4 / 3)
    # Above every bound: the highest finite bound.
    assert quantile([(0.1, 0), (0.5, 0), (inf, 2)], 0.99) == 0.5


def _sample(at: float, counters: dict[str, int], ttft: tuple[int, int, int], **kw: Any) -> Sample:
    names = ("offered", "unsized_offered", "completed", "rejected", "refused")
    names += ("invalid_requests", "expired", "unavailable", "failed", "cancelled")
    defaults: dict[str, Any] = dict(
        wall=1000.0 + at,
        state="active",
        reason=None,
        ready=True,
        in_flight=0,
        queue_depth=0,
        retention_in_use=0,
        engines=(),
        waves=(),
    )
    return Sample(
        at=at,
        counters={name: counters.get(name, 0) for name in names},
        ttft=((0.1, float(ttft[0])), (0.5, float(ttft[1])), (math.inf, float(ttft[2]))),
        **(defaults | kw),
    )


def test_a_summary_is_the_counters_moves_and_the_gauges_at_its_end() -> None:
    before = _sample(10.0, {"offered": 5, "completed": 3}, (1, 3, 3))
    after = _sample(
        11.0,
        {"offered": 9, "completed": 5, "refused": 1, "unsized_offered": 1},
        (1, 5, 5),
        in_flight=3,
        queue_depth=2,
        retention_in_use=3,
    )
    message = summary_message(before, after)
    assert next(iter(message)) == "type"
    assert message["type"] == "summary"
    assert message["at"] == 11.0 and message["time"] == 1011.0
    assert message["interval_s"] == 1.0
    assert message["counts"] == {
        "offered": 4,
        "unsized_offered": 1,
        "completed": 2,
        "rejected": 0,
        "refused": 1,
        "invalid_requests": 0,
        "expired": 0,
        "unavailable": 0,
        "failed": 0,
        "cancelled": 0,
    }
    assert (message["in_flight"], message["queue_depth"], message["retention_in_use"]) == (3, 2, 3)
    # The second's two completions both fell in (0.1, 0.5].
    assert message["ttft"] == {"count": 2, "p50_s": 0.3, "p99_s": 0.496}


def _wave(in_maintenance: bool, running: int, *, drained_after: float | None = None) -> Any:
    return WaveStatistics(
        wave="a",
        engines=("sim-a",),
        in_maintenance=in_maintenance,
        forced=False,
        running=(("sim-a", running),),
        started_s=1.0 if in_maintenance else None,
        drained_after_s=drained_after,
        capacity=Capacity(total=2.0, left=1.0, min_share=0.5),
    )


def test_wave_progress_is_started_draining_drained_ended() -> None:
    steps = [
        (_wave(False, 2), []),
        (_wave(True, 2), ["started"]),
        (_wave(True, 2), []),
        (_wave(True, 1), ["draining"]),
        (_wave(True, 0, drained_after=3.0), ["drained"]),
        (_wave(True, 0, drained_after=3.0), []),
        (_wave(False, 0), ["ended"]),
        (_wave(True, 0, drained_after=0.0), ["started", "drained"]),
    ]
    before: tuple[WaveStatistics, ...] = ()
    for at, (status, expected) in enumerate(steps):
        now = _sample(float(at), {}, (0, 0, 0), waves=(status,))
        messages = wave_messages(before, now)
        assert [message["event"] for message in messages] == expected, at
        for message in messages:
            assert list(message)[:2] == ["type", "at"] and message["type"] == "wave"
            assert message["wave"] == "a" and message["running"] == status.running_total
        before = now.waves


def test_an_outbox_drops_summaries_never_events() -> None:
    outbox = Outbox(3)
    for index in range(3):
        outbox.put({"type": "summary", "n": index})
    outbox.put({"type": "summary", "n": 3})  # full: dropped
    assert (len(outbox), outbox.dropped) == (3, 1)
    outbox.put({"type": "state", "n": 4})  # pushes out the oldest summary
    assert (len(outbox), outbox.dropped) == (3, 2)
    outbox.put({"type": "wave", "n": 5})
    outbox.put({"type": "wave", "n": 6})
    assert outbox.dropped == 4
    with pytest.raises(FeedClientLagging):  # nothing left to push out
        outbox.put({"type": "state", "n": 7})


async def test_an_outbox_sends_what_waits_before_its_close() -> None:
    outbox = Outbox(4)
    outbox.put({"type": "hello"})
    outbox.close(1001, "bye")
    outbox.put({"type": "summary"})  # after the close: nothing more
    assert await outbox.get() == {"type": "hello"}
    closing = await outbox.get()
    assert (getattr(closing, "code", None), getattr(closing, "reason", None)) == (1001, "bye")


def test_the_dashboard_fetches_nothing_from_anywhere() -> None:
    html = DASHBOARD_HTML.decode("utf-8")
    assert "http://" not in html and "https://" not in html
    assert "//" not in html  # no scheme-relative URL, no script comment hiding one
    assert not re.search(r"""(src|href)\s*=""", html)  # no external script, style or image
    assert "@import" not in html and "url(" not in html
    assert "/admin/events" in html and "token" in html


# -- the feed in virtual time ---------------------------------------------------------------------


@attrs.define
class Served:
    app: QuartTrio
    router: Router
    client: httpx.AsyncClient

    def feed(self, *, headers: dict[str, str] | None = None, query: str = "", peer: Any = None):  # type: ignore[no-untyped-def]
        path = "/admin/events" + (f"?{query}" if query else "")
        return self.app.test_client().websocket(
            path, headers=BEARER if headers is None else headers, scope_base=peer or LOOPBACK
        )

    async def chat(self) -> httpx.Response:
        return await self.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        )


Start = Callable[..., Awaitable[Served]]


@pytest.fixture
async def start(nursery: trio.Nursery) -> AsyncIterator[Start]:
    """A router with two simulated engines (waves ``a`` and ``b``) under ``[admin]``."""
    clients: list[httpx.AsyncClient] = []

    async def run(admin: AdminConfig | None = None) -> Served:
        config = Config(
            serving=ServingConfig(model=MODEL),
            engines=(engine_config("sim-a"), engine_config("sim-b", wave="b")),
            monitoring=MonitoringConfig(profiling=False),
            admin=admin or AdminConfig(token=TOKEN),
        )
        sims = {
            name: SimTransport(SimEngine(MODEL, timing=StepTiming(get_profile("h100-llama3-8b"))))
            for name in ("sim-a", "sim-b")
        }
        app = create_app(config, transports=sims)
        await nursery.start(partial(run_lifespan, app))
        router = get_router(app)
        with trio.fail_after(30):
            await router.wait_ready()
        client = httpx.AsyncClient(
            transport=ASGIStreamTransport(app, nursery), base_url="http://narwhal.test"
        )
        clients.append(client)
        return Served(app, router, client)

    yield run
    for client in clients:
        await client.aclose()


async def test_hello_then_a_summary_every_second_with_that_seconds_counts(
    start: Start, autojump_clock: trio.testing.MockClock
) -> None:
    served = await start()
    with trio.fail_after(60):
        async with served.feed() as feed:
            hello = json.loads(await feed.receive())
            began = trio.current_time()
            assert next(iter(hello)) == "type" and hello["type"] == "hello"
            assert hello["at"] == began
            assert hello["model"] == MODEL and hello["state"] == "active" and hello["ready"]
            assert hello["admission"]["ttft_budget_s"] == 2.0
            assert [engine["name"] for engine in hello["engines"]] == ["sim-a", "sim-b"]
            assert all(engine["eligible"] for engine in hello["engines"])
            assert [wave["wave"] for wave in hello["waves"]] == ["a", "b"]
            assert hello["counters"]["offered"] == 0

            answers = [await served.chat() for _ in range(3)]
            assert [answer.status_code for answer in answers] == [200, 200, 200]
            assert trio.current_time() < began + 1.0  # all three in the first second

            first = json.loads(await feed.receive())
            assert first["type"] == "summary"
            assert trio.current_time() == first["at"] == began + 1.0
            assert first["interval_s"] == 1.0
            assert first["counts"]["offered"] == 3
            assert first["counts"]["completed"] == 3
            assert sum(first["counts"].values()) == 6  # nothing else moved
            assert first["in_flight"] == 0 and first["queue_depth"] == 0
            assert first["ttft"]["count"] == 3
            assert 0 < first["ttft"]["p50_s"] <= first["ttft"]["p99_s"]
            assert first["dropped"] == 0
            assert [engine["name"] for engine in first["engines"]] == ["sim-a", "sim-b"]

            second = json.loads(await feed.receive())
            assert second["at"] == began + 2.0
            assert set(second["counts"].values()) == {0}
            assert second["ttft"] == {"count": 0, "p50_s": None, "p99_s": None}


async def test_state_changes_and_wave_progress_arrive(
    start: Start, autojump_clock: trio.testing.MockClock
) -> None:
    served = await start()
    maintenance = served.router.maintenance
    with trio.fail_after(60):
        async with served.feed() as feed:
            hello = json.loads(await feed.receive())
            await trio.sleep(0.25)
            maintenance.start("a")
            maintenance.start("b", force=True)  # every engine in a wave: the router too
            changed = trio.current_time()
            state = json.loads(await feed.receive())
            assert state["type"] == "state"
            assert (state["from"], state["to"], state["reason"]) == (
                "active",
                "maintenance",
                "router_maintenance",
            )
            assert state["at"] == changed == hello["at"] + 0.25
            assert trio.current_time() == changed  # sent at once, not with the summary
            # The next summary's second carries the waves: started, and drained (idle).
            summary = json.loads(await feed.receive())
            assert summary["type"] == "summary" and summary["at"] == hello["at"] + 1.0
            assert summary["state"] == "maintenance"
            waves = [json.loads(await feed.receive()) for _ in range(4)]
            assert [(wave["wave"], wave["event"]) for wave in waves] == [
                ("a", "started"),
                ("a", "drained"),
                ("b", "started"),
                ("b", "drained"),
            ]
            assert all(wave["at"] == hello["at"] + 1.0 for wave in waves)
            maintenance.end("b")
            state = json.loads(await feed.receive())
            assert (state["from"], state["to"], state["reason"]) == ("maintenance", "active", None)
            await feed.receive()  # the summary
            ended = json.loads(await feed.receive())
            assert (ended["type"], ended["wave"], ended["event"]) == ("wave", "b", "ended")


async def test_a_wave_draining_shows_its_running_requests(
    start: Start, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    served = await start()
    maintenance = served.router.maintenance
    with trio.fail_after(120):
        async with served.feed() as feed:
            json.loads(await feed.receive())
            done: list[int] = []

            async def stream(tokens: int) -> None:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": tokens,
                    "narwhal_sim": {"output_tokens": tokens},
                }
                answer = await served.client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200
                done.append(tokens)

            maintenance.start("b")  # both streams go to sim-a (wave a)
            for tokens in (300, 900):
                nursery.start_soon(stream, tokens)
            await until(lambda: sum(len(engine.slots) for engine in served.router.pool) == 2)
            maintenance.start("a", force=True)
            events: list[dict[str, Any]] = []
            while not events or events[-1]["event"] != "drained":
                message = json.loads(await feed.receive())
                if message["type"] == "wave" and message["wave"] == "a":
                    events.append(message)
            assert [(event["event"], event["running"]) for event in events] == [
                ("started", 2),
                ("draining", 1),
                ("drained", 0),
            ]
            assert events[-1]["drained_after_s"] is not None
            assert done == [300, 900]


async def test_a_client_that_does_not_read_loses_summaries_counted(
    start: Start, autojump_clock: trio.testing.MockClock
) -> None:
    served = await start()
    with trio.fail_after(120):
        async with served.feed() as feed:
            hello = json.loads(await feed.receive())
            await trio.sleep(30.5)  # the test client holds 10 messages, the outbox 8
            seen = 0
            while True:
                summary = json.loads(await feed.receive())
                assert summary["type"] == "summary"
                seen += 1
                # Every second is a summary this client got or one it lost, counted.
                assert seen + summary["dropped"] == round(summary["at"] - hello["at"])
                if summary["at"] > trio.current_time() - 1:
                    break
            # Held: 10 by the test client, 1 in the feed's write, OUTBOX_SIZE in its outbox.
            held = 10 + 1 + OUTBOX_SIZE
            assert summary["dropped"] == 30 - held
            assert seen == held + 1


async def test_a_draining_router_closes_the_feed_once_idle(
    start: Start, autojump_clock: trio.testing.MockClock
) -> None:
    served = await start()
    with trio.fail_after(60):
        async with served.feed() as feed:
            json.loads(await feed.receive())
            served.router.begin_drain()
            state = json.loads(await feed.receive())
            assert (state["to"], state["reason"]) == ("draining", "router_draining")
            with pytest.raises(WebsocketDisconnectError) as closed:
                await feed.receive()
            assert closed.value.args[0] == 1001


# -- auth ------------------------------------------------------------------------------------------


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


async def _refused(feed: Any) -> WebsocketResponseError:
    """The refusal of a test client's WebSocket (its nursery wraps it in a group)."""
    refusals: list[BaseException] = []
    try:
        async with feed as connection:
            await connection.receive()
    except* WebsocketResponseError as group:
        refusals = _leaves(group)
    [refused] = refusals
    assert isinstance(refused, WebsocketResponseError)
    return refused


def _envelope(body: bytes, code: str) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


@pytest.mark.parametrize(
    ("headers", "query"),
    [({}, ""), ({"Authorization": "Bearer wrong"}, ""), ({}, "token=wrong"), ({}, "token=")],
    ids=["none", "wrong bearer", "wrong query token", "empty query token"],
)
async def test_a_bad_token_is_a_401_before_the_upgrade(
    start: Start, headers: dict[str, str], query: str, caplog: pytest.LogCaptureFixture
) -> None:
    served = await start()
    with trio.fail_after(10):
        refused = await _refused(served.feed(headers=headers, query=query))
    response = refused.response
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert response.headers["x-request-id"]
    _envelope(await response.get_data(), "admin_unauthorized")
    assert "wrong" not in caplog.text and TOKEN not in caplog.text


async def test_the_query_token_opens_the_feed(start: Start) -> None:
    served = await start()
    with trio.fail_after(10):
        async with served.feed(headers={}, query=f"token={TOKEN}") as feed:
            assert json.loads(await feed.receive())["type"] == "hello"


async def test_without_a_token_configured_the_feed_is_off_but_for_allowed_loopback(
    start: Start,
) -> None:
    served = await start(AdminConfig(token="", allow_loopback_without_token=True))
    with trio.fail_after(10):
        refused = await _refused(served.feed(headers={}, peer=REMOTE))
        assert refused.response.status_code == 403
        _envelope(await refused.response.get_data(), "admin_disabled")
        async with served.feed(headers={}) as feed:
            assert json.loads(await feed.receive())["type"] == "hello"
    off = await start(AdminConfig(token=""))
    with trio.fail_after(10):
        refused = await _refused(off.feed(headers={}))
    assert refused.response.status_code == 403


async def test_the_dashboard_is_served_with_the_same_guard(start: Start) -> None:
    served = await start()
    client = served.client
    for query, headers in [("", BEARER), (f"?token={TOKEN}", {})]:
        page = await client.get(f"/dashboard{query}", headers=headers)
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["referrer-policy"] == "no-referrer"
        assert page.content == DASHBOARD_HTML
    for query, headers in [("", {}), ("?token=wrong", {}), ("", {"Authorization": "Bearer x"})]:
        refused = await client.get(f"/dashboard{query}", headers=headers)
        assert refused.status_code == 401
        _envelope(refused.content, "admin_unauthorized")
    # The query token is for the feed and the dashboard only.
    assert (await client.get(f"/admin/engines?token={TOKEN}")).status_code == 401


async def test_the_feed_without_an_upgrade_is_a_426_envelope(start: Start) -> None:
    served = await start()
    assert (await served.client.get("/admin/events")).status_code == 401
    answer = await served.client.get("/admin/events", headers=BEARER)
    assert answer.status_code == 426
    assert answer.headers["upgrade"] == "websocket"
    _envelope(answer.content, "invalid_request")


async def test_a_websocket_to_a_plain_route_is_an_envelope(start: Start) -> None:
    served = await start()
    for path, status in [("/v1/models", 400), ("/nowhere", 404)]:
        connection = served.app.test_client().websocket(path, scope_base=LOOPBACK)
        with trio.fail_after(10):
            refused = await _refused(connection)
        assert refused.response.status_code == status
        json.loads(await refused.response.get_data())["error"]["code"]


async def test_a_relay_worker_refuses_the_feed_with_an_envelope() -> None:
    from narwhal.workers.worker import WorkerRouter

    config = Config(
        serving=ServingConfig(model=MODEL),
        engines=(engine_config("sim-a"),),
        admin=AdminConfig(token=TOKEN),
    )

    async def never() -> trio.abc.Stream:  # pragma: no cover - the app is never started
        raise OSError("no controller")

    app = create_app(config, router=WorkerRouter(config, never))
    connect = partial(app.test_client().websocket, "/admin/events", scope_base=LOOPBACK)
    with trio.fail_after(10):
        assert (await _refused(connect())).response.status_code == 401
        refused = await _refused(connect(headers=BEARER))
    assert refused.response.status_code == 501
    _envelope(await refused.response.get_data(), "feed_unavailable")


# -- over real sockets -----------------------------------------------------------------------------


@attrs.define
class Live:
    url: str
    port: int
    stop: trio.Event
    stopped: trio.Event


def live_config(**admin: Any) -> Config:
    return Config(
        serving=ServingConfig(model=MODEL),
        engines=(
            EngineConfig(name="sim-a", url="http://sim-a.invalid"),
            EngineConfig(name="sim-b", url="http://sim-b.invalid", wave="b"),
        ),
        monitoring=MonitoringConfig(lag_sustain_s=3600.0),  # not about the watchdog
        admin=AdminConfig(**({"token": TOKEN} | admin)),
    )


async def start_live(nursery: trio.Nursery, config: Config) -> Live:
    """The router served by Narwhal's own server on a loopback port, ready."""
    stop, stopped = trio.Event(), trio.Event()

    async def run(task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            await serve(
                config,
                bind="127.0.0.1:0",
                transports=demo_transports(config, time_scale=0.05),
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )
        finally:
            stopped.set()

    [url] = await nursery.start(run)
    live = Live(url, int(url.rpartition(":")[2]), stop, stopped)
    await wait_ready(url)
    return live


@pytest.fixture
async def live(nursery: trio.Nursery) -> Live:
    return await start_live(nursery, live_config())


HANDSHAKE = (
    b"GET /admin/events%s HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n%s\r\n"
)


async def raw_answer(port: int, data: bytes, *, within_s: float = 5.0) -> bytes:
    """What the server sends back to ``data`` until it closes, or ``within_s`` passes."""
    received = b""
    with trio.move_on_after(within_s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(data)
            while chunk := await stream.receive_some(65536):
                received += chunk
                if b"\r\n\r\n" in received:
                    head, _, body = received.partition(b"\r\n\r\n")
                    length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
                    if length and len(body) >= int(length.group(1)):
                        break
    return received


@pytest.mark.realtime
@pytest.mark.parametrize(
    ("query", "header"),
    [(b"", b""), (b"?token=wrong", b""), (b"", b"Authorization: Bearer wrong\r\n")],
    ids=["no token", "wrong query token", "wrong bearer"],
)
async def test_a_bad_token_is_a_raw_http_401_before_any_upgrade(
    live: Live, query: bytes, header: bytes
) -> None:
    answer = await raw_answer(live.port, HANDSHAKE % (query, header))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 "), answer
    assert b"upgrade" not in head.lower() and b"sec-websocket-accept" not in head.lower()
    _envelope(body, "admin_unauthorized")


@pytest.mark.realtime
@pytest.mark.parametrize(
    "header",
    [
        b"Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits=abc\r\n",
        b"Sec-WebSocket-Extensions: \xe9x\r\n",
        b"Sec-WebSocket-Protocol: \xff\r\n",
        b"Connection: keep-alive, \xff\r\n",
    ],
    ids=["unreadable window size", "non-ASCII extension", "non-ASCII protocol", "non-ASCII token"],
)
async def test_a_handshake_hypercorn_cannot_read_is_a_400_envelope(
    live: Live, header: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A handshake whose headers Hypercorn cannot decode, or whose extension offer wsproto
    cannot read, with a valid token: a 400 envelope before any upgrade. (It was no answer at
    all, and a traceback in the log: Hypercorn raised making the handshake, or accepting it.)
    The feed still serves."""
    answer = await raw_answer(live.port, HANDSHAKE % (f"?token={TOKEN}".encode(), header))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert b"upgrade" not in head.lower() and b"sec-websocket-accept" not in head.lower()
    _envelope(body, "invalid_request")
    assert not [record for record in caplog.records if record.levelname == "ERROR"]
    with trio.fail_after(10):
        async with open_feed(f"ws://127.0.0.1:{live.port}/admin/events?token={TOKEN}") as feed:
            assert json.loads(await feed.get_message())["type"] == "hello"


@pytest.mark.realtime
async def test_a_live_feed_greets_summarises_and_follows_maintenance(live: Live) -> None:
    async with httpx.AsyncClient(base_url=live.url, headers=BEARER) as client:
        with trio.fail_after(20):
            url = f"ws://127.0.0.1:{live.port}/admin/events?token={TOKEN}"
            async with open_feed(url) as feed:
                hello = json.loads(await feed.get_message())
                assert hello["type"] == "hello" and hello["state"] == "active"
                chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
                assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
                offered = 0
                while True:
                    summary = json.loads(await feed.get_message())
                    assert summary["type"] == "summary"
                    offered += summary["counts"]["offered"]
                    if offered:
                        break
                assert offered == 1
                for wave in ("a", "b"):
                    started = await client.post(f"/admin/maintenance/{wave}?force=true")
                    assert started.status_code == 200, started.text
                while True:
                    message = json.loads(await feed.get_message())
                    if message["type"] == "state":
                        break
                assert (message["from"], message["to"]) == ("active", "maintenance")
                assert message["reason"] == "router_maintenance"


@pytest.mark.realtime
async def test_a_graceful_shutdown_closes_the_feed_at_once(live: Live) -> None:
    with trio.fail_after(20):
        async with open_feed(f"ws://127.0.0.1:{live.port}/admin/events", token=TOKEN) as feed:
            assert json.loads(await feed.get_message())["type"] == "hello"
            began = trio.current_time()
            live.stop.set()
            messages = []
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    messages.append(json.loads(await feed.get_message()))
            assert closed.value.reason is not None and closed.value.reason.code == 1001
            assert [m["to"] for m in messages if m["type"] == "state"] == ["draining"]
        await live.stopped.wait()
        # The feed did not hold the shutdown until its connections were aborted.
        assert trio.current_time() - began < CLOSE_GRACE_S


@pytest.mark.realtime
async def test_bytes_before_the_upgrade_is_accepted_get_an_envelope(live: Live) -> None:
    answer = await raw_answer(live.port, HANDSHAKE % (b"", b"") + b"x")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    _envelope(body, "invalid_request")


@pytest.mark.realtime
async def test_bytes_before_the_upgrade_log_no_error(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    answer = await raw_answer(live.port, HANDSHAKE % (b"", b"") + b"x")
    # The server's 400 to the early bytes, or the application's refusal: whichever began first.
    assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 401 ")), answer
    async with httpx.AsyncClient() as client:  # the refusal has run by now
        assert (await client.get(f"{live.url}/health")).status_code == 200
    assert "Error in ASGI Framework" not in caplog.text


def test_the_serving_layer_upgrades_on_the_feed_route() -> None:
    """Narwhal's HTTP/1.1 protocol passes an upgrade to the WebSocket stream only on the paths
    it names: the feed's route must be one of them (else its upgrades are plain HTTP)."""
    assert FEED_PATH.encode() in HTTP11Protocol.websocket_paths
