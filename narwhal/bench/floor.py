"""The floor: the cheapest HTTP relay this stack can be, as a target of ``narwhal bench overhead``.

``python -m narwhal.bench.floor --bind 127.0.0.1:PORT --upstream http://127.0.0.1:EPORT``
relays HTTP/1.1 between clients and one engine with Python 3.11 and Trio, one task per client
connection, on Narwhal's own socket calls (:class:`narwhal.sockets.SocketStream`). Per client
connection it keeps one upstream keep-alive connection, opened on the first request. It reads
a request's head up to the blank line and ``Content-Length`` bytes of body, forwards those
bytes verbatim in one write, then relays the engine's response verbatim, one client write per
upstream read, finding only where it ends (``Content-Length``, or the chunk boundaries of
``Transfer-Encoding: chunked`` up to the terminal chunk), and reads the next request.

What it is not: a router. It parses no JSON, admits, places, checks and learns nothing, adds
and removes no header (the engine sees the client's ``Host``), logs nothing per request, and
closes a connection whose framing is anything else (a chunked request body, a malformed head).

Why: issue 11 asks, for any relay target not met, for the measurement that shows why the
remaining time cannot go lower in this stack. Measured in the same rounds as Narwhal
(``narwhal bench overhead --floor``), the floor's added latency and CPU per request are what
any relay pays here for reading and writing sockets from a Trio task in Python; what Narwhal
adds beyond it is Narwhal's own work, and what the floor adds beyond vllm-router is the stack's.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from urllib.parse import urlsplit

import trio

from narwhal.sockets import SocketStream

__all__ = [
    "MAX_HEAD_BYTES",
    "ChunkedEnd",
    "FramingError",
    "RelayServe",
    "main",
    "run_relay",
    "serve_floor",
    "upstream_address",
]

MAX_HEAD_BYTES = 65536
"""The longest request or response head (and chunk size line, and trailer line) accepted."""


class FramingError(ValueError):
    """A request or response whose end the floor cannot find: the connection is closed."""


class _NoResponse(FramingError):
    """The engine ended or broke the connection before a byte of its response came."""


class ChunkedEnd:
    """Finds where a ``Transfer-Encoding: chunked`` body ends, without copying its payload.

    :meth:`feed` takes the body's bytes as they arrive and tells where in them the body ended
    (just past the terminal chunk's trailers), once it has. Only size lines and trailer lines
    split across reads are kept, bounded by :data:`MAX_HEAD_BYTES`.
    """

    __slots__ = ("_crlf", "_left", "_line", "_trailers", "done")

    def __init__(self) -> None:
        self._left = 0  # payload bytes still due in the current chunk
        self._crlf = 0  # bytes of the CRLF after a chunk's payload still due
        self._line = b""  # a size or trailer line split across reads
        self._trailers = False  # past the terminal chunk's size line
        self.done = False

    def feed(self, data: bytes) -> int:
        """Add the body's next bytes; return the index in ``data`` just past the end of the
        body, or -1 while it has not ended.

        Raises:
            FramingError: the framing is malformed, a line is too long, or bytes come after
                the end.
        """
        if self.done:
            raise FramingError("bytes after the end of a chunked body")
        position, size = 0, len(data)
        while position < size:
            if self._left:
                take = min(self._left, size - position)
                position += take
                self._left -= take
                if not self._left:
                    self._crlf = 2
            elif self._crlf:
                if data[position] != (13 if self._crlf == 2 else 10):
                    raise FramingError("a chunk is not followed by CRLF")
                position += 1
                self._crlf -= 1
            else:
                end = data.find(b"\n", position)
                if end < 0:
                    self._line += data[position:]
                    if len(self._line) > MAX_HEAD_BYTES:
                        raise FramingError("a chunk size or trailer line is too long")
                    return -1
                line = self._line + data[position:end] if self._line else data[position:end]
                self._line = b""
                position = end + 1
                if not line.endswith(b"\r"):
                    raise FramingError("a line of a chunked body does not end in CRLF")
                if self._trailers:
                    if line == b"\r":
                        self.done = True
                        return position
                    continue  # a trailer field: skipped
                self._left = _chunk_size(line[:-1])
                self._trailers = not self._left
        return -1


_HEX = frozenset(b"0123456789abcdefABCDEF")


def _chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip(b" \t")
    if not text or len(text) > 16 or not _HEX.issuperset(text):
        raise FramingError("a malformed chunk size line")
    return int(text, 16)


def _parse_head(head: bytes) -> tuple[list[bytes], dict[bytes, bytes]]:
    """The start line's parts (at least two) and the header fields (lower-case names) of a
    head without its final blank line.

    Raises:
        FramingError: the start line has fewer than two parts, a line is not a header field,
            or ``Content-Length`` is repeated with different values.
    """
    start, *lines = head.split(b"\r\n")
    fields: dict[bytes, bytes] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise FramingError("a malformed header line")
        key, value = name.lower(), value.strip(b" \t")
        if key == b"content-length" and fields.get(key, value) != value:
            raise FramingError("conflicting Content-Length fields")
        fields[key] = (fields[key] + b", " + value) if key in fields else value
    parts = start.split(b" ", 2)
    if len(parts) < 2:
        raise FramingError("a malformed start line")
    return parts, fields


def _content_length(fields: dict[bytes, bytes]) -> int | None:
    value = fields.get(b"content-length")
    if value is None:
        return None
    if not value.isdigit() or len(value) > 18:
        raise FramingError("a malformed Content-Length")
    return int(value)


def _wants_close(version: bytes, fields: dict[bytes, bytes]) -> bool:
    tokens = {token.strip() for token in fields.get(b"connection", b"").lower().split(b",")}
    return version != b"HTTP/1.1" or b"close" in tokens


async def _read_request(client: SocketStream, buffer: bytes) -> tuple[bytes, bytes, bool] | None:
    """The next request's bytes from ``client`` (``buffer`` holds what came after the last):
    the request, what came after it, and whether it is a ``HEAD``; ``None`` when the client
    ended its side first.

    Raises:
        FramingError: the request is not framed by its head and ``Content-Length``.
    """
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise FramingError("the request head is too long")
        data = await client.receive_some()
        if not data:
            return None
        buffer += data
    (method, *_), fields = _parse_head(buffer[:end])
    if b"transfer-encoding" in fields:
        raise FramingError("a request body that is not framed by Content-Length")
    total = end + 4 + (_content_length(fields) or 0)
    while len(buffer) < total:
        data = await client.receive_some()
        if not data:
            return None
        buffer += data
    return buffer[:total], buffer[total:], method == b"HEAD"


async def _relay_response(engine: SocketStream, client: SocketStream, *, head_only: bool) -> bool:
    """Relay one response from ``engine`` to ``client`` verbatim until its end: whether both
    connections may carry another request.

    Raises:
        FramingError: the response is not framed by ``Content-Length`` or chunks, or the engine
            closed the connection before its head ended (``_NoResponse`` before any of it).
        trio.BrokenResourceError: either side went away.
    """
    head = b""
    while (end := head.find(b"\r\n\r\n")) < 0:
        if len(head) > MAX_HEAD_BYTES:
            raise FramingError("the response head is too long")
        try:
            data = await engine.receive_some()
        except trio.BrokenResourceError:
            if head:
                raise
            data = b""
        if not data:
            raise _NoResponse() if not head else FramingError("the response head was cut short")
        await client.send_all(data)
        head += data
    (version, status, *_), fields = _parse_head(head[:end])
    rest = head[end + 4 :]
    keep = not _wants_close(version, fields)
    if status[:1] == b"1":
        return False  # an interim response: nothing the floor's clients ask for
    if head_only or status in (b"204", b"304"):
        return keep and not rest
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        ended = ChunkedEnd()
        if rest and ended.feed(rest) not in (-1, len(rest)):
            return False
        while not ended.done:
            data = await engine.receive_some()
            if not data:
                return False
            await client.send_all(data)
            if ended.feed(data) not in (-1, len(data)):
                return False  # bytes past the end: the connection cannot be trusted
        return keep
    length = _content_length(fields)
    if length is None:  # delimited by the engine closing the connection
        while data := await engine.receive_some():
            await client.send_all(data)
        return False
    left = length - len(rest)
    while left > 0:
        data = await engine.receive_some()
        if not data:
            return False
        await client.send_all(data)
        left -= len(data)
    return keep and left == 0


async def _exchange(
    engine: SocketStream, client: SocketStream, request: bytes, *, head_only: bool
) -> bool:
    """Send ``request`` to ``engine`` in one write and relay its response (see
    :func:`_relay_response`); a write the engine refused is :class:`_NoResponse`."""
    try:
        await engine.send_all(request)
    except trio.BrokenResourceError as exc:
        raise _NoResponse() from exc
    return await _relay_response(engine, client, head_only=head_only)


class _Upstream:
    """A client connection's one upstream keep-alive connection, opened when first needed and
    reopened when the engine closed it while idle."""

    def __init__(self, host: str, port: int) -> None:
        self._address = (host, port)
        self.stream: SocketStream | None = None

    async def connection(self) -> tuple[SocketStream, bool]:
        """The connection, and whether it carried a request before."""
        if self.stream is not None and self.stream.peer_closed():
            await self.aclose()
        if self.stream is not None:
            return self.stream, True
        self.stream = SocketStream.adopt(await trio.open_tcp_stream(*self._address))
        return self.stream, False

    async def aclose(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            await stream.aclose()


async def _relay_connection(host: str, port: int, accepted: trio.SocketStream) -> None:
    """Serve one client connection until either side ends it or its framing is anything
    else; never raises for what the client or the engine do."""
    client = SocketStream.adopt(accepted)
    upstream = _Upstream(host, port)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(client.aclose)
        stack.push_async_callback(upstream.aclose)
        with contextlib.suppress(
            trio.BrokenResourceError, trio.ClosedResourceError, OSError, FramingError
        ):
            buffer = b""
            keep = True
            while keep:
                request = await _read_request(client, buffer)
                if request is None:
                    return
                data, buffer, head_only = request
                engine, reused = await upstream.connection()
                try:
                    keep = await _exchange(engine, client, data, head_only=head_only)
                except _NoResponse:
                    if not reused:
                        raise
                    # A reused connection the engine closed as the request went out: once more
                    # on a fresh one (nothing of a response had come, so nothing was relayed).
                    await upstream.aclose()
                    engine, _ = await upstream.connection()
                    keep = await _exchange(engine, client, data, head_only=head_only)
                keep = keep and not buffer  # requests are not pipelined


async def serve_floor(
    bind_port: int,
    upstream_url: str,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Relay connections on ``host:bind_port`` (port 0 picks a free one) to ``upstream_url``
    (``http://HOST:PORT``) until cancelled.

    Args:
        bind_port: the port to listen on.
        upstream_url: the engine's base URL, without a path.
        host: the address to listen on.
        task_status: receives the bound port.

    Raises:
        ValueError: ``upstream_url`` is not ``http://HOST[:PORT]``.
        OSError: the port cannot be bound.
    """
    upstream_host, upstream_port = upstream_address(upstream_url)
    handler = partial(_relay_connection, upstream_host, upstream_port)
    listeners = await trio.open_tcp_listeners(bind_port, host=host)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handler, listeners)
            port: int = listeners[0].socket.getsockname()[1]
            task_status.started(port)
    finally:
        for listener in listeners:
            listener.socket.close()


