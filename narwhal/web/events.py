"""The live event feed (``GET /admin/events``, a WebSocket) and the dashboard it feeds
(``GET /dashboard``).

Both are admin routes (:func:`narwhal.web.admin.authorize`): ``Authorization: Bearer
<admin.token>``, or, because a browser cannot put a header on a WebSocket, ``?token=<admin.token>``
(these two routes only). A refused feed is an HTTP answer (401 ``admin_unauthorized``, 403
``admin_disabled``) sent *before* any upgrade, with the envelope, through the ASGI WebSocket
denial extension; the token is never logged.

Each message is one JSON object in a text frame, ``"type"`` first:

- ``hello``: at once: version, model, state, the admission settings, engines, waves, counters;
- ``state``: every change of the router's state (``from``, ``to``, ``reason``), when it happens
  (the router's :class:`~narwhal.control.state.ControlState` wakes the feed);
- ``summary``: every second: what the counters moved in that second, the queue, requests in
  flight, the TTFT quantiles of that second's completions, the engines' occupancy;
- ``wave``: maintenance wave progress (``started``, ``draining``, ``drained``, ``ended``), read
  with the summary.

Nothing here is on a request's path: the feed reads the same ``statistics()`` snapshots ``/ready``
renders, once a second per client, and the state changes the control plane already announces.

Every client has a small :class:`Outbox`: a client that reads slower than the feed writes loses
summaries (counted, and the count travels in the next summary it gets), never state or wave
events (they push out a summary instead); one that lets :data:`OUTBOX_SIZE` state and wave events
pile up is closed (1008). A draining router closes every feed (1001) once its last request has
ended, so no feed holds a shutdown.

The messages are made by plain functions of snapshots (:func:`sample`, :func:`summary_message`,
:func:`wave_messages`), tested without a loop; :func:`serve_feed` is the Trio shell.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from importlib.resources import files
from typing import Any, Final

import attrs
import orjson
import trio
from quart import Response, has_websocket_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers, MultiDict
from werkzeug.routing import WebsocketMismatch

from narwhal.admission.accounting import TERMINAL_CLASSES
from narwhal.config import AdminConfig
from narwhal.control.maintenance import WaveStatistics
from narwhal.control.state import Transition
from narwhal.errors import AdminError, FrameworkHTTPError
from narwhal.router import Router, RouterBase
from narwhal.scheduling.engines import EngineStatistics
from narwhal.web.admin import refusal
from narwhal.web.client import request_id
from narwhal.web.responses import error_response

__all__ = [
    "DASHBOARD_HTML",
    "DASHBOARD_PATH",
    "FEED_PATH",
    "OUTBOX_SIZE",
    "SUMMARY_S",
    "FeedUnavailable",
    "Outbox",
    "Sample",
    "hello_message",
    "quantile",
    "register_events",
    "sample",
    "serve_feed",
    "state_message",
    "summary_message",
    "wave_messages",
]

log = logging.getLogger(__name__)

FEED_PATH: Final = "/admin/events"
DASHBOARD_PATH: Final = "/dashboard"

SUMMARY_S: Final = 1.0
"""The summary's period, on the router's clock."""

OUTBOX_SIZE: Final = 8
"""Messages waiting for one client at most."""

GOING_AWAY: Final = 1001  # RFC 6455: the server is going down
POLICY: Final = 1008  # RFC 6455: the client broke a rule (here: it did not keep up)

COUNTERS: Final = ("offered", "unsized_offered", *TERMINAL_CLASSES)
"""What a summary counts per second: the names of ``/ready``'s counters."""

DASHBOARD_HTML: Final = files("narwhal.web").joinpath("dashboard.html").read_bytes()
"""The dashboard: one page, its style and script inline, nothing fetched from anywhere but the
feed (package data, so it ships in the wheel)."""

# The dashboard may run its own inline script and style, and talk to this origin only.
DASHBOARD_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


