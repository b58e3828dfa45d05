"""A lean HTTP/1.1 transport for httpx, built for many long token streams to one engine.

Narwhal talks to each engine through one ``httpx.AsyncClient``; this is the transport under it.
httpx's default transport (httpcore) is general and correct, but a relay pays for that
generality on every request and every token: its pool walks every connection it holds (and
polls each idle socket) whenever a request starts or ends, and each chunk of a streamed body
climbs through several generator layers and h11's parser. Measured on the overhead benchmark
(``narwhal bench overhead``), that was the largest part of the router's CPU per request.

This transport does only what engines need, over Trio sockets:

* a last-in-first-out pool of keep-alive connections (the most recently used, warmest
  connection is reused; only the connection taken is checked for a close by the peer);
* the request head written in one ``send_all`` with its body;
* the response head parsed by hand (status line and headers), the body framed by
  ``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection, and a chunked
  body decoded in place: one network read yields everything it completed, however many engine
  events that is;
* timeouts from ``httpx.Timeout`` (connect, read gap, pool) and errors translated to httpx's
  exception tree, so callers see plain httpx.

A connection goes back to the pool only when its body was read to the end; a body closed early
(a client went away, a deadline passed) closes its connection, which is how the engine learns
to stop generating.
"""

from __future__ import annotations

import math

import httpx
import trio

__all__ = ["ChunkedDecoder", "EngineTransport"]

_MAX_HEAD_BYTES = 65536
_READ_SIZE = 65536


