"""The simulated engine as an httpx transport, for in-process tests in Trio (virtual) time.

``httpx.AsyncClient(transport=SimTransport(engine), base_url="http://engine-a")`` talks to the
engine without sockets. Unlike httpx's ``ASGITransport``, which buffers the whole body, the
response body yields each frame when the plan says so, sleeping with :func:`trio.sleep`: under
``trio.testing.MockClock(autojump_threshold=0)`` a stream's first chunk arrives exactly at its
simulated TTFT. A planned connection drop raises :class:`httpx.RemoteProtocolError`, as a broken
socket does through httpx's own transport.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import httpx
import orjson
import trio

from narwhal.sim.engine import SimConnectionDropped, SimEngine, SimStream, StreamState

__all__ = ["SimTransport", "SimTransportStatistics"]


@attrs.frozen
class SimTransportStatistics:
    """A snapshot of a :class:`SimTransport`.

    Streams are the response bodies of the completion routes (errors and non-streaming answers
    included); ``/health``, ``/v1/models`` and ``/metrics`` are counted only as requests.

    Attributes:
        requests_received: every HTTP request, any route.
        completion_requests: requests to the completion routes.
        streams_open: completion bodies not finished yet (head pending or being read).
        streams_completed: bodies read to the end.
        streams_closed_early: bodies the reader closed before the end (or cancelled while waiting
            for the head).
        streams_dropped: bodies whose connection the plan broke.
    """

    requests_received: int
    completion_requests: int
    streams_open: int
    streams_completed: int
    streams_closed_early: int
    streams_dropped: int


class _ByteStream(httpx.AsyncByteStream):
    """The response body: plays the engine's stream and translates a drop for httpx.

    It is its own iterator rather than an async generator, so an abandoned body leaves nothing
    for the garbage collector to finalise.
    """

    def __init__(self, stream: SimStream, request: httpx.Request) -> None:
        self._stream = stream
        self._request = request

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            raise
        except SimConnectionDropped as exc:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body "
                "(incomplete chunked read)",
                request=self._request,
            ) from exc
        except BaseException:
            # A reader cancelled mid-read has given up on the body: count the close now,
            # before httpx gets to aclose().
            self._stream.close()
            raise

    async def aclose(self) -> None:
        self._stream.close()


class SimTransport(httpx.AsyncBaseTransport):
    """Serves a :class:`SimEngine` to an ``httpx.AsyncClient`` in-process.

    Routes: ``GET /health`` (200), ``GET /v1/models``, ``GET /metrics``, ``GET /version`` (vLLM
    dialect) and the completion routes (``POST``); anything else is the dialect's 404 or 405.
    The request headers reach the engine (``Authorization`` for its API key, ``X-Request-Id``).

    Attributes:
        engine: the engine served.
        requests: the JSON bodies received on the completion routes, in arrival order (a body
            that is not a JSON object is recorded as ``{"_raw": <text>}``).
        headers: the request headers of those same requests.
        record: keep ``requests`` and ``headers`` (a benchmark replaying tens of thousands of
            requests turns it off; the counters stay).
    """

    def __init__(self, engine: SimEngine, *, record: bool = True) -> None:
        self.engine = engine
        self.record = record
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._received = 0
        self._completions = 0
        self._open = 0
        self._ended: dict[StreamState, int] = {}
        self._changed = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Answer ``request`` from the engine's plan; the body streams in Trio time."""
        self._received += 1
        # Read from the stream, not with ``aread``: that would keep the body on the request,
        # which its response holds for as long as the stream runs (the prompt of every running
        # request, counted as the router's memory by the admission benchmark).
        body = request.stream
        if not isinstance(body, httpx.AsyncByteStream):
            raise TypeError("SimTransport serves async request bodies only")
        raw = b"".join([part async for part in body])
        path = request.url.path
        plan = self.engine.respond(
            request.method, path, raw, created=int(time.time()), headers=request.headers
        )
        if not plan.completion:
            return httpx.Response(plan.status, headers=plan.headers, content=plan.body)
        self._record(raw, request)
        self._open += 1
        self._notify()
        stream = self.engine.stream(plan, on_end=self._on_end)
        try:
            await stream.wait_head()
        except SimConnectionDropped as exc:
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response.", request=request
            ) from exc
        headers = list(plan.headers)
        if not plan.streaming and not plan.drop:
            headers.append(("content-length", str(len(plan.body))))  # as vLLM's JSON answers
        return httpx.Response(plan.status, headers=headers, stream=_ByteStream(stream, request))

    def statistics(self) -> SimTransportStatistics:
        """A snapshot of the transport's counters."""
        return SimTransportStatistics(
            requests_received=self._received,
            completion_requests=self._completions,
            streams_open=self._open,
            streams_completed=self._ended.get("completed", 0),
            streams_closed_early=self._ended.get("closed_early", 0),
            streams_dropped=self._ended.get("dropped", 0),
        )

    async def wait_until(self, predicate: Callable[[SimTransportStatistics], bool]) -> None:
        """Wait until ``predicate(self.statistics())`` holds (checked after every change).

        For tests: ``await transport.wait_until(lambda s: s.streams_closed_early == 1)``; bound
        it with a ``trio.fail_after``.
        """
        while not predicate(self.statistics()):
            await self._changed.wait()

    def _record(self, raw: bytes, request: httpx.Request) -> None:
        self._completions += 1
        if not self.record:
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        self.requests.append(
            body if isinstance(body, dict) else {"_raw": raw.decode(errors="replace")}
        )
        self.headers.append(dict(request.headers))

    def _on_end(self, state: StreamState) -> None:
        self._open -= 1
        self._ended[state] = self._ended.get(state, 0) + 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