class FeedUnavailable(AdminError):
    """This process cannot serve the feed (a relay worker: the books are its controller's)."""

    status = 501
    type = "server_error"
    default_code = "feed_unavailable"


class FeedClientLagging(Exception):
    """A client let :data:`OUTBOX_SIZE` events pile up: it is closed."""


# -- the pure part: snapshots in, messages out -----------------------------------------------------


@attrs.frozen
class Sample:
    """What the feed reads of the router at one instant.

    Attributes:
        at: the router's clock (``trio.current_time()``).
        wall: the wall clock (UNIX seconds) at the same instant.
        state: the router's state, and ``reason`` why it is not active.
        ready: whether ``/ready`` would answer 200.
        counters: ``/ready``'s counters (:data:`COUNTERS`), as totals since the start.
        in_flight: offered requests not yet ended.
        queue_depth: requests waiting for placement.
        retention_in_use: HTTP retention slots held.
        ttft: the TTFT histogram's cumulative buckets, ``(upper bound, count)``, the last
            bound ``inf``.
        engines: every engine's snapshot.
        waves: every maintenance wave's.
    """

    at: float
    wall: float
    state: str
    reason: str | None
    ready: bool
    counters: Mapping[str, int]
    in_flight: int
    queue_depth: int
    retention_in_use: int
    ttft: tuple[tuple[float, float], ...]
    engines: tuple[EngineStatistics, ...]
    waves: tuple[WaveStatistics, ...]


def _ttft_buckets(router: Router) -> tuple[tuple[float, float], ...]:
    buckets: list[tuple[float, float]] = []
    for family in router.metrics.ttft.collect():
        for item in family.samples:
            if item.name.endswith("_bucket"):
                buckets.append((float(item.labels["le"]), float(item.value)))
    return tuple(buckets)


def sample(router: Router) -> Sample:
    """Read the router's snapshots once (what ``/ready`` and ``/admin/maintenance`` show)."""
    stats = router.statistics()
    books = stats.accounting
    totals = {"offered": books.offered, "unsized_offered": books.unsized_offered}
    return Sample(
        at=trio.current_time(),
        wall=time.time(),
        state=stats.state,
        reason=stats.reason,
        ready=stats.ready,
        counters=totals | {name: books.terminal[name] for name in TERMINAL_CLASSES},
        in_flight=books.in_flight,
        queue_depth=stats.queue.depth,
        retention_in_use=stats.retention.in_use,
        ttft=_ttft_buckets(router),
        engines=stats.engines,
        waves=router.maintenance.statistics(),
    )


def quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a histogram's cumulative ``(upper bound, count)`` buckets, read
    as Prometheus's ``histogram_quantile`` reads them: linear within the bucket it falls in,
    the highest finite bound when it falls above every bound; ``None`` with no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        if not math.isinf(bound):
            lower = bound
        below = count
    return lower


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _engine(engine: EngineStatistics) -> dict[str, Any]:
    return {
        "name": engine.name,
        "wave": engine.wave,
        "state": engine.state,
        "eligible": engine.eligible,
        "reason": engine.reason,
        "maintenance": engine.maintenance is not None,
        "token_accounting": engine.token_accounting,
        "prefill": engine.prefill,
        "decode": engine.decode,
        "prefill_limit": engine.prefill_limit,
        "decode_limit": engine.decode_limit,
    }


def _wave(status: WaveStatistics) -> dict[str, Any]:
    return {
        "wave": status.wave,
        "engines": list(status.engines),
        "in_maintenance": status.in_maintenance,
        "forced": status.forced,
        "running": status.running_total,
        "running_by_engine": dict(status.running),
        "drained": status.drained,
        "started_s": _round(status.started_s),
        "drained_after_s": _round(status.drained_after_s),
    }