class _Connection:
    __slots__ = ("buffer", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    def peer_closed(self) -> bool:
        """An idle connection with something to read has been closed (or broken) by the peer."""
        try:
            return bool(self.stream.socket.is_readable())
        except OSError:
            return True

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


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
        payload = _request_bytes(request, await request.aread())
        with trio.move_on_after(self._pool_s) as waiting:
            await self._slots.acquire()
        if waiting.cancelled_caught:
            raise httpx.PoolTimeout("no free connection to the engine", request=request)
        try:
            connection, status, headers = await self._exchange(request, payload)
        except BaseException:
            self._slots.release()
            raise
        body = _Body(self, connection, request, headers)
        return httpx.Response(
            status,
            headers=headers,
            stream=body,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _exchange(
        self, request: httpx.Request, payload: bytes
    ) -> tuple[_Connection, int, list[tuple[bytes, bytes]]]:
        # A reused connection may have been closed by the engine while idle; such a request
        # is sent again, once, on a new connection.
        while self._idle:
            connection = self._idle.pop()
            if connection.peer_closed():
                await connection.close()
                continue
            try:
                return await self._send(connection, request, payload)
            except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
                await connection.close()
                break
        connection = await self._connect(request)
        try:
            return await self._send(connection, request, payload)
        except BaseException:
            await connection.close()
            raise

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
        return _Connection(stream)

    async def _send(
        self, connection: _Connection, request: httpx.Request, payload: bytes
    ) -> tuple[_Connection, int, list[tuple[bytes, bytes]]]:
        try:
            await connection.stream.send_all(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpx.WriteError(str(exc), request=request) from exc
        while True:
            end = connection.buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(connection.buffer) > _MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("response head too large", request=request)
            await self._receive(connection, request)
        head, connection.buffer = connection.buffer[:end], connection.buffer[end + 4 :]
        status, headers = _parse_head(head, request)
        return connection, status, headers

    async def _receive(self, connection: _Connection, request: httpx.Request) -> bytes:
        # A bare cancel scope: this runs once per network read, and fail_after's context-manager
        # wrapper costs more than the scope itself.
        scope = trio.CancelScope(deadline=trio.current_time() + self._read_s)
        try:
            with scope:
                data = await connection.stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpx.ReadError(str(exc), request=request) from exc
        if scope.cancelled_caught:
            raise httpx.ReadTimeout("the engine sent nothing in time", request=request)
        if not data:
            raise httpx.RemoteProtocolError(
                "the engine closed the connection mid-response", request=request
            )
        connection.buffer += data
        return data

    def _reuse(self, connection: _Connection) -> None:
        if self._closed:
            trio.lowlevel.spawn_system_task(connection.close)
        else:
            self._idle.append(connection)


def _seconds(value: float | None) -> float:
    return math.inf if value is None else value


def _request_bytes(request: httpx.Request, body: bytes) -> bytes:
    url = request.url
    target = url.raw_path
    lines = [request.method.encode("ascii") + b" " + target + b" HTTP/1.1"]
    seen_length = False
    for name, value in request.headers.raw:
        lowered = name.lower()
        if lowered in (b"content-length", b"transfer-encoding"):
            seen_length = seen_length or lowered == b"content-length"
            if lowered == b"transfer-encoding":
                continue
        lines.append(name + b": " + value)
    if not seen_length and (body or request.method in ("POST", "PUT", "PATCH")):
        lines.append(b"Content-Length: " + str(len(body)).encode("ascii"))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _parse_head(head: bytes, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0]!r}", request=request)
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError(f"malformed header line {line!r}", request=request)
        headers.append((name.strip(), value.strip()))
    return int(parts[1]), headers


class ChunkedDecoder:
    """Incremental ``Transfer-Encoding: chunked`` decoding (pure).

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
            ValueError: the framing is malformed.
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
                    raise ValueError("chunk not followed by CRLF")
                position += skip
                self._crlf -= skip
            elif self._trailers:
                if size - position < 2:
                    break
                if buffer[position : position + 2] == b"\r\n":
                    position += 2
                    self.done = True
                    break
                end = buffer.find(b"\r\n\r\n", position)
                if end < 0:
                    break
                position = end + 4
                self.done = True
            else:
                end = buffer.find(b"\r\n", position)
                if end < 0:
                    if size - position > 1024:
                        raise ValueError("chunk size line too long")
                    break
                text = buffer[position:end].split(b";", 1)[0].strip()
                chunk = int(text, 16)
                if chunk < 0:
                    raise ValueError(f"negative chunk size {text!r}")
                position = end + 2
                if chunk:
                    self._left = chunk
                else:
                    self._trailers = True
        self._buffer = buffer[position:]
        if len(out) == 1:
            return out[0]
        return b"".join(out)


class _Body(httpx.AsyncByteStream):
    """A response body, decoded as it arrives; the connection is reused only when it ends."""

    def __init__(
        self,
        transport: EngineTransport,
        connection: _Connection,
        request: httpx.Request,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self._transport = transport
        self._connection: _Connection | None = connection
        self._request = request
        self._chunked: ChunkedDecoder | None = None
        self._remaining: int | None = None  # None: until the connection closes
        keep_alive = True
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = ChunkedDecoder()
            elif lowered == b"content-length":
                self._remaining = int(value)
            elif lowered == b"connection" and b"close" in value.lower():
                keep_alive = False
        self._keep_alive = keep_alive and (self._chunked is not None or self._remaining is not None)
        self._done = self._chunked is None and self._remaining == 0

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        while True:
            connection = self._connection
            if connection is None:
                raise StopAsyncIteration
            data = self._take(connection)
            if self._done:
                await self._finish()
            if data:
                return data
            if self._done:
                raise StopAsyncIteration
            try:
                await self._transport._receive(connection, self._request)
            except httpx.RemoteProtocolError:
                if self._chunked is None and self._remaining is None:
                    self._done = True  # a read-until-close body: the end of the connection
                    continue
                raise

    def _take(self, connection: _Connection) -> bytes:
        buffer, connection.buffer = connection.buffer, b""
        if self._chunked is not None:
            try:
                data = self._chunked.feed(buffer)
            except ValueError as exc:
                raise httpx.RemoteProtocolError(str(exc), request=self._request) from exc
            if self._chunked.done:
                self._done = True
                connection.buffer = self._chunked.rest
            return data
        if self._remaining is None:
            return buffer
        data = buffer[: self._remaining]
        connection.buffer = buffer[self._remaining :]
        self._remaining -= len(data)
        if self._remaining == 0:
            self._done = True
        return data

    async def _finish(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        self._transport._slots.release()
        if self._keep_alive and not connection.buffer:
            self._transport._reuse(connection)
        else:
            await connection.close()

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        self._transport._slots.release()
        await connection.close()
