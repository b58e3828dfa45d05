"""One pooled httpx client per engine, and the streams opened through it.

Transport timeouts (connect, the longest gap between two reads) are set once per engine from
``[upstream]``; request deadlines are cancel scopes opened by the caller, never timeouts here.
httpx's exceptions are translated at this boundary into :mod:`narwhal.errors`: the message names
the engine by its configured name and the kind of failure, never an exception's repr or an
address; the detail goes to the log, with the request's id.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import attrs
import httpx
import orjson
import trio

from narwhal.config import EngineConfig, UpstreamConfig
from narwhal.errors import (
    EngineBusy,
    EngineError,
    EngineRejectedRequest,
    EngineResponseError,
    EngineUnreachable,
)
from narwhal.protocol.chunks import ChunkFacts, inspect_chunk
from narwhal.protocol.sse import DONE, SSEDecoder
from narwhal.scheduling.health import FailureKind
from narwhal.upstream.transport import (
    EngineTransport,
    OneShotBody,
    StreamResponse,
    request_head,
)

__all__ = [
    "FENCE_HEADER",
    "MAX_EVENT_BYTES",
    "MAX_WHOLE_BYTES",
    "ChunkEvent",
    "DoneEvent",
    "EngineClient",
    "ErrorFrameEvent",
    "UpstreamEvent",
    "UpstreamStream",
    "WholeAnswer",
    "normalise_engine_error",
    "transport_error",
    "transport_kind",
]

log = logging.getLogger(__name__)

DRAIN_AFTER_DONE_S = 1.0
FENCE_HEADER = "x-narwhal-fence"  # the lease's fencing token, on every request to an engine
MAX_EVENT_BYTES = 4 * 1024 * 1024  # an engine event (SSE block) longer than this is malformed
MAX_WHOLE_BYTES = 64 * 1024 * 1024  # a non-streaming answer longer than this is malformed

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_STREAM_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


class _StreamHead(NamedTuple):
    """A route's stream request head: the request that names it (method and URL, for the
    response and exceptions), its lines (:func:`request_head`) and its header names."""

    request: httpx.Request
    lines: bytes
    names: frozenset[bytes]


class ChunkEvent(NamedTuple):
    """A decoded, validated chunk, with its raw bytes for forwarding unchanged (a named tuple:
    one is made for every chunk relayed)."""

    raw: bytes
    chunk: dict[str, Any]
    facts: ChunkFacts


@attrs.frozen(slots=True)
class ErrorFrameEvent:
    """An in-band ``data: {"error": ...}`` frame."""

    error: dict[str, Any]

    def message(self) -> str:
        """The engine's message, for logs and the client's in-band error."""
        message = self.error.get("message") if isinstance(self.error, dict) else None
        return str(message) if message else "the engine reported an error mid-stream"

    def rejection(self) -> EngineRejectedRequest | None:
        """The frame as the client's error when its ``code`` is a 4xx status, else ``None``.

        vLLM writes the status of the error as the frame's ``code`` (``400`` for a bad
        parameter it checks only once the stream has begun); a numeric string counts too. The
        envelope is normalised as for an engine's 4xx answer (:func:`normalise_engine_error`).
        A frame with a 5xx code, or none, is an engine failure (``None`` here).
        """
        status = _client_status(self.error.get("code"))
        if status is None:
            return None
        param, code = _param_and_code(self.error)
        return EngineRejectedRequest(self.message(), status=status, param=param, code=code)


@attrs.frozen(slots=True)
class DoneEvent:
    """``data: [DONE]``, or the end of the body; ``clean`` is false for a missing ``[DONE]``."""

    clean: bool


UpstreamEvent = ChunkEvent | ErrorFrameEvent | DoneEvent


@attrs.frozen(slots=True)
class WholeAnswer:
    """An engine's non-streaming answer (a status below 400): its status and bytes, to relay
    as they are, and its JSON."""

    status: int
    raw: bytes
    body: dict[str, Any]


class EngineClient:
    """The connection pool to one engine."""

    def __init__(
        self,
        engine: EngineConfig,
        upstream: UpstreamConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.engine = engine
        timeout = httpx.Timeout(
            connect=upstream.connect_timeout_s,
            read=upstream.read_timeout_s,
            write=upstream.connect_timeout_s,
            pool=upstream.connect_timeout_s,
        )
        limits = httpx.Limits(
            max_connections=upstream.max_connections,
            max_keepalive_connections=upstream.max_connections,
        )
        if transport is None and engine.url.startswith("http://"):
            transport = EngineTransport(max_connections=upstream.max_connections, timeout=timeout)
        # The engine's API key goes with every call made through this client: requests, polls
        # and probes (httpx masks it in the headers' repr; nothing logs headers).
        key = engine.api_key()
        self.http = httpx.AsyncClient(
            base_url=engine.url,
            timeout=timeout,
            limits=limits,
            transport=transport,
            headers=None if key is None else {"authorization": f"Bearer {key}"},
        )
        # Streams go straight to the transport when it is one we hold (Narwhal's own, or one
        # given in place of the network): the client's layers (URL merging, auth flows,
        # redirects, cookies, the response wrapper) cost more per request than the transport
        # itself, and a stream needs none of them. An https engine goes through the client.
        self._transport = transport
        self._urls: dict[str, httpx.URL] = {}
        self._urls_base: httpx.URL | None = None
        # Narwhal's own transport is handed each stream's request framed already, from a head
        # made once per route (the client's headers, then ours), and a request made once to
        # name it: no httpx.Request per stream.
        self._framer = (
            transport
            if isinstance(transport, EngineTransport) and engine.url.startswith("http://")
            else None
        )
        self._heads: dict[str, _StreamHead] = {}
        self._heads_base: httpx.URL | None = None

    def _url(self, route: Literal["chat", "completions"]) -> httpx.URL:
        """The route's URL on the client's base URL, merged once per base URL."""
        base = self.http.base_url
        if base is not self._urls_base:
            self._urls = {
                name: self.http.build_request("POST", path).url for name, path in _PATHS.items()
            }
            self._urls_base = base
        return self._urls[route]

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self.http.aclose()

    def set_fence(self, token: int) -> None:
        """Send ``token`` as ``x-narwhal-fence`` with every request from now on: the lease's
        fencing token (:mod:`narwhal.control.lease`), in the client's own headers, so that no
        request pays for it."""
        self.http.headers[FENCE_HEADER] = str(token)
        self._heads = {}  # made again with the token

    def _stream_head(self, route: Literal["chat", "completions"]) -> _StreamHead:
        """The route's stream request head, made once per base URL and set of client headers
        (only :meth:`set_fence` changes them once the client exists)."""
        base = self.http.base_url
        if base is not self._heads_base:
            self._heads = {}
            self._heads_base = base
        head = self._heads.get(route)
        if head is None:
            merged = [
                (name, value)
                for name, value in self.http.headers.items()
                if name not in _STREAM_HEADERS
            ]
            request = httpx.Request(
                "POST", self._url(route), headers=[*merged, *_STREAM_HEADERS.items()]
            )
            names = frozenset(name.lower() for name, _ in request.headers.raw)
            head = _StreamHead(request, request_head(request), names)
            self._heads[route] = head
        return head

    def _framed(
        self, route: Literal["chat", "completions"], body: bytes, headers: Mapping[str, str]
    ) -> tuple[httpx.Request, bytes] | None:
        """``body``'s whole request and the request that names it, where the route's head and
        ``headers`` (plain ASCII, names the head does not have) make one; else ``None``."""
        head = self._stream_head(route)
        extra = b""
        for name, value in headers.items():
            if not (name.isascii() and value.isascii()) or "\r" in value or "\n" in value:
                return None
            encoded = name.encode().lower()
            if encoded in head.names or b"\r" in encoded or b"\n" in encoded:
                return None
            extra += encoded + b": " + value.encode() + b"\r\n"
        return head.request, b"%b%bContent-Length: %d\r\n\r\n%b" % (
            head.lines,
            extra,
            len(body),
            body,
        )

    async def open_stream(
        self,
        route: Literal["chat", "completions"],
        body: bytes,
        *,
        ids_required: bool,
        headers: Mapping[str, str] | None = None,
    ) -> UpstreamStream:
        """POST ``body`` and return the open event stream.

        The caller owns the stream and must close it (``async with``).

        Raises:
            EngineUnreachable: no connection could be made.
            EngineError: the engine answered 5xx, timed out or closed the connection.
            EngineResponseError: the engine broke HTTP/1.1 (``malformed_engine_response``).
            EngineRejectedRequest: the engine answered 4xx (normalised envelope).
        """
        headers = headers or {}
        request_id = headers.get("x-request-id", "-")
        response: httpx.Response | StreamResponse
        try:
            framed = None if self._framer is None else self._framed(route, body, headers)
            if framed is not None:
                assert self._framer is not None
                response = await self._framer.send_prepared(*framed)
            else:
                response = await self._send_stream_request(route, body, headers)
        except httpx.HTTPError as exc:
            raise transport_error(self.engine.name, exc, f"request {request_id}") from exc
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except httpx.HTTPError:
                content = b""
            finally:
                await response.aclose()
            raise normalise_engine_error(self.engine.name, response.status_code, content)
        return UpstreamStream(
            self.engine.name, response, route, ids_required=ids_required, request_id=request_id
        )

    async def _send_stream_request(
        self, route: Literal["chat", "completions"], body: bytes, headers: Mapping[str, str]
    ) -> httpx.Response:
        """``open_stream``'s request through httpx's objects: through the client when there is
        no transport of ours, else straight to the transport."""
        own = _STREAM_HEADERS | {"content-length": str(len(body))} | dict(headers)
        if self._transport is None:
            request = self.http.build_request(
                "POST", _PATHS[route], content=OneShotBody(body), headers=own
            )
            return await self.http.send(request, stream=True)
        # The client's headers (the key, the fence, httpx's defaults), ours winning.
        merged = [(name, value) for name, value in self.http.headers.items() if name not in own]
        request = httpx.Request(
            "POST",
            self._url(route),
            headers=[*merged, *own.items()],
            content=OneShotBody(body),  # the prompt is not kept for the stream's life
        )
        response = await self._transport.handle_async_request(request)
        response.request = request
        return response

    async def post_whole(
        self,
        route: Literal["chat", "completions"],
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> WholeAnswer:
        """POST ``body`` (a request without ``stream``) and read the engine's whole answer.

        The read timeout bounds each silence, as on a stream; the caller's cancel scopes bound
        the whole call, and cancelling it closes the connection (the engine sees the client go
        away).

        Raises:
            EngineUnreachable: no connection could be made.
            EngineError: the engine answered 5xx, timed out or closed the connection.
            EngineResponseError: the engine broke HTTP/1.1, or its answer is over
                :data:`MAX_WHOLE_BYTES` or not a JSON object (``malformed_engine_response``).
            EngineRejectedRequest: the engine answered 4xx (normalised envelope).
        """
        request = self.http.build_request(
            "POST",
            _PATHS[route],
            content=OneShotBody(body),
            headers={
                "content-type": "application/json",
                "accept": "application/json",
                "content-length": str(len(body)),
            }
            | dict(headers or {}),
        )
        request_id = (headers or {}).get("x-request-id", "-")
        context = f"request {request_id}"
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise transport_error(self.engine.name, exc, context) from exc
        try:
            parts: list[bytes] = []
            size = 0
            async for data in response.aiter_raw():
                size += len(data)
                if size > MAX_WHOLE_BYTES:
                    if response.status_code < 400:
                        raise self._malformed(
                            request_id, f"an answer over {MAX_WHOLE_BYTES // 1048576} MiB"
                        )
                    break  # an error answer: its beginning says enough
                parts.append(data)
        except httpx.HTTPError as exc:
            if response.status_code < 400:
                raise transport_error(self.engine.name, exc, context) from exc
        finally:
            await response.aclose()
        content = b"".join(parts)
        if response.status_code >= 400:
            raise normalise_engine_error(self.engine.name, response.status_code, content)
        try:
            decoded = orjson.loads(content)
        except orjson.JSONDecodeError:
            decoded = None
        if type(decoded) is not dict:
            raise self._malformed(request_id, "an answer that is not a JSON object")
        return WholeAnswer(response.status_code, content, decoded)

    def _malformed(self, request_id: str, what: str) -> EngineResponseError:
        log.warning("request %s: engine %s sent %s", request_id, self.engine.name, what)
        return EngineResponseError(
            f"engine {self.engine.name} sent {what}",
            param=None,
            code="malformed_engine_response",
        )

    async def get_json(self, path: str) -> Any:
        """GET ``path`` and decode its JSON (health and model probes).

        Raises:
            EngineError: unreachable, timed out, a non-200 answer, or not JSON.
            EngineResponseError: the engine broke HTTP/1.1.
        """
        try:
            response = await self.http.get(path)
        except httpx.HTTPError as exc:
            raise transport_error(self.engine.name, exc, f"probe GET {path}") from exc
        if response.status_code != 200:
            raise EngineError(f"engine {self.engine.name} answered {response.status_code}")
        try:
            return orjson.loads(response.content) if response.content else None
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"engine {self.engine.name} sent non-JSON on {path}") from exc


def transport_kind(exc: httpx.HTTPError) -> FailureKind | Literal["pool"] | None:
    """What kind of failure of the engine's transport ``exc`` is.

    ``"pool"``: our own pool was full (nothing wrong with the engine); ``None``: not a transport
    failure at all. The one classification of httpx's exceptions: client messages
    (:func:`transport_error`) and engine health
    (:func:`narwhal.upstream.health.transport_failure`) both read it.
    """
    if isinstance(exc, httpx.PoolTimeout):
        return "pool"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.RemoteProtocolError) and not _says_closed(exc):
        return "protocol"
    if isinstance(exc, httpx.TransportError):
        return "disconnect"
    return None


def transport_error(
    engine: str, exc: httpx.HTTPError, context: str = "request -"
) -> EngineError | EngineResponseError:
    """What a client is told of an httpx failure talking to ``engine``; the detail is logged.

    ``context`` says in the log what was under way (``request <id>``, ``probe GET /health``).
    """
    kind = transport_kind(exc)
    error: EngineError | EngineResponseError
    if kind == "connect":
        timed_out = isinstance(exc, httpx.ConnectTimeout)
        error = EngineUnreachable(
            f"engine {engine} did not accept the connection in time"
            if timed_out
            else f"engine {engine} refused the connection"
        )
    elif kind == "pool":
        error = EngineError(f"Narwhal has no free connection to engine {engine}")
    elif kind == "timeout":
        error = EngineError(f"engine {engine} did not answer in time")
    elif kind == "protocol":
        error = EngineResponseError(
            f"engine {engine} sent a malformed response",
            param=None,
            code="malformed_engine_response",
        )
    elif kind == "disconnect":
        error = EngineError(f"engine {engine} closed the connection mid-response")
    else:
        error = EngineError(f"engine {engine} failed to answer")
    log.warning("%s: %s: %r", context, error.message, exc)
    return error


def _says_closed(exc: httpx.RemoteProtocolError) -> bool:
    # Ours say "closed the connection"; httpcore's "peer closed connection" or "Server
    # disconnected"; h11's "peer unexpectedly closed connection".
    text = str(exc).lower()
    return "closed" in text or "disconnect" in text


def normalise_engine_error(
    engine: str, status: int, content: bytes
) -> EngineError | EngineRejectedRequest:
    """Turn an engine's error answer (nested, flat or bare) into a Narwhal error.

    A 4xx keeps its status, the engine's ``code`` (as a string: vLLM's ``400`` becomes
    ``"400"``) and the engine's ``param`` (with FastAPI's ``body.`` prefix stripped); a 5xx
    becomes :class:`EngineError`, which the caller may retry elsewhere.
    """
    message, param, code = f"engine {engine} answered HTTP {status}", None, None
    try:
        decoded = orjson.loads(content)
    except orjson.JSONDecodeError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error", decoded)
        if isinstance(error, str):
            message = error
        elif isinstance(error, dict):
            if isinstance(error.get("message"), str):
                message = error["message"]
            param, code = _param_and_code(error)
    if 400 <= status < 500:
        return EngineRejectedRequest(message, status=status, param=param, code=code)
    if status == 503:
        return EngineBusy(f"engine {engine} answered HTTP 503: {message}")
    return EngineError(f"engine {engine} answered HTTP {status}: {message}")


def _param_and_code(error: dict[str, Any]) -> tuple[str | None, str | None]:
    """An engine's error object's ``param`` and ``code``, each ``None`` when unusable.

    ``param`` loses FastAPI's ``body.`` prefix; ``code`` is a non-empty string as is, an
    integer (vLLM's status) as its digits.
    """
    param = error.get("param")
    code = error.get("code")
    if type(code) is int:
        code = str(code)
    return (
        param.removeprefix("body.") if isinstance(param, str) else None,
        code if isinstance(code, str) and code else None,
    )


def _client_status(code: object) -> int | None:
    """``code`` as a 4xx HTTP status (an integer or a string of digits), else ``None``."""
    if type(code) is int:
        status = code
    elif isinstance(code, str) and code.isascii() and code.isdigit() and len(code) == 3:
        status = int(code)
    else:
        return None
    return status if 400 <= status < 500 else None


class UpstreamStream:
    """An open engine event stream, decoded and validated event by event."""

    def __init__(
        self,
        engine: str,
        response: httpx.Response | StreamResponse,
        route: Literal["chat", "completions"],
        *,
        ids_required: bool,
        request_id: str = "-",
    ) -> None:
        self.engine = engine
        self.route = route
        self.ids_required = ids_required
        self.request_id = request_id
        self._response = response
        # The body's own stream: httpx's aiter_raw would add two generator layers per read.
        stream = response.stream
        if not isinstance(stream, httpx.AsyncByteStream):
            raise TypeError("engine streams are read asynchronously")
        self._reader = stream.__aiter__()
        self._decoder = SSEDecoder()
        self._pending: list[Any] = []
        self._position = 0
        self._ended = False
        self._unframed = 0  # bytes fed since the last read that completed an event (a bound)

    async def __aenter__(self) -> UpstreamStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (the engine sees the client go away and aborts)."""
        await self._response.aclose()

    def buffered(self) -> bool:
        """An event is already received: :meth:`next_event` takes it without a read (it
        may still drain the body after ``[DONE]``)."""
        return self._position < len(self._pending)

    def next_ready(self) -> ChunkEvent | ErrorFrameEvent | None:
        """The next event when it is already received and is not the stream's end; else
        ``None`` (a read, or the end, is next: :meth:`next_event`).

        Raises:
            EngineResponseError: the event is not JSON, or breaks the token-ID rules.
        """
        if self._position >= len(self._pending):
            return None
        data = self._pending[self._position].data
        if data == DONE:
            return None
        self._position += 1
        event = self._decode(data)
        assert not isinstance(event, DoneEvent)
        return event

    async def next_event(self) -> UpstreamEvent:
        """The next event of the stream.

        Raises:
            EngineError: the connection broke, or the body ended before a finish.
            EngineResponseError: an event is not JSON, or breaks the token-ID rules.
        """
        while self._position >= len(self._pending):
            if self._ended:
                return DoneEvent(clean=False)
            self._pending = await self._read_events()
            self._position = 0
        sse = self._pending[self._position]
        self._position += 1
        event = self._decode(sse.data)
        if isinstance(event, DoneEvent) and not self._ended:
            await self._drain()
        return event

    async def _read_events(self) -> list[Any]:
        try:
            data = await self._reader.__anext__()
        except StopAsyncIteration:
            self._ended = True
            rest = self._decoder.flush()
            return [rest] if rest is not None else []
        except httpx.HTTPError as exc:
            raise transport_error(self.engine, exc, f"request {self.request_id}") from exc
        events = self._decoder.feed(data)
        # What the decoder holds is at most what arrived since a read last completed an event.
        self._unframed = len(data) if events else self._unframed + len(data)
        if self._unframed > MAX_EVENT_BYTES:
            log.warning(
                "request %s: engine %s sent over %d bytes without ending an event",
                self.request_id,
                self.engine,
                MAX_EVENT_BYTES,
            )
            raise EngineResponseError(
                f"engine {self.engine} sent an event over {MAX_EVENT_BYTES // 1048576} MiB",
                param=None,
                code="malformed_engine_response",
            )
        return events

    async def _drain(self) -> None:
        # Read to the end of the body after [DONE]: a body read to its end lets httpx return
        # the connection to the pool instead of closing it. The terminating chunk follows
        # [DONE] at once; an engine that keeps the body open is not waited for long.
        with trio.move_on_after(DRAIN_AFTER_DONE_S):
            while not self._ended:
                self._pending = await self._read_events()
                self._position = len(self._pending)

    def _decode(self, data: bytes) -> UpstreamEvent:
        if data == DONE:
            return DoneEvent(clean=True)
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise EngineResponseError(
                f"engine {self.engine} sent an event that is not JSON",
                param=None,
                code="malformed_engine_response",
            ) from exc
        if type(chunk) is dict and chunk.get("error"):
            error = chunk["error"]
            return ErrorFrameEvent(error if isinstance(error, dict) else {"message": str(error)})
        facts = inspect_chunk(chunk, self.route, ids_required=self.ids_required)
        return ChunkEvent(data, chunk, facts)