def hello_message(router: Router, now: Sample) -> dict[str, Any]:
    """The first message: who this router is and where it stands."""
    from narwhal import __version__

    admission = router.config.admission
    return {
        "type": "hello",
        "at": now.at,
        "time": now.wall,
        "version": __version__,
        "model": router.config.serving.model,
        "state": now.state,
        "reason": now.reason,
        "ready": now.ready,
        "summary_interval_s": SUMMARY_S,
        "admission": {
            "mode": admission.mode,
            "ttft_budget_s": admission.ttft_budget_s,
            "admission_wait_s": admission.admission_wait_s,
            "queue_limit": admission.queue_limit,
            "http_retention_limit": admission.http_retention_limit,
            "prefill_concurrency": admission.prefill_concurrency,
            "decode_concurrency": admission.decode_concurrency,
            "tpot_target_s": admission.tpot_target_s,
        },
        "engines": [_engine(engine) for engine in now.engines],
        "waves": [_wave(status) for status in now.waves],
        "counters": dict(now.counters) | {"in_flight": now.in_flight},
    }


def summary_message(before: Sample, after: Sample) -> dict[str, Any]:
    """What happened between two samples (a second apart): the counters' moves, the gauges at
    its end, and the TTFT quantiles of the requests that completed in it (the
    ``narwhal_ttft_seconds`` buckets, so bucket-resolution estimates)."""
    ttft = tuple(
        (bound, count - earlier)
        for (bound, count), (_, earlier) in zip(after.ttft, before.ttft, strict=True)
    )
    return {
        "type": "summary",
        "at": after.at,
        "time": after.wall,
        "interval_s": round(after.at - before.at, 6),
        "state": after.state,
        "reason": after.reason,
        "ready": after.ready,
        "counts": {name: after.counters[name] - before.counters[name] for name in COUNTERS},
        "in_flight": after.in_flight,
        "queue_depth": after.queue_depth,
        "retention_in_use": after.retention_in_use,
        "ttft": {
            "count": int(ttft[-1][1]) if ttft else 0,
            "p50_s": _round(quantile(ttft, 0.5)),
            "p99_s": _round(quantile(ttft, 0.99)),
        },
        "engines": [
            {
                "name": engine.name,
                "eligible": engine.eligible,
                "reason": engine.reason,
                "prefill": engine.prefill,
                "decode": engine.decode,
            }
            for engine in after.engines
        ],
        "dropped": 0,  # the client's outbox writes its count
    }


def _wave_event(event: str, status: WaveStatistics, now: Sample) -> dict[str, Any]:
    return {"type": "wave", "at": now.at, "time": now.wall, "event": event} | _wave(status)


def wave_messages(before: Iterable[WaveStatistics], now: Sample) -> list[dict[str, Any]]:
    """The wave events between two samples: a wave ``started`` (then ``drained`` at once if
    nothing ran on it), still ``draining`` with fewer or more requests running, ``drained``,
    or ``ended``."""
    earlier = {status.wave: status for status in before}
    messages = []
    for status in now.waves:
        old = earlier.get(status.wave)
        was_in = old is not None and old.in_maintenance
        if not status.in_maintenance:
            if was_in:
                messages.append(_wave_event("ended", status, now))
            continue
        if not was_in:
            messages.append(_wave_event("started", status, now))
            if status.drained:
                messages.append(_wave_event("drained", status, now))
        elif status.drained and old is not None and not old.drained:
            messages.append(_wave_event("drained", status, now))
        elif not status.drained and old is not None and old.running != status.running:
            messages.append(_wave_event("draining", status, now))
    return messages


def state_message(
    old: str, new: str, reason: str | None, at: float, *, now: float, wall: float
) -> dict[str, Any]:
    """One change of the router's state, that happened at ``at`` on the router's clock (``now``
    and ``wall`` are the router's clock and the wall clock of one instant)."""
    return {
        "type": "state",
        "at": at,
        "time": wall - (now - at),
        "from": old,
        "to": new,
        "reason": reason,
    }


# -- one client's outbox ---------------------------------------------------------------------------


@attrs.frozen
class Close:
    """The last thing a feed sends: a close frame."""

    code: int
    reason: str


