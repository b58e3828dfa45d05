"""HTTP/1.1 connections: Hypercorn's h11 protocol under a Trio shell of Narwhal's own.

Hypercorn 0.18.0, its newest release, serves a connection in ways one client can abuse (its
open issue #203 and relatives): bytes after a request that asked to close make h11 raise "Got
data when expecting EOF"; the error answer then races the application's own writes and
shutdown of the socket, a ``trio.BusyResourceError`` escapes the connection and ends the whole
server. Its framing errors are an empty 400, headers sent a byte at a time are never timed out,
and a keep-alive connection's idle timer is restarted from the application's task, which
Quart-Trio cancels, so idle connections are never closed (and hold a shutdown for its whole
grace period).

Narwhal keeps Hypercorn's HTTP stream (the ASGI side) and h11 itself, and replaces the two
parts around them:

- :class:`HTTP11Protocol` is Hypercorn's ``H11Protocol`` with the request-reading loop
  rewritten and fewer writes per response: a response head is held until its first body bytes
  (or its end) and leaves with them, and a response's last body bytes leave with its end
  (:class:`LastBody`, sent by :class:`HTTPStream`), so that a whole answer is one write and a
  stream's head goes out with its first event.
  Once a request that asked to close is complete, h11 is fed nothing more (RFC 9112
  section 9.6: no further request is processed), so trailing bytes are dropped rather than
  raised; an HTTP/1.0 ``POST`` without a length has a body that runs to the end of the
  connection, passed to the application, which applies ``serving.max_request_bytes`` (413);
  framing errors are answered with the OpenAI envelope (400, 431, 505) and ``connection:
  close``; a late request head gets a 408 envelope; while draining, every response says
  ``connection: close``.
- :class:`Connection` is the Trio shell of one accepted socket: one task reads, and only it
  closes the socket (after its last write, under the write lock, lingering briefly when the
  client may still be sending so the client reads the answer rather than a reset); every
  request to close from another task is a cancel scope's ``cancel()``, synchronous, so no
  cancellation can lose it. The request-head clock (``serving.header_timeout_s``) is the
  deadline of the read. Nothing a connection raises leaves :meth:`Connection.run`. The socket
  is a :class:`narwhal.sockets.SocketStream`: a write the kernel takes whole at once needs
  neither the lock nor the shield (nothing awaits before it is sent), and only a write that
  must wait for room takes them.
- :class:`Connections` is the set of open connections, for the server's shutdown: drain (idle
  connections close at once, the others after their response) and abort.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from time import time
from typing import Any

import attrs
import h11
import orjson
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Body, Data, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import STREAM_ID, H11Protocol, H11WSConnection
from hypercorn.protocol.http_stream import ASGIHTTPState
from hypercorn.protocol.http_stream import HTTPStream as HypercornHTTPStream
from hypercorn.protocol.ws_stream import Handshake, WSStream
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveEvent,
    ASGISendEvent,
    ConnectionState,
    Scope,
)
from hypercorn.utils import parse_socket_addr, suppress_body
from wsproto.extensions import PerMessageDeflate
from wsproto.handshake import server_extensions_handshake

from narwhal.errors import envelope
from narwhal.sockets import SocketStream

__all__ = [
    "BODY_EXTENSION",
    "DISCONNECT_EXTENSION",
    "REFUSED_EXTENSION",
    "AppTasks",
    "Connection",
    "ConnectionStatistics",
    "Connections",
    "HTTP11Protocol",
    "HTTPStream",
    "LastBody",
]

log = logging.getLogger(__name__)

MAX_RECV = 2**16
# Closing while the client may still be sending: read and drop at most this much, this long,
# so its kernel does not answer our close with a reset that loses the response.
LINGER_S = 1.0
LINGER_BYTES = 1 << 20

VERSIONS = frozenset({b"1.0", b"1.1"})
# HTTP/1.0 requests of these methods without a length carry a body up to the end of the
# connection (the old way); other methods have none.
CLOSE_DELIMITED_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})


def origin_form(target: bytes) -> bytes | None:
    """The request target as a path (and query), or ``None`` if it is not one we serve.

    RFC 9112 section 3.2: the origin form (``/path?query``) is used as is; the absolute form
    (``http://host/path``), which a server must accept, becomes its path; ``*`` (``OPTIONS``)
    is kept, for the application to answer. Anything else, and any byte outside ASCII, is not a
    target.
    """
    if not target.isascii():
        return None
    if target.startswith(b"/") or target == b"*":
        return target
    scheme, sep, rest = target.partition(b"://")
    if sep and scheme.lower() in (b"http", b"https") and rest:
        _, slash, path = rest.partition(b"/")
        return b"/" + path if slash else b"/"
    return None


def websocket_upgrade(request: h11.Request) -> bool:
    """Whether Hypercorn would take ``request`` as a WebSocket upgrade."""
    connection = b",".join(value for name, value in request.headers if name == b"connection")
    upgrade = b"".join(value for name, value in request.headers if name == b"upgrade")
    tokens = {token.strip().lower() for token in connection.split(b",")}
    return (
        request.method == b"GET"
        and b"upgrade" in tokens
        and upgrade.strip().lower() == b"websocket"
    )


def valid_handshake(request: h11.Request) -> bool:
    """Whether ``request``'s WebSocket handshake can be taken through to an upgrade: valid by
    Hypercorn's own check, its comma-separated headers ASCII, and its extension offers ones
    that the server's ``permessage-deflate`` can read. Hypercorn decodes those headers when it
    makes the handshake and reads the offers when the application accepts it, and raises
    there: the client had no answer at all, and the log a traceback."""
    try:
        handshake = Handshake(list(request.headers), request.http_version.decode())
        if handshake.extensions is not None:
            server_extensions_handshake(handshake.extensions, [PerMessageDeflate()])
    except ValueError:  # UnicodeDecodeError, and int() of a window size that is none
        return False
    return handshake.is_valid()


def without_upgrade(request: h11.Request) -> h11.Request:
    """``request`` as plain HTTP: a server may ignore ``Upgrade`` (RFC 9110 7.8)."""
    return h11.Request(
        method=request.method,
        headers=[(name, value) for name, value in request.headers if name != b"upgrade"],
        target=request.target,
        http_version=request.http_version,
    )


def _both_lengths(request: h11.Request) -> bool:
    """Whether the request's head gives its body both a length and chunks."""
    names = {name.lower() for name, _ in request.headers}
    return b"content-length" in names and b"transfer-encoding" in names


_REPR = re.compile(r":?\s*(?:bytearray\()?(?<!\w)b['\"].*", re.DOTALL)


def protocol_problem(error: h11.ProtocolError) -> str:
    """What h11 found wrong with a request, without the Python reprs of the client's bytes
    that its messages quote (``illegal request line: bytearray(b'...')``)."""
    return _REPR.sub("", str(error)).strip() or "unreadable"


def _framing(request: h11.Request) -> bool:
    """Whether the request's head gives its body a length (or chunks)."""
    names = {name.lower() for name, _ in request.headers}
    return b"content-length" in names or b"transfer-encoding" in names


@dataclass(frozen=True)
class LastBody(StreamEvent):
    """A response's last body bytes and its end, to go out in one write."""

    data: bytes


BODY_EXTENSION = "narwhal.send_body"
"""The ASGI scope extension (``scope["extensions"]``) that holds a stream's body writer: an
``async`` callable taking the bytes of a ``more_body`` message (:meth:`HTTPStream.send_body`)."""

REFUSED_EXTENSION = "narwhal.refused"
"""The ASGI scope extension that the server sets, to the message it answered with, when it
answered the request itself with a 400 because it could not read the request's body (a
malformed chunk). The application then sees ``http.disconnect``; this tells it that the client
was answered, not gone."""

DISCONNECT_EXTENSION = "narwhal.on_disconnect"
"""The ASGI scope extension that tells the application of the client going away without a task
waiting for ``http.disconnect``: a callable taking a plain callback (``None`` removes it), called
once, synchronously, when the connection ends (at once when it already has)
(:meth:`HTTPStream.on_disconnect`). ``http.disconnect`` is still sent."""


class AppTasks(TaskGroup):
    """Hypercorn's task group of one connection, whose application queue hands a message over
    without a trip through the scheduler while it can.

    Hypercorn's queue between the connection and the application (a Trio memory channel of
    ``max_app_queue_size``) is a checkpoint on every put (a request's body, its end, the
    disconnect) and every get (the application's body reads): four or five scheduler passes
    between a request's bytes and its route, and a keep-alive connection's next request waits
    behind the last one's post-processing, which runs in the pass the disconnect's put gave
    away. Here a put that finds room and a get that finds a message return at once; a full
    queue still holds its putter (the client's reading stops: backpressure) and an empty one
    its getter, both awaiting as before.
    """

    async def spawn_app(
        self,
        app: AppWrapper,
        config: HypercornConfig,
        scope: Scope,
        send: Callable[[ASGISendEvent | None], Awaitable[None]],
    ) -> Callable[[ASGIReceiveEvent], Awaitable[None]]:
        sender, receiver = trio.open_memory_channel[ASGIReceiveEvent](config.max_app_queue_size)

        async def put(message: ASGIReceiveEvent) -> None:
            try:
                sender.send_nowait(message)
            except trio.WouldBlock:
                await sender.send(message)

        async def receive() -> ASGIReceiveEvent:
            try:
                return receiver.receive_nowait()
            except trio.WouldBlock:
                return await receiver.receive()

        assert self._nursery is not None
        self._nursery.start_soon(
            _handle,
            app,
            config,
            scope,
            receive,
            send,
            trio.to_thread.run_sync,
            trio.from_thread.run,
        )
        return put


class HTTPStream(HypercornHTTPStream):
    """Hypercorn's ASGI side of one request, with a response's last body message sent as one
    :class:`LastBody` (Hypercorn sends a ``Body`` and an ``EndBody``: two writes), and a
    streamed body's writes offered to the application without the ASGI message
    (:data:`BODY_EXTENSION`).

    Attributes:
        write_body: the protocol's framing and write of one body part
            (:meth:`HTTP11Protocol.send_body`), set by the protocol that made the stream.
    """

    write_body: Callable[[bytes], Awaitable[None]] | None = None
    _on_disconnect: Callable[[], None] | None = None

    async def handle(self, event: StreamEvent) -> None:
        if isinstance(event, StreamClosed):
            # Before Hypercorn's handling, which awaits the application's queue (and sets
            # ``closed``, after which it handles nothing).
            callback, self._on_disconnect = self._on_disconnect, None
            if callback is not None:
                callback()
        await super().handle(event)
        if isinstance(event, Request) and self.write_body is not None:
            # The application's task was started, not yet run: it sees the scope with these.
            extensions: dict[str, Any] = self.scope["extensions"]
            extensions[BODY_EXTENSION] = self.send_body
            extensions[DISCONNECT_EXTENSION] = self.on_disconnect

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once when the client's connection ends (now, if it has ended);
        ``None`` removes the one set (:data:`DISCONNECT_EXTENSION`)."""
        if callback is not None and self.closed:
            callback()
            return
        self._on_disconnect = callback

    async def send_body(self, data: bytes) -> None:
        """What ``app_send`` does with a ``more_body`` body message of ``data``, on the hot
        path of every stream: one call to the protocol instead of the message, Hypercorn's
        checks and its ``Body`` event."""
        write = self.write_body
        if (
            write is None
            or self.state is not ASGIHTTPState.RESPONSE
            or suppress_body(self.scope["method"], int(self.response["status"]))
        ):
            await self.app_send({"type": "http.response.body", "body": data, "more_body": True})
        elif data:
            await write(data)

    async def app_send(self, message: Any) -> None:
        if (
            message is not None
            and message["type"] == "http.response.body"
            and self.state is ASGIHTTPState.RESPONSE
            and not message.get("more_body", False)
            and not self.response.get("trailers", False)
        ):
            data = bytes(message.get("body", b""))
            if suppress_body(self.scope["method"], int(self.response["status"])):
                data = b""
            await self.send(LastBody(stream_id=self.stream_id, data=data))
            self.state = ASGIHTTPState.CLOSED
            await self.config.log.access(self.scope, self.response, time() - self.start_time)
            await self.send(StreamClosed(stream_id=self.stream_id))
            return
        await super().app_send(message)


class HTTP11Protocol(H11Protocol):
    """Hypercorn's h11 protocol with Narwhal's reading loop and envelope errors.

    Attributes:
        input_done: h11 is fed nothing more: the client's last request is complete and it
            asked to close, or its bytes could not be parsed.
        close_delimited: the running request's body runs to the end of the connection.
        body_ended_by_eof: the client's end of the connection ended that body; the connection
            stays open for the response.
        closed: the connection has ended; no answer may begin any more.
    """

    # Upgrades go to Hypercorn's WebSocket stream only on the app's WebSocket routes (the
    # event feed, narwhal.web.events, which refuses one with an envelope before the upgrade);
    # elsewhere they are served as plain HTTP (a 404 envelope, for instance) rather than
    # through that stream, whose refusals are empty bodies.
    websocket_paths: frozenset[bytes] = frozenset({b"/admin/events"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.input_done = False
        self.close_delimited = False
        self.body_ended_by_eof = False
        self.closed = False
        self._held_head = b""  # a response head waiting for its first body bytes
        self._chunked = False  # the response being sent has a chunked body
        # The connection's write of bytes, where it offers one: what ``send(RawData(...))``
        # does without the event (every streamed body part passes here).
        self.write_raw: Callable[[bytes], Awaitable[bool]] | None = None

    # -- what the connection asks ---------------------------------------------------------------

    def head_begun(self) -> bool:
        """Part of a request head has arrived, and not the whole of it."""
        connection = self.connection
        return (
            isinstance(connection, h11.Connection)
            and connection.their_state is h11.IDLE
            and bool(connection.trailing_data[0])
        )

    def client_may_be_sending(self) -> bool:
        """The client may still be sending a request we will not read (closing should linger)."""
        connection = self.connection
        if not isinstance(connection, h11.Connection):
            return False
        if self.close_delimited:
            return True
        return connection.their_state in (h11.SEND_BODY, h11.ERROR) or self.head_begun()

    def answer_pending(self) -> bool:
        """The end of the connection was the end of the request's body (an HTTP/1.0 body with
        no length): the client shut its side to end it, and waits for the answer.

        Any other end of the connection is the client going away: the request is cancelled at
        once, wherever it waits, as every server in front of an LLM engine must (an engine
        must not generate for nobody, a queue place must not be held for nobody), unless its
        answer has begun: a response is sent whole or not at all, and a stream to a client
        that is really gone ends on the next write that fails."""
        if self.stream is None:
            return False
        if self.body_ended_by_eof:
            return True
        connection = self.connection
        return isinstance(connection, h11.Connection) and connection.our_state is h11.SEND_BODY

    async def header_timeout(self) -> None:
        """The next request head is late: answer 408 where one was begun, then close."""
        if self.head_begun() and self.connection.our_state is h11.IDLE:
            await self.send_envelope(
                408,
                "The request head did not arrive in time.",
                code="request_header_timeout",
            )
        await self.send(Closed())

    # -- Hypercorn's hooks ----------------------------------------------------------------------

    async def handle(self, event: Event) -> None:
        if isinstance(event, Closed):
            self.closed = True  # at once: the application may be about to answer
        if isinstance(event, RawData) and self.input_done:
            await self._after_last_request(event.data)
        else:
            await super().handle(event)

    async def stream_send(self, event: StreamEvent) -> None:
        if self.closed and isinstance(event, Response | Body | EndBody | LastBody):
            # The connection ended before this answer began (the client went away): an answer
            # that starts now would be cut at its head. Whole or nothing: nothing.
            return
        if isinstance(event, Response) and event.status_code >= 200:
            headers = list(event.headers)
            if self.context.terminated.is_set():
                headers.append((b"connection", b"close"))  # draining: the connection's last
            headers.extend(self.config.response_headers("h11"))
            if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                headers.append((b"connection", b"close"))
            # Held until the first body bytes or the end, which every route sends right after
            # its head: one write instead of two.
            head = h11.Response(headers=headers, status_code=event.status_code)
            framed = self._h11_bytes(head)
            # What h11 chose for the body: a head without a length to an HTTP/1.1 client
            # gets chunks, which send_body frames itself.
            self._chunked = b"\r\ntransfer-encoding: chunked\r\n" in framed.lower()
            self._held_head += framed
        elif isinstance(event, Body):
            await self._write(self._h11_bytes(h11.Data(data=event.data)))
        elif isinstance(event, LastBody):
            data = self._h11_bytes(h11.Data(data=event.data)) if event.data else b""
            await self._write(data + self._h11_bytes(h11.EndOfMessage()))
        elif isinstance(event, EndBody):
            await self._write(self._h11_bytes(h11.EndOfMessage()))
        else:
            if isinstance(event, StreamClosed) and self._held_head:
                await self._write(b"")  # a head whose body never came: it goes as it is
            await super().stream_send(event)
            stream = self.stream
            if (
                isinstance(event, StreamClosed)
                and isinstance(stream, WSStream)
                and not stream.handshake.accepted
            ):
                await self.send(Closed())  # a refused upgrade's answer is the connection's last

    async def send_body(self, data: bytes) -> None:
        """Send ``data`` (not empty) as part of the response body: ``stream_send`` of a
        ``Body`` event, with a chunk framed here rather than by h11's state machine (a data
        chunk changes none of its states). Every streamed body part passes here.

        Raises:
            trio.BrokenResourceError: the connection is closed, or broke in this write. The
                writer stops at once, before it makes the next part: the stream hears of the
                client going away only once the reading task has run, and a relay whose
                engine's output is all in hand makes every part before its next checkpoint (a
                demo's 60 clients that stopped reading, then left, held its loop for 12 s).
        """
        if self.closed:
            raise trio.BrokenResourceError("the client's connection is closed")
        if self._chunked and self.connection.our_state is h11.SEND_BODY:
            if not await self._write(b"%x\r\n%b\r\n" % (len(data), data)):
                raise trio.BrokenResourceError("the client's connection broke")
        else:
            await self.stream_send(Body(stream_id=STREAM_ID, data=data))

    def _h11_bytes(self, event: h11.Response | h11.Data | h11.EndOfMessage) -> bytes:
        """``event`` framed by h11; nothing when the client broke the connection's protocol."""
        try:
            return self.connection.send(event) or b""
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return b""

    async def _write(self, data: bytes) -> bool:
        """Write ``data`` (after a head held back); ``False`` when the connection broke."""
        if self._held_head:
            data, self._held_head = self._held_head + data, b""
        if data:
            if self.write_raw is not None:
                return await self.write_raw(data)
            await self.send(RawData(data=data))
        return True

    async def _create_stream(self, request: h11.Request) -> None:
        # Hypercorn's, with Narwhal's HTTPStream.
        if self._websocket_route(request) and websocket_upgrade(request):
            await super()._create_stream(request)
            return
        self.stream = HTTPStream(
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.ssl,
            self.client,
            self.server,
            self.stream_send,
            STREAM_ID,
        )
        self.stream.write_body = self.send_body
        raw = self.config.h11_pass_raw_headers
        headers = request.headers.raw_items() if raw else list(request.headers)
        await self.stream.handle(
            Request(
                stream_id=STREAM_ID,
                headers=headers,
                http_version=request.http_version.decode(),
                method=request.method.decode("ascii").upper(),
                raw_path=request.target,
                state=self.connection_state,
            )
        )
        self.keep_alive_requests += 1
        await self.context.mark_request()

    async def _check_protocol(self, event: h11.Request) -> None:
        # The router speaks HTTP/1.1 only: an "Upgrade: h2c" header is ignored (RFC 9113
        # allows it), and HTTP/2 prior knowledge ("PRI * HTTP/2.0") is refused as a version.
        return None

    async def _handle_events(self) -> None:
        while True:
            connection = self.connection
            if connection.they_are_waiting_for_100_continue:
                await self._send_h11_event(
                    h11.InformationalResponse(
                        status_code=100, headers=self.config.response_headers("h11")
                    )
                )
            if connection.their_state is h11.MUST_CLOSE:
                # The request that asked to close is complete: h11 would raise on any byte
                # after it. What follows is a close-delimited body, or dropped.
                self.input_done = True
                rest = connection.trailing_data[0]
                if rest:
                    await self._after_last_request(rest)
                break
            reading_body = connection.their_state is h11.SEND_BODY
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as error:
                message = f"Malformed HTTP request: {protocol_problem(error)}."
                if reading_body:  # the request's application reads a body it will not have
                    self._body_refused(message)
                await self._refuse(error.error_status_hint, message)
                break
            if isinstance(event, h11.Request):
                if event.http_version not in VERSIONS:
                    await self._refuse(505, "Only HTTP/1.0 and HTTP/1.1 are served.")
                    break
                if _both_lengths(event):
                    # Which of the two ends the body is where a request is smuggled past a
                    # proxy that reads the other (RFC 9112 6.3: reject it, or close after it).
                    await self._refuse(
                        400,
                        "Malformed HTTP request: both Content-Length and Transfer-Encoding.",
                    )
                    break
                target = origin_form(event.target)
                if target is None:
                    await self._refuse(400, "Malformed HTTP request: the request target.")
                    break
                if target != event.target:
                    event = h11.Request(
                        method=event.method,
                        headers=event.headers,
                        target=target,
                        http_version=event.http_version,
                    )
                if websocket_upgrade(event):
                    if not self._websocket_route(event):
                        event = without_upgrade(event)
                    elif not valid_handshake(event):
                        await self._refuse(400, "Malformed WebSocket handshake.")
                        break
                await self.send(Updated(idle=False))
                self.close_delimited = (
                    event.http_version == b"1.0"
                    and event.method in CLOSE_DELIMITED_METHODS
                    and not _framing(event)
                )
                await self._create_stream(event)
            elif event is h11.PAUSED:
                await self.can_read.clear()
                await self.can_read.wait()
            elif isinstance(event, h11.ConnectionClosed) or event is h11.NEED_DATA:
                break
            elif self.stream is None:
                break
            elif isinstance(event, h11.Data):
                await self.stream.handle(Body(stream_id=STREAM_ID, data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                if not self.close_delimited:  # h11 saw no length: the body is still to come
                    await self.stream.handle(EndBody(stream_id=STREAM_ID))
            elif isinstance(event, Data):  # WebSocket frames pass through
                stream = self.stream
                if isinstance(stream, WSStream) and not stream.handshake.accepted:
                    await self._before_upgrade(stream)
                    break
                await stream.handle(event)

    # -- our own --------------------------------------------------------------------------------

    async def _before_upgrade(self, stream: WSStream) -> None:
        """Bytes came before the WebSocket upgrade was accepted, which a client may not send
        (RFC 6455 section 4.1; Hypercorn's own answer is an empty 400). Nothing more is read.
        Where the application has not begun its answer, the answer is a 400 envelope, and the
        application's own (an acceptance, a refusal), should it still come, meets a closed
        stream; where it has begun one (a refusal), that answer ends as it is."""
        self.input_done = True
        connection = self.connection
        h11_connection = (
            connection.h11_connection if isinstance(connection, H11WSConnection) else connection
        )
        if h11_connection.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # the application's answer is under way: it goes out whole, then the close
        self.connection = h11_connection
        self.closed = stream.closed = True  # before the first await of the refusal
        await self._refuse(400, "Data arrived before the WebSocket upgrade was accepted.")

    def _websocket_route(self, request: h11.Request) -> bool:
        """Whether ``request``'s path is one of :attr:`websocket_paths`."""
        return request.target.partition(b"?")[0] in self.websocket_paths

    async def _after_last_request(self, data: bytes) -> None:
        """Bytes after the last request of the connection: a close-delimited body, or nothing."""
        if not (self.close_delimited and self.stream is not None):
            return
        if data:
            await self.stream.handle(Body(stream_id=STREAM_ID, data=data))
        else:
            self.close_delimited = False
            self.body_ended_by_eof = True
            await self.stream.handle(EndBody(stream_id=STREAM_ID))

    def _body_refused(self, message: str) -> None:
        """The request whose body was being read is answered here, with ``message``
        (:meth:`_refuse`), where the application has not begun an answer: it is told so
        (:data:`REFUSED_EXTENSION`), so that it counts a refused request, not a client gone."""
        stream = self.stream
        if (
            isinstance(stream, HTTPStream)
            and not stream.closed
            and self.connection.our_state in (h11.IDLE, h11.SEND_RESPONSE)
        ):
            extensions: dict[str, Any] = stream.scope["extensions"]
            extensions[REFUSED_EXTENSION] = message

    async def _refuse(self, status: int, message: str) -> None:
        """Answer a request we cannot read with the envelope where the connection still can,
        then close. The application's stream, if one runs, sees the client go away (unless
        :meth:`_body_refused` told it that the client was answered)."""
        self.input_done = True
        if self.connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self.send_envelope(status, message)
        await self.send(Closed())

    async def send_envelope(
        self, status: int, message: str, *, code: str = "invalid_request"
    ) -> None:
        """One whole error response with the OpenAI envelope and ``connection: close``."""
        body = orjson.dumps(envelope(message, "invalid_request_error", code, None))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        try:
            for event in (
                h11.Response(status_code=status, headers=headers),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                await self._send_h11_event(event)
        except h11.LocalProtocolError:  # e.g. a body for HEAD: the close says enough
            log.debug("could not send the %d envelope", status)


@attrs.frozen
class ConnectionStatistics:
    """Open client connections, and how many of them wait for a request head."""

    open: int
    idle: int
    header_timeouts: int


class Connection:
    """The Trio shell of one accepted client connection.

    Args:
        app: the wrapped ASGI application.
        config: Hypercorn's settings (response headers, h11 limits).
        context: the worker context shared by every connection; its ``terminated`` event is set
            while draining.
        stream: the accepted socket stream.
        header_timeout_s: longest time to a complete request head, from the connection or from
            the end of the previous response.
        on_header_timeout: called for every header timeout counted.
    """

    def __init__(
        self,
        app: AppWrapper,
        config: HypercornConfig,
        context: WorkerContext,
        stream: SocketStream,
        *,
        header_timeout_s: float,
        on_header_timeout: Callable[[], None],
    ) -> None:
        self.app = app
        self.config = config
        self.context = context
        self.stream = stream
        self.header_timeout_s = header_timeout_s
        self.on_header_timeout = on_header_timeout
        self.protocol: HTTP11Protocol | None = None
        self.idle = True  # waiting for a request head
        self.fresh = True  # no request yet
        self.head_deadline = trio.current_time() + header_timeout_s
        self._send_lock = trio.Lock()
        self._reading = trio.CancelScope()  # cancelled: stop reading, then close
        self._receiving: trio.CancelScope | None = None
        self._sending: trio.CancelScope | None = None
        self._closing: trio.CancelScope | None = None
        self._aborted = False

    async def run(self) -> None:
        """Serve the connection until either side closes it; never raises but cancellation."""
        try:
            socket = self.stream.socket
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            async with AppTasks() as task_group:
                self.protocol = HTTP11Protocol(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState({}),
                    False,
                    client,
                    server,
                    self.protocol_send,
                )
                self.protocol.write_raw = self.write
                await self._read()
        except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        except* Exception as group:
            log.error("client connection failed; closed", exc_info=group)
        finally:
            await self._close()

    # -- called from any task, synchronously ----------------------------------------------------

    def close(self) -> None:
        """Stop reading: the reading task then closes the socket after the last write."""
        self._reading.cancel()

    def drain(self, *, fresh_too: bool = False) -> None:
        """Close now if idle between requests (a new connection only if ``fresh_too``: its
        first request may be on its way); a busy connection's current response is its last
        (the protocol says ``connection: close`` once the worker context is terminated)."""
        if self.idle and (fresh_too or not self.fresh):
            self._set_head_deadline(-math.inf)

    def abort(self) -> None:
        """End the connection now, even inside a write or while lingering."""
        self._aborted = True
        self._reading.cancel()
        for scope in (self._sending, self._closing):
            if scope is not None:
                scope.cancel()

    # -- Hypercorn's send callback --------------------------------------------------------------

    async def write(self, data: bytes) -> bool:
        """Write ``data`` whole: the protocol's bytes, as :meth:`protocol_send` of a
        ``RawData`` event. A broken connection is closed, not raised: the answer is ``False``
        then (a streamed body's writer learns of it at once, :meth:`HTTP11Protocol.send_body`)."""
        # A cancelled caller never begins a write.
        await trio.lowlevel.checkpoint_if_cancelled()
        lock = self._send_lock
        if not lock.locked():
            # No write under way: what the kernel takes now goes without a lock, a scope or
            # a trip through the scheduler (nothing below awaits before it is sent).
            try:
                sent = self.stream.send_nowait(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.close()
                return False
            if sent == len(data):
                await self.stream.yield_if_due()
                return True
            return await self._send_rest(memoryview(data)[sent:])
        return await self._send_rest(data)

    async def protocol_send(self, event: Event) -> None:
        """Where the protocol's bytes, close requests and idle changes arrive."""
        if isinstance(event, RawData):
            await self.write(event.data)
        elif isinstance(event, Closed):
            self.close()
        elif isinstance(event, Updated):
            # Synchronous on purpose: the caller may be an application task about to be
            # cancelled, and this change must not be lost with it.
            self.idle = event.idle
            if event.idle:
                draining = self.context.terminated.is_set()
                self._set_head_deadline(
                    -math.inf if draining else trio.current_time() + self.header_timeout_s
                )
            else:
                self.fresh = False
                self._set_head_deadline(math.inf)

    async def _send_rest(self, data: bytes | memoryview) -> bool:
        """Write ``data`` whole, waiting for room (and for another write to end) as needed;
        ``False`` when the connection broke (it is closed)."""
        broken = False
        lock = self._send_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            # A write is never half done by a cancellation (the framing would break); abort()
            # cancels this scope itself when the connection must end regardless.
            with trio.CancelScope(shield=True) as self._sending:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    broken = True
            broken = broken or self._sending.cancelled_caught
            self._sending = None
        finally:
            lock.release()
        if broken:
            self.close()
        return not broken

    # -- the reading task -----------------------------------------------------------------------

    def _set_head_deadline(self, deadline: float) -> None:
        self.head_deadline = deadline
        if self._receiving is not None:
            self._receiving.deadline = deadline

    async def _read(self) -> None:
        assert self.protocol is not None
        with self._reading:
            while True:
                data: bytes | None = None
                with trio.CancelScope(deadline=self.head_deadline) as receiving:
                    self._receiving = receiving
                    try:
                        data = bytes(await self.stream.receive_some(MAX_RECV))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    finally:
                        self._receiving = None
                if receiving.cancelled_caught:
                    await self._head_late()
                    break
                if data is None:
                    break
                await self.protocol.handle(RawData(data))
                if not data:
                    if self.protocol.answer_pending():
                        # The client ended a close-delimited body so, or its answer has begun:
                        # the answer still goes out whole, and its end closes the connection.
                        await trio.sleep_forever()
                    break
        await self.protocol.handle(Closed())

    async def _head_late(self) -> None:
        assert self.protocol is not None
        if self.context.terminated.is_set():
            return  # draining: an idle connection closes quietly
        if self.fresh or self.protocol.head_begun():
            # An idle keep-alive connection closing is routine; these are client timeouts.
            self.on_header_timeout()
            await self.protocol.header_timeout()

    async def _close(self) -> None:
        """Close the socket after the last write, lingering if the client may still send."""
        with trio.CancelScope(shield=True):
            with trio.move_on_after(LINGER_S) as self._closing:
                if self._aborted:
                    self._closing.cancel()
                async with self._send_lock:
                    try:
                        await self.stream.send_eof()
                        if self.protocol is not None and self.protocol.client_may_be_sending():
                            await self._discard_input()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            self._closing = None
            await self.stream.aclose()

    async def _discard_input(self) -> None:
        received = 0
        while received < LINGER_BYTES:
            data = await self.stream.receive_some(MAX_RECV)
            if not data:
                return
            received += len(data)


class Connections:
    """Every open client connection of one server, for draining and aborting.

    Args:
        app: the wrapped ASGI application.
        config: Hypercorn's settings.
        header_timeout_s: ``serving.header_timeout_s``.
        on_header_timeout: called for every header timeout (the metrics hook).
    """

    def __init__(
        self,
        app: AppWrapper,
        config: HypercornConfig,
        *,
        header_timeout_s: float,
        on_header_timeout: Callable[[], None] = lambda: None,
    ) -> None:
        self.app = app
        self.config = config
        self.context = WorkerContext(None)
        self.header_timeout_s = header_timeout_s
        self._on_header_timeout = on_header_timeout
        self._open: set[Connection] = set()
        self._empty = trio.Event()
        self._empty.set()
        self._header_timeouts = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one accepted stream (the handler of :func:`trio.serve_listeners`); its socket
        is taken over by a :class:`narwhal.sockets.SocketStream`."""
        connection = Connection(
            self.app,
            self.config,
            self.context,
            SocketStream.adopt(stream),
            header_timeout_s=self.header_timeout_s,
            on_header_timeout=self._header_timeout,
        )
        self._open.add(connection)
        if self._empty.is_set():
            self._empty = trio.Event()
        try:
            await connection.run()
        finally:
            self._open.discard(connection)
            if not self._open:
                self._empty.set()

    async def drain(self) -> None:
        """Idle keep-alive connections close now; the others after their next response."""
        await self.context.terminated.set()
        for connection in list(self._open):
            connection.drain()

    def close_idle(self) -> None:
        """Close every connection waiting for a request head, new ones included."""
        for connection in list(self._open):
            connection.drain(fresh_too=True)

    def abort(self) -> None:
        """End every connection now."""
        for connection in list(self._open):
            connection.abort()

    async def wait_closed(self) -> None:
        """Return once no connection is open."""
        await self._empty.wait()

    def statistics(self) -> ConnectionStatistics:
        """A frozen snapshot."""
        return ConnectionStatistics(
            open=len(self._open),
            idle=sum(connection.idle for connection in self._open),
            header_timeouts=self._header_timeouts,
        )

    def _header_timeout(self) -> None:
        self._header_timeouts += 1
        self._on_header_timeout()
