"""The client's side of one completion request, over plain ASGI.

The completion routes are served as ASGI directly rather than through Quart's request and
response objects, so that one coroutine holds a request from its first byte to its last and
every resource it takes is given back by the construct that took it (docs: Architecture).

:class:`Client` reads the body within the byte limit, watches for the client going away once the
body is in, and sends the answer: a JSON response, or a stream of server-sent events. An error
becomes the envelope before response headers, and one in-band ``data: {"error": ...}`` event
followed by ``data: [DONE]`` after them. Sending to a client that went away raises
:class:`ClientGone`, which the caller counts as ``cancelled``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson
import trio

from narwhal.errors import InvalidRequest, NarwhalError, RequestTooLarge
from narwhal.protocol.sse import encode_data, encode_done
from narwhal.web.http11 import BODY_EXTENSION, DISCONNECT_EXTENSION, REFUSED_EXTENSION

__all__ = ["Client", "ClientGone", "request_id"]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

DRAIN_BYTES = 4 * 1024 * 1024
DRAIN_S = 1.0
_MAX_REQUEST_ID = 128
_JSON = ((b"content-type", b"application/json"),)
SSE_HEADERS = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class ClientGone(Exception):
    """The client went away (disconnected, or its connection broke while we sent)."""


def request_id(headers: dict[str, str]) -> str:
    """The client's ``X-Request-Id`` when it is usable, else a new one."""
    given = headers.get("x-request-id", "")
    if 0 < len(given) <= _MAX_REQUEST_ID and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


class Client:
    """One ASGI HTTP exchange, seen from the router.

    Attributes:
        headers: the request headers, names lower-cased (the last of repeated names wins).
        request_id: the client's ``X-Request-Id``, or one made here; sent back on every answer.
        started: the response headers have gone out.
        ended: the last byte of the response has been handed over (or is being).
        gone: the client went away.
        owed: stream bytes held back, to go out before an in-band error.
    """

    __slots__ = (
        "_extensions",
        "_on_disconnect",
        "_receive",
        "_send",
        "_send_body",
        "ended",
        "gone",
        "headers",
        "owed",
        "request_id",
        "started",
    )

    def __init__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        # The server's body writer, where it offers one (narwhal.web.http11): a streamed
        # body's parts skip the ASGI message and the server's dispatch on it.
        extensions = scope.get("extensions") or {}
        self._send_body: Callable[[bytes], Awaitable[None]] | None = extensions.get(BODY_EXTENSION)
        # And its disconnect notice: the client going away is seen without a watching task.
        self._on_disconnect: Callable[[Callable[[], None] | None], None] | None = extensions.get(
            DISCONNECT_EXTENSION
        )
        self._extensions: dict[str, Any] = extensions  # the server adds to it (REFUSED_EXTENSION)
        self.headers = {
            bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
            for name, value in scope.get("headers", ())
        }
        self.request_id = request_id(self.headers)
        self.started = False
        self.ended = False
        self.gone = False
        self.owed = b""  # stream bytes held back, sent before an in-band error

    # -- reading ----------------------------------------------------------------------------------

    async def read_body(self, limit: int) -> bytes:
        """The whole body, never holding more than ``limit`` bytes.

        Raises:
            RequestTooLarge: ``Content-Length`` or the running count passed ``limit``; a bounded
                amount of the rest was drained first, so the client reads the 413.
            ClientGone: the client went away before the end of its body.
            InvalidRequest: the server could not read the body, and answered the client with a
                400 itself (:data:`~narwhal.web.http11.REFUSED_EXTENSION`): nothing more is
                sent.
        """
        declared = self.headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > limit:
            await self._drain(0, limit)
            raise RequestTooLarge.over(limit)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] != "http.request":
                self.gone = True
                refused = self._extensions.get(REFUSED_EXTENSION)
                if refused is not None:
                    raise InvalidRequest(refused)
                raise ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                if message.get("more_body", False):
                    await self._drain(size, limit)
                raise RequestTooLarge.over(limit)
            if part:
                parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _drain(self, received: int, limit: int) -> None:
        with trio.move_on_after(DRAIN_S):
            while received <= limit + DRAIN_BYTES:
                message = await self._receive()
                if message["type"] != "http.request":
                    self.gone = True
                    return
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return

    async def watch(self, scope: trio.CancelScope) -> None:
        """Once the body is in: wait for the client to go away, then cancel ``scope``."""
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self._went_away(scope)

    @contextlib.contextmanager
    def noticing_disconnect(self, scope: trio.CancelScope) -> Iterator[bool]:
        """While the block runs, the client going away cancels ``scope``, told by the server
        (:data:`~narwhal.web.http11.DISCONNECT_EXTENSION`). Yields ``False``, and arranges
        nothing, where the server does not offer it: :meth:`watch` must then run beside."""
        register = self._on_disconnect
        if register is None:
            yield False
            return
        register(lambda: self._went_away(scope))
        try:
            yield True
        finally:
            register(None)

    def _went_away(self, scope: trio.CancelScope) -> None:
        if not self.ended:
            self.gone = True
            scope.cancel()

    # -- answering --------------------------------------------------------------------------------

    async def respond(
        self, status: int, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        """A whole JSON response."""
        self.ended = True
        length = [(b"content-length", str(len(body)).encode("ascii"))]
        await self._start(status, [*_JSON, *length, *_encode(headers)])
        await self._emit({"type": "http.response.body", "body": body, "more_body": False})

    async def start_stream(self) -> None:
        """Send the headers of an event stream."""
        await self._start(200, list(SSE_HEADERS))

    async def write(self, data: bytes) -> None:
        """Send part of a streamed body."""
        send_body = self._send_body
        if send_body is None:
            await self._emit({"type": "http.response.body", "body": data, "more_body": True})
            return
        try:
            await send_body(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.gone = True
            raise ClientGone from exc

    async def end(self, data: bytes = b"") -> None:
        """Send the last part of a streamed body."""
        self.ended = True
        await self._emit({"type": "http.response.body", "body": data, "more_body": False})

    async def send_error(self, error: NarwhalError) -> None:
        """``error`` as the envelope, or in-band after headers (after what is ``owed``).

        Never raises: a client that is gone gets nothing.
        """
        if self.gone or self.ended:
            return
        try:
            envelope = orjson.dumps(error.envelope())
            if not self.started:
                await self.respond(error.http_status, envelope, error.headers)
            else:
                await self.end(self.owed + encode_data(envelope) + encode_done())
        except ClientGone:
            pass

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers = [*headers, (b"x-request-id", self.request_id.encode("ascii"))]
        self.started = True
        await self._emit({"type": "http.response.start", "status": status, "headers": headers})

    async def _emit(self, message: dict[str, Any]) -> None:
        try:
            await self._send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.gone = True
            raise ClientGone from exc


def _encode(headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    if not headers:
        return []
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()
    ]