class Outbox:
    """The messages waiting for one client, at most ``size``.

    A summary that finds it full is dropped; a state or wave event pushes out the oldest
    summary waiting, and raises :class:`FeedClientLagging` when none is left to push.
    """

    def __init__(self, size: int = OUTBOX_SIZE) -> None:
        self.size = size
        self.dropped = 0  # summaries this client never got
        self._items: deque[dict[str, Any]] = deque()
        self._close: Close | None = None
        self._wake = trio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, message: dict[str, Any]) -> None:
        """Queue ``message`` for the client (never waits).

        Raises:
            FeedClientLagging: the outbox is full of events that may not be dropped.
        """
        if self._close is not None:
            return
        if len(self._items) >= self.size:
            if message["type"] == "summary":
                self.dropped += 1
                return
            for index, waiting in enumerate(self._items):
                if waiting["type"] == "summary":
                    del self._items[index]
                    self.dropped += 1
                    break
            else:
                raise FeedClientLagging
        if message["type"] == "summary":
            message["dropped"] = self.dropped  # lost before this one
        self._items.append(message)
        self._wake.set()

    def close(self, code: int, reason: str) -> None:
        """End the feed: what waits is still sent, then the close."""
        if self._close is None:
            self._close = Close(code, reason)
            self._wake.set()

    async def get(self) -> dict[str, Any] | Close:
        """The next message, or the close once every message before it is out."""
        while True:
            if self._items:
                return self._items.popleft()
            if self._close is not None:
                return self._close
            self._wake = trio.Event()
            await self._wake.wait()


# -- the Trio shell --------------------------------------------------------------------------------


async def _summaries(router: Router, outbox: Outbox, first: Sample) -> None:
    """Every :data:`SUMMARY_S` on the router's clock (ticks the loop was too late for are
    skipped: the next summary covers them, its ``interval_s`` says how long)."""
    last = first
    ticks = 1
    while True:
        await trio.sleep_until(first.at + ticks * SUMMARY_S)
        now = sample(router)
        # The next tick, past any the loop was too late for (and past this one, whatever
        # the float arithmetic of the deadline gave back).
        ticks = max(ticks + 1, math.floor((now.at - first.at) / SUMMARY_S) + 1)
        outbox.put(summary_message(last, now))
        for message in wave_messages(last.waves, now):
            outbox.put(message)
        last = now


def _after(history: Iterable[Transition], seen: Transition | None) -> list[Transition]:
    items = list(history)
    for index in range(len(items) - 1, -1, -1):
        if items[index] is seen:
            return items[index + 1 :]
    return items


async def _states(
    router: Router, outbox: Outbox, seen: Transition | None, shown: tuple[str, str | None]
) -> None:
    """A ``state`` message for every change after ``seen`` (the last transition the hello
    knew of, when it showed ``shown``), as it happens; once the router drains, the feed ends
    when its last request has."""
    control = router.control
    while True:
        at, wall = trio.current_time(), time.time()
        fresh = _after(control.history, seen)
        for change in fresh:
            outbox.put(
                state_message(change.old, change.new, change.reason, change.at, now=at, wall=wall)
            )
        if fresh:
            seen = fresh[-1]
            shown = (fresh[-1].new, fresh[-1].reason)
        current = (control.state, control.reason)
        if current != shown:  # the reason changed, not the state
            outbox.put(state_message(shown[0], current[0], current[1], at, now=at, wall=wall))
        shown = current
        if shown[0] == "draining":
            break
        await control.wait_changed()
    await router.wait_idle()
    outbox.close(GOING_AWAY, "the router is shutting down")


async def _ignore_input(feed: Any) -> None:
    # Read what the client sends, so that its close and pings are seen; the feed has no
    # commands.
    while True:
        await feed.receive()


async def _send(feed: Any, outbox: Outbox) -> Close:
    while True:
        message = await outbox.get()
        if isinstance(message, Close):
            return message
        await feed.send(orjson.dumps(message).decode())


