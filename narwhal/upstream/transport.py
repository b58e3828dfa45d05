"""A lean HTTP/1.1 transport for httpx, built for many long token streams to one engine.

Narwhal talks to each engine through one ``httpx.AsyncClient``; this is the transport under it.
httpx's default transport (httpcore) is general and correct, but a relay pays for that
generality on every request and every token: its pool walks every connection it holds (and
polls each idle socket) whenever a request starts or ends, and each chunk of a streamed body
climbs through several generator layers and h11's event machinery. Measured on the overhead
benchmark (``narwhal bench overhead``), that was the largest part of the router's CPU per
request.

This transport does only what engines need, over sockets whose calls it makes itself
(:mod:`narwhal.sockets`: a read the kernel completes at once is not a trip through Trio's
scheduler, and only a read that waits has a deadline, kept by one task per transport rather
than by a cancel scope per read: :class:`_ReadWatch`):

* a last-in-first-out pool of keep-alive connections (the most recently used, warmest
  connection is reused; only the connection taken is checked for a close by the peer);
* the request written in one ``send_all``;
* the response head parsed by `h11`_, which rejects every malformed head (a bad
  status line or header, a bad, conflicting or negative ``Content-Length``, an unknown
  ``Transfer-Encoding``, a head over 64 KiB) and decides the framing;
* the body framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the
  connection (HTTP/1.0), a chunked body decoded in place by a strict decoder (a size line is
  1 to 16 hex digits, at most 1 KiB with its extensions): one network read yields everything
  it completed, however many engine events that is (h11 would make each chunk an event of
  its own, which on a token stream more than doubles the transport's CPU);
* timeouts from ``httpx.Timeout`` (connect, read gap, pool) and every failure translated to
  httpx's exception tree (an engine that breaks HTTP/1.1 in any way is one
  :class:`httpx.RemoteProtocolError`), so callers see plain httpx.

Each request's pool slot and connection are held by one :class:`_Lease`, the only code that
gives them back: when the body is read to its end, when it is closed early, and on any error or
cancellation on the way. A connection goes back to the pool only when its body was read to the
end and both sides may go on; a body closed early (a client went away, a deadline passed)
closes its connection, which is how the engine learns to stop generating.

.. _h11: https://h11.readthedocs.io/
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator

import h11
import httpx
import trio

from narwhal.sockets import SocketStream

__all__ = [
    "ChunkedDecoder",
    "EngineTransport",
    "OneShotBody",
    "StreamResponse",
    "read_once",
    "request_head",
]

_MAX_HEAD_BYTES = 65536  # a response head (or a chunked body's trailers) longer is an error
_MAX_CHUNK_LINE = 1024  # a chunk's size line, extensions included
_READ_SIZE = 65536
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;[^\r\n]*)?[ \t]*")


class _Connection:
    """A socket, with the bytes received past the end of the last response head."""

    __slots__ = ("buffer", "deadline", "received", "stream", "timed_out", "watch")

    def __init__(self, stream: SocketStream, watch: _ReadWatch) -> None:
        self.stream = stream
        self.watch = watch
        self.buffer = b""
        self.received = False  # whether any byte of the current response has arrived
        self.deadline = math.inf  # of the read that waits, while one does
        self.timed_out = False  # the watch ended that read

    def peer_closed(self) -> bool:
        """An idle connection with something to read has been closed (or broken) by the peer."""
        try:
            return self.stream.peer_closed()
        except OSError:
            return True

    async def receive(self, read_s: float, request: httpx.Request) -> bytes:
        """One network read; empty when the peer has closed.

        Raises:
            httpx.ReadTimeout: nothing arrived within ``read_s``.
            httpx.ReadError: the connection broke.
        """
        stream = self.stream
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            data = stream.receive_nowait(_READ_SIZE)
            if data is None:
                # Only a read that waits has a deadline, kept by the transport's watch rather
                # than by a cancel scope of its own (which cost more than the read and its wait).
                watch = self.watch
                watch.begin(self, trio.current_time() + read_s)
                try:
                    while data is None:
                        await stream.wait_readable()
                        data = stream.receive_nowait(_READ_SIZE)
                except trio.ClosedResourceError:
                    if self.timed_out:
                        raise httpx.ReadTimeout(
                            "the engine sent nothing in time", request=request
                        ) from None
                    raise
                finally:
                    watch.end(self)
            else:
                await stream.yield_if_due()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpx.ReadError(f"the connection broke: {exc!r}", request=request) from exc
        if data:
            self.received = True
        return data

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class _ReadWatch:
    """The deadlines of a transport's reads that wait, kept by one task.

    A read that has to wait says so (:meth:`begin`, with its deadline) and when it is over
    (:meth:`end`): a set's add and discard, where a cancel scope of its own, entered and left
    once per waiting read (nearly every read of a token stream), cost more than the read's
    system call and its wait together. One task, started by the first wait of a Trio run and
    gone once nothing waits, sleeps until the earliest deadline; a read whose deadline passes
    is woken as its socket closing would wake it (``notify_closing``) and raises
    :class:`httpx.ReadTimeout`, at its deadline exactly. A timed-out connection is never reused
    (a failed read ends its lease without reuse).
    """

    __slots__ = ("_running", "_sleep", "_target", "_waiting")

    def __init__(self) -> None:
        self._waiting: set[_Connection] = set()
        self._running = False
        self._target = math.inf  # the deadline the task sleeps until
        self._sleep: trio.CancelScope | None = None

    def begin(self, connection: _Connection, deadline: float) -> None:
        """``connection``'s read waits, until ``deadline`` at the latest."""
        connection.deadline = deadline
        connection.timed_out = False
        self._waiting.add(connection)
        if not self._running:
            self._running = True
            trio.lowlevel.spawn_system_task(self._watch, name="narwhal engine read deadlines")
        elif deadline < self._target and self._sleep is not None:
            self._sleep.cancel()  # an earlier deadline than the one slept to

    def end(self, connection: _Connection) -> None:
        """``connection``'s read is over (its data came, it failed, or it was cancelled)."""
        self._waiting.discard(connection)
        connection.timed_out = False

    async def _watch(self) -> None:
        # A system task: it must not raise (but the run's end cancelling it).
        try:
            while self._waiting:
                now = trio.current_time()
                target = math.inf
                for connection in list(self._waiting):
                    if connection.deadline <= now:
                        self._waiting.discard(connection)
                        connection.timed_out = True
                        sock = connection.stream.socket
                        if sock.fileno() != -1:
                            trio.lowlevel.notify_closing(sock)
                    else:
                        target = min(target, connection.deadline)
                if not self._waiting:
                    break
                self._target = target
                with trio.CancelScope(deadline=target) as self._sleep:
                    await trio.sleep_forever()
                self._sleep = None
        finally:
            self._running = False
            self._target = math.inf
            self._sleep = None


class EngineTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over Trio sockets with a LIFO keep-alive pool (``http://`` URLs only).

    Args:
        max_connections: connections open at once (requests beyond wait for one).
        timeout: connect, read-gap and pool timeouts (``write`` is not used: requests are small).
    """

    def __init__(self, *, max_connections: int, timeout: httpx.Timeout) -> None:
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._connect_s = _seconds(timeout.connect)
        self._read_s = _seconds(timeout.read)
        self._pool_s = _seconds(timeout.pool)
        self._closed = False
        self._watch = _ReadWatch()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.close()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"EngineTransport serves http:// only, not {request.url.scheme}://",
                request=request,
            )
        payload = _request_bytes(request, await read_once(request))
        return (await self.send_prepared(request, payload)).as_httpx()

    async def send_prepared(self, request: httpx.Request, payload: bytes) -> StreamResponse:
        """Send ``payload``, a whole request already framed for ``request``'s method and URL
        (which the response and every exception name; its own body is not read), and return
        the response's head and body stream.

        The engine client frames its streams' requests itself, from a head made once per route
        (:func:`request_head`), and reads the body's stream itself: cheaper than an
        ``httpx.Request`` and an ``httpx.Response`` per stream.
        """
        try:
            self._slots.acquire_nowait()  # nearly always: no scope, no trip through the loop
        except trio.WouldBlock:
            with trio.move_on_after(self._pool_s) as waiting:
                await self._slots.acquire()
            if waiting.cancelled_caught:
                raise httpx.PoolTimeout(
                    "no free connection to the engine", request=request
                ) from None
        lease = _Lease(self)
        try:
            head = await self._exchange(lease, request, payload)
            body = _Body(lease, request, self._read_s, head)
        except BaseException:
            await lease.end(reuse=False)
            raise
        return StreamResponse(request, head, body)

    async def _exchange(
        self, lease: _Lease, request: httpx.Request, payload: bytes
    ) -> h11.Response:
        # A reused connection may have been closed by the engine while idle; a request whose
        # answer had not begun on one is sent again, once, on a new connection.
        while self._idle:
            connection = self._idle.pop()
            if connection.peer_closed():
                await connection.close()
                continue
            lease.connection = connection
            try:
                return await self._send(connection, request, payload)
            except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
                if connection.received:
                    raise
            lease.connection = None
            await connection.close()
            break
        lease.connection = await self._connect(request)
        return await self._send(lease.connection, request, payload)

    async def _connect(self, request: httpx.Request) -> _Connection:
        url = request.url
        port = url.port or 80
        try:
            with trio.fail_after(self._connect_s):
                stream = await trio.open_tcp_stream(url.host, port)
        except trio.TooSlowError as exc:
            raise httpx.ConnectTimeout(f"connecting to {url.host}:{port}", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return _Connection(SocketStream.adopt(stream), self._watch)

    async def _send(
        self, connection: _Connection, request: httpx.Request, payload: bytes
    ) -> h11.Response:
        # h11 reads the response head; the body is left in the connection's buffer for _Body.
        # It is told of the request through a stand-in of the same method (which is all that
        # the response's framing depends on): cheaper than having it write the request.
        parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)
        parser.send(_stand_in(request.method))
        connection.received = False
        try:
            await connection.stream.send_all(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpx.WriteError(f"the connection broke: {exc!r}", request=request) from exc
        fed = 0
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(
                    f"the engine sent a malformed response head: {exc}", request=request
                ) from exc
            if event is h11.NEED_DATA:
                data = await connection.receive(self._read_s, request)
                fed += len(data)
                parser.receive_data(data)
            elif type(event) is h11.Response:
                connection.buffer = parser.trailing_data[0]
                # h11 bounds a head still incomplete; one that arrived whole is bounded here
                if fed - len(connection.buffer) > _MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError(
                        "the engine sent a response head over 64 KiB", request=request
                    )
                return event
            elif type(event) is not h11.InformationalResponse:
                raise httpx.RemoteProtocolError(
                    "the engine closed the connection before answering", request=request
                )


def _seconds(value: float | None) -> float:
    return math.inf if value is None else value


_STAND_INS: dict[str, h11.Request] = {}


def _stand_in(method: str) -> h11.Request:
    """A bodiless request of ``method``, to put an h11 client connection where it reads a
    response."""
    request = _STAND_INS.get(method)
    if request is None:
        request = h11.Request(method=method, target="/", headers=[("Host", "engine")])
        _STAND_INS[method] = request
    return request


class OneShotBody(httpx.AsyncByteStream):
    """A request body that is let go once it has been sent.

    httpx keeps a request's body for as long as its response lives, and a response is a
    stream that lives as long as the engine answers: the bytes of every running request's
    prompt would stay in memory for its whole decode. This stream gives its bytes once and
    drops them (a second read gets nothing: no request here is sent twice).
    """

    __slots__ = ("_body",)

    def __init__(self, body: bytes) -> None:
        self._body = body

    def __aiter__(self) -> AsyncIterator[bytes]:
        # An iterator, not an async generator: a send that fails half way (the peer gone)
        # abandons it, and an abandoned generator would be finalised by the garbage collector,
        # which reports it (pytest's warnings-as-errors saw one per etcd restart).
        body, self._body = self._body, b""
        return _Once(body)


class _Once:
    """An async iterator over one body part."""

    __slots__ = ("_part",)

    def __init__(self, part: bytes) -> None:
        self._part: bytes | None = part

    def __aiter__(self) -> _Once:
        return self

    async def __anext__(self) -> bytes:
        part, self._part = self._part, None
        if part is None:
            raise StopAsyncIteration
        return part


async def read_once(request: httpx.Request) -> bytes:
    """``request``'s body, read from its stream and not kept on the request.

    ``request.aread()`` would keep a copy on the request, which its response holds for as long
    as the stream runs; with a :class:`OneShotBody` nothing holds the bytes once they are sent.
    """
    stream = request.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise TypeError("only async request bodies are sent here")
    return b"".join([part async for part in stream])


def request_head(request: httpx.Request) -> bytes:
    """``request``'s request line and header lines, each ending in CRLF, without its framing
    (``Content-Length`` and ``Transfer-Encoding`` are left out) and without the blank line.

    Raises:
        httpx.LocalProtocolError: a header name or value holds a line break.
    """
    url = request.url
    lines = [request.method.encode("ascii") + b" " + url.raw_path + b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            continue
        if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
            raise httpx.LocalProtocolError(f"a line break in header {name!r}", request=request)
        lines.append(name + b": " + value + b"\r\n")
    return b"".join(lines)


def _request_bytes(request: httpx.Request, body: bytes) -> bytes:
    """The request head and body, framed by ``Content-Length``.

    Raises:
        httpx.LocalProtocolError: a header name or value holds a line break.
    """
    head = request_head(request)
    if body or request.method in ("POST", "PUT", "PATCH"):
        head += b"Content-Length: " + str(len(body)).encode("ascii") + b"\r\n"
    return head + b"\r\n" + body


class StreamResponse:
    """A response's head and its body stream, as :meth:`EngineTransport.send_prepared` gives
    them: what a stream reads, without an ``httpx.Response`` (its headers, cookies and
    extensions) until one is asked for.

    Attributes:
        status_code: the response's status.
        stream: the body, decoded from its framing (not from a content coding) as it arrives.
    """

    __slots__ = ("_head", "_request", "status_code", "stream")

    def __init__(self, request: httpx.Request, head: h11.Response, stream: _Body) -> None:
        self._request = request
        self._head = head
        self.status_code = head.status_code
        self.stream = stream

    def as_httpx(self) -> httpx.Response:
        """The same response as an ``httpx.Response`` (its body not yet read)."""
        head = self._head
        return httpx.Response(
            head.status_code,
            headers=head.headers.raw_items(),
            stream=self.stream,
            request=self._request,
            extensions={"http_version": b"HTTP/" + head.http_version},
        )

    async def aread(self) -> bytes:
        """The whole body, decoded as httpx does (a content coding included)."""
        return await self.as_httpx().aread()

    async def aclose(self) -> None:
        """Close the body: a body not read to its end closes its connection."""
        await self.stream.aclose()


class _Lease:
    """One request's pool slot and the connection it uses; :meth:`end` gives both back, once."""

    __slots__ = ("connection", "held", "transport")

    def __init__(self, transport: EngineTransport) -> None:
        self.transport = transport
        self.connection: _Connection | None = None
        self.held = True

    async def end(self, *, reuse: bool) -> None:
        """Give the slot back; pool the connection if ``reuse`` (and the pool is open), else
        close it. Later calls do nothing."""
        if not self.held:
            return
        self.held = False
        connection, self.connection = self.connection, None
        transport = self.transport
        try:
            if connection is not None:
                if reuse and not transport._closed:
                    transport._idle.append(connection)
                else:
                    await connection.close()
        finally:
            transport._slots.release()


class ChunkedDecoder:
    """Incremental, strict ``Transfer-Encoding: chunked`` decoding (pure).

    ``feed`` returns the payload bytes that the data completes, possibly several chunks' worth
    at once; ``done`` turns true after the last chunk and its trailers; ``rest`` holds bytes
    received after the end (there should be none: requests are not pipelined).
    """

    __slots__ = ("_buffer", "_crlf", "_left", "_trailers", "done")

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # payload bytes still due in the current chunk
        self._crlf = 0  # bytes of the CRLF after a chunk still to skip
        self._trailers = False
        self.done = False

    @property
    def rest(self) -> bytes:
        """Bytes after the end of the body."""
        return self._buffer if self.done else b""

    def feed(self, data: bytes) -> bytes:
        """Add received bytes; return the payload they complete.

        Raises:
            ValueError: the framing is malformed, or a size line or the trailers are too long.
        """
        buffer = self._buffer + data if self._buffer else data
        size = len(buffer)
        position = 0
        out: list[bytes] = []
        while position < size and not self.done:
            if self._left:
                take = min(self._left, size - position)
                out.append(buffer[position : position + take])
                position += take
                self._left -= take
                if not self._left:
                    self._crlf = 2
            elif self._crlf:
                skip = min(self._crlf, size - position)
                if buffer[position : position + skip] != b"\r\n"[2 - self._crlf :][:skip]:
                    raise ValueError("a chunk is not followed by CRLF")
                position += skip
                self._crlf -= skip
            elif self._trailers:
                if buffer.startswith(b"\r\n", position):
                    position += 2
                    self.done = True
                    break
                end = buffer.find(b"\r\n\r\n", position)
                if end < 0:
                    if size - position > _MAX_HEAD_BYTES:
                        raise ValueError("the trailers are too long")
                    break
                position = end + 4
                self.done = True
            else:
                end = buffer.find(b"\r\n", position, position + _MAX_CHUNK_LINE)
                if end < 0:
                    if size - position >= _MAX_CHUNK_LINE:
                        raise ValueError("a chunk size line is too long")
                    break
                text = buffer[position:end]
                if text and len(text) <= 16 and not text.translate(None, _HEX_DIGITS):
                    chunk = int(text, 16)  # the common line: the size alone
                else:
                    line = _CHUNK_SIZE.fullmatch(text)
                    if line is None:
                        raise ValueError(f"a malformed chunk size line {text[:64]!r}")
                    chunk = int(line[1], 16)
                position = end + 2
                if not chunk:
                    self._trailers = True
                elif buffer[position + chunk : position + chunk + 2] == b"\r\n":
                    # The common case: the whole chunk and its CRLF are here, taken at once.
                    out.append(buffer[position : position + chunk])
                    position += chunk + 2
                else:
                    self._left = chunk
        self._buffer = buffer[position:]
        if len(out) == 1:
            return out[0]
        return b"".join(out)


class _Body(httpx.AsyncByteStream):
    """A response body, decoded as it arrives; its lease ends when it does."""

    __slots__ = ("_chunked", "_keep_alive", "_lease", "_read_s", "_remaining", "_request")

    def __init__(
        self, lease: _Lease, request: httpx.Request, read_s: float, head: h11.Response
    ) -> None:
        self._lease = lease
        self._request = request
        self._read_s = read_s
        self._chunked: ChunkedDecoder | None = None
        self._remaining: int | None = None  # None: until the connection closes
        # h11 has validated the head: at most one Transfer-Encoding, and it is chunked; one
        # Content-Length, of digits; names lower-cased.
        keep_alive = head.http_version == b"1.1"
        length: int | None = None
        for name, value in head.headers:
            if name == b"transfer-encoding":
                self._chunked = ChunkedDecoder()
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection" and b"close" in value.lower():
                keep_alive = False
        if head.status_code in (204, 304) or request.method == "HEAD":
            self._chunked, self._remaining = None, 0  # no body, whatever the head says
        elif self._chunked is None:
            self._remaining = length
        elif length is not None:
            keep_alive = False  # chunked wins over Content-Length; the connection is not reused
        self._keep_alive = keep_alive and (self._chunked is not None or self._remaining is not None)

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        connection = self._lease.connection
        if connection is None:
            raise StopAsyncIteration
        try:
            data, ended = await self._next(connection)
        except BaseException:
            await self._lease.end(reuse=False)
            raise
        if ended:
            await self._lease.end(reuse=self._keep_alive and not connection.buffer)
            if not data:
                raise StopAsyncIteration
        return data

    async def _next(self, connection: _Connection) -> tuple[bytes, bool]:
        """The payload the received bytes complete (a read only when they complete nothing),
        and whether the body has ended."""
        data, connection.buffer = connection.buffer, b""
        while True:
            if data:
                out, ended = self._decode(data, connection)
                if out or ended:
                    return out, ended
            elif self._remaining == 0:
                return b"", True
            data = await connection.receive(self._read_s, self._request)
            if not data:
                if self._chunked is None and self._remaining is None:
                    return b"", True  # a body delimited by the end of the connection
                raise httpx.RemoteProtocolError(
                    "the engine closed the connection mid-response", request=self._request
                )

    def _decode(self, data: bytes, connection: _Connection) -> tuple[bytes, bool]:
        chunked = self._chunked
        if chunked is not None:
            try:
                out = chunked.feed(data)
            except ValueError as exc:
                raise httpx.RemoteProtocolError(
                    f"the engine broke chunked framing: {exc}", request=self._request
                ) from exc
            if chunked.done:
                connection.buffer = chunked.rest
                return out, True
            return out, False
        remaining = self._remaining
        if remaining is None:
            return data, False
        out = data[:remaining]
        connection.buffer = data[remaining:]
        self._remaining = remaining = remaining - len(out)
        return out, remaining == 0

    async def aclose(self) -> None:
        await self._lease.end(reuse=False)
