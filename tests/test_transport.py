"""The engine transport: chunked decoding, keep-alive reuse, early close, errors as httpx's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import httpx
import pytest
import trio

from narwhal.upstream.transport import ChunkedDecoder, EngineTransport

BODY = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nTrailer: x\r\n\r\n"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_chunked_decoding_survives_any_split(size: int) -> None:
    decoder = ChunkedDecoder()
    out = b""
    for start in range(0, len(BODY), size):
        out += decoder.feed(BODY[start : start + size])
    assert out == b"Wikipedia" and decoder.done and decoder.rest == b""


def test_chunked_decoding_without_trailers_and_with_leftovers() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1") == b"abc"
    assert decoder.done and decoder.rest == b"HTTP/1.1"


@pytest.mark.parametrize("bad", [b"zz\r\n", b"3\r\nabcXY", b"-1\r\n"])
def test_malformed_chunking_is_an_error(bad: bytes) -> None:
    with pytest.raises(ValueError):
        ChunkedDecoder().feed(bad)


Handler = Callable[[trio.SocketStream, int], Awaitable[None]]


async def read_request(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    return head


async def serve(nursery: trio.Nursery, handler: Handler) -> tuple[str, list[int]]:
    """A raw HTTP server on a free port; returns its URL and the connection count."""
    connections: list[int] = []

    async def on_connection(stream: trio.SocketStream) -> None:
        connections.append(1)
        number = len(connections)
        try:
            await handler(stream, number)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    listeners = await nursery.start(partial(trio.serve_tcp, on_connection, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}", connections


def client(url: str, *, read_s: float = 5.0) -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=2.0, read=read_s, write=2.0, pool=2.0)
    return httpx.AsyncClient(
        base_url=url, transport=EngineTransport(max_connections=4, timeout=timeout)
    )


async def keep_alive_server(stream: trio.SocketStream, number: int) -> None:
    while await read_request(stream):
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"6\r\ndata: \r\n3\r\n{}\n\r\n1\r\n\n\r\n0\r\n\r\n"
        )


@pytest.mark.realtime
async def test_connections_are_reused_once_a_body_is_read_to_its_end(
    nursery: trio.Nursery,
) -> None:
    url, connections = await serve(nursery, keep_alive_server)
    with trio.fail_after(10):
        async with client(url) as http:
            for _ in range(5):
                response = await http.post("/v1/chat/completions", content=b"{}")
                assert response.status_code == 200 and response.content == b"data: {}\n\n"
    assert len(connections) == 1


@pytest.mark.realtime
async def test_a_body_closed_early_closes_its_connection(nursery: trio.Nursery) -> None:
    closed = trio.Event()

    async def endless(stream: trio.SocketStream, number: int) -> None:
        await read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                await stream.send_all(b"6\r\ndata: \r\n")
                await trio.sleep(0.01)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed.set()

    url, connections = await serve(nursery, endless)
    with trio.fail_after(10):
        async with client(url) as http:
            async with http.stream("POST", "/x", content=b"{}") as response:
                async for _ in response.aiter_raw():
                    break
            await closed.wait()
            async with http.stream("POST", "/x", content=b"{}") as response:
                async for _ in response.aiter_raw():
                    break
    assert len(connections) == 2


@pytest.mark.realtime
async def test_content_length_and_read_until_close_bodies(nursery: trio.Nursery) -> None:
    async def server(stream: trio.SocketStream, number: int) -> None:
        head = await read_request(stream)
        if b"/sized" in head:
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            await read_request(stream)
        else:
            await stream.send_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close")
            await stream.aclose()

    url, _ = await serve(nursery, server)
    with trio.fail_after(10):
        async with client(url) as http:
            assert (await http.get("/sized")).content == b"hello"
            assert (await http.get("/close")).content == b"until close"


@pytest.mark.realtime
async def test_a_stale_idle_connection_is_replaced(nursery: trio.Nursery) -> None:
    async def one_shot(stream: trio.SocketStream, number: int) -> None:
        await read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await stream.aclose()  # keep-alive promised, then closed while idle

    url, connections = await serve(nursery, one_shot)
    with trio.fail_after(10):
        async with client(url) as http:
            assert (await http.get("/a")).content == b"ok"
            await trio.sleep(0.05)
            assert (await http.get("/b")).content == b"ok"
    assert len(connections) == 2


@pytest.mark.realtime
async def test_errors_are_httpx_errors(nursery: trio.Nursery) -> None:
    async def broken(stream: trio.SocketStream, number: int) -> None:
        await read_request(stream)
        if number == 1:
            await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
            await stream.aclose()
        else:
            await trio.sleep(5)

    url, _ = await serve(nursery, broken)
    with trio.fail_after(10):
        async with client(url, read_s=0.2) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.get("/truncated")
            with pytest.raises(httpx.ReadTimeout):
                await http.get("/silent")
        async with client("http://127.0.0.1:1") as http:
            with pytest.raises(httpx.ConnectError):
                await http.get("/")