async def serve_feed(router: Router, feed: Any) -> None:
    """Serve one accepted feed client (Quart's ``websocket``) until it goes or the router
    drains: its hello, then states, summaries and waves, from one nursery."""
    outbox = Outbox()
    control = router.control
    # What the hello shows, and the last change it knew of: a change before the tasks below
    # run is still sent.
    seen = control.history[-1] if control.history else None
    first = sample(router)
    outbox.put(hello_message(router, first))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_summaries, router, outbox, first)
            nursery.start_soon(_states, router, outbox, seen, (first.state, first.reason))
            nursery.start_soon(_ignore_input, feed)
            ending = await _send(feed, outbox)
            nursery.cancel_scope.cancel()
    except* FeedClientLagging:
        log.warning("event feed client too slow: closed after %d summaries lost", outbox.dropped)
        ending = Close(POLICY, "too slow: events piled up")
    await feed.close(ending.code, ending.reason)


# -- the routes ------------------------------------------------------------------------------------


def _credentials(headers: Headers, args: MultiDict[str, str]) -> str | None:
    """The bearer credentials: the ``Authorization`` header, else ``?token=``."""
    header = headers.get("authorization")
    if header:
        return header
    token = args.get("token")
    return None if token is None else f"Bearer {token}"


def _refusal(admin: AdminConfig, connection: Any) -> Response | None:
    """``None`` when the caller (Quart's ``request`` or ``websocket``) may in, else the answer
    that refuses it (logged without what was sent)."""
    rid = request_id({"x-request-id": connection.headers.get("x-request-id", "")})
    client = connection.scope.get("client")
    host = client[0] if client else None
    credentials = _credentials(connection.headers, connection.args)
    response = refusal(admin, credentials, host, connection.path, rid)
    if response is not None:
        response.headers["x-request-id"] = rid
    return response


def register_events(app: QuartTrio, router: RouterBase) -> None:
    """Add ``/admin/events`` and ``/dashboard`` to ``app``.

    A relay worker's app (a router that is not a :class:`~narwhal.router.Router`) answers the
    feed, once authorized, with 501 ``feed_unavailable``: its HTTP routes are its controller's,
    but a WebSocket cannot be forwarded to it.
    """
    admin = router.config.admin

    @app.errorhandler(WebsocketMismatch)
    async def mismatch(exc: WebsocketMismatch) -> Response:
        # An upgrade to a plain route, or a plain request to a WebSocket one.
        if has_websocket_context():
            message = (
                f"{websocket.path} is not a WebSocket route; send it without `Upgrade: websocket`."
            )
        else:
            message = f"{request.path} is a WebSocket route: send the upgrade handshake."
        return error_response(FrameworkHTTPError(message, status=400))

    @app.websocket(FEED_PATH)
    async def events() -> Response | None:
        refused = _refusal(admin, websocket)
        if refused is not None:
            return refused
        if not isinstance(router, Router):
            return error_response(
                FeedUnavailable(
                    "The event feed is not served by relay workers (serving.workers > 1) yet; "
                    "the admin HTTP routes are."
                )
            )
        await websocket.accept()
        await serve_feed(router, websocket)
        return None

    if not isinstance(router, Router):
        return  # the HTTP routes below are forwarded to the controller

    @app.get(FEED_PATH)
    async def events_without_upgrade() -> Response:
        refused = _refusal(admin, request)
        if refused is not None:
            return refused
        error = FrameworkHTTPError(
            f"{FEED_PATH} is a WebSocket: send the upgrade handshake "
            "(narwhal top, or the dashboard, do).",
            status=426,
        )
        response = error_response(error)
        response.headers["Upgrade"] = "websocket"
        return response

    @app.get(DASHBOARD_PATH)
    async def dashboard() -> Response:
        refused = _refusal(admin, request)
        if refused is not None:
            return refused
        return Response(
            DASHBOARD_HTML,
            content_type="text/html; charset=utf-8",
            headers=DASHBOARD_HEADERS,
        )