def upstream_address(url: str) -> tuple[str, int]:
    """``http://HOST[:PORT]`` as a host and a port.

    Raises:
        ValueError: another scheme, no host, or a path (requests are forwarded verbatim, so
            the engine must be at the root).
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"the upstream must be http://HOST[:PORT], got {url!r}")
    return parts.hostname, parts.port or 80


RelayServe = Callable[..., Awaitable[None]]
"""Serves a relay: ``serve(bind_port, upstream_url, *, host, task_status)``, the bound port
given to ``task_status`` (:func:`serve_floor`, and the stack floor's)."""


def run_relay(name: str, bind: str, upstream_url: str, serve: RelayServe) -> int:
    """A measuring relay's command: serve on ``bind`` (``HOST:PORT``) in front of
    ``upstream_url`` until SIGTERM or SIGINT (exit 0); 2, said on standard error after
    ``name``, for a wrong ``bind`` or upstream, or a port that cannot be bound."""
    host, colon, port = bind.rpartition(":")
    try:
        if not colon or not port.isdigit():
            raise ValueError(f"--bind: expected HOST:PORT, got {bind!r}")
        upstream_address(upstream_url)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    failure = trio.run(
        _serve_until_signal, name, serve, int(port), upstream_url, host or "127.0.0.1"
    )
    if failure is not None:
        print(f"{name}: {failure}", file=sys.stderr)
        return 2
    return 0


async def _serve_until_signal(
    name: str, serve: RelayServe, port: int, upstream_url: str, host: str
) -> str | None:
    """Serve until SIGTERM or SIGINT; why it could not start, if it could not."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            try:
                bound = await nursery.start(partial(serve, port, upstream_url, host=host))
            except OSError as exc:
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            print(f"{name}: relaying {host}:{bound} to {upstream_url}", file=sys.stderr)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m narwhal.bench.floor",
        description="The cheapest HTTP/1.1 relay in this stack (Python, Trio, Narwhal's socket "
        "calls), a measuring stick for `narwhal bench overhead --floor`: requests and responses "
        "forwarded verbatim, only their ends found. Not a router.",
    )
    parser.add_argument("--bind", required=True, metavar="HOST:PORT", help="where to listen")
    parser.add_argument("--upstream", required=True, metavar="URL", help="the engine's base URL")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the relay until SIGTERM or SIGINT (exit 0); 2 for a wrong command line or a port
    that cannot be bound."""
    args = _parser().parse_args(argv)
    return run_relay("floor", str(args.bind), args.upstream, serve_floor)


if __name__ == "__main__":
    sys.exit(main())
