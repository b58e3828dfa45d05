"""The engine transport: keep-alive reuse, early close, every broken engine answer as httpx's
error with its pool slot given back; the stream requests the engine client frames for it."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from functools import partial

import httpx
import pytest
import trio

from narwhal.config import EngineConfig, UpstreamConfig
from narwhal.sockets import SocketStream
from narwhal.upstream.client import EngineClient
from narwhal.upstream.transport import EngineTransport, _Connection, _ReadWatch

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


GOOD = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
OK_HEAD = b"HTTP/1.1 200 OK\r\n"
CHUNKED = OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"

# Each shape: what a broken engine sends after reading the request, then it closes (or, for
# "hang", sends nothing more and keeps the connection open).
BROKEN: dict[str, tuple[bytes, bool, type[httpx.HTTPError]]] = {
    "garbage status line": (b"garbage\r\n\r\n", False, httpx.RemoteProtocolError),
    "status not a number": (b"HTTP/1.1 abc OK\r\n\r\n", False, httpx.RemoteProtocolError),
    "status of four digits": (b"HTTP/1.1 2000 OK\r\n\r\n", False, httpx.RemoteProtocolError),
    "HTTP/2 status line": (b"HTTP/2 200 OK\r\n\r\n", False, httpx.RemoteProtocolError),
    "header without colon": (OK_HEAD + b"no colon\r\n\r\n", False, httpx.RemoteProtocolError),
    "space in header name": (OK_HEAD + b"bad name: x\r\n\r\n", False, httpx.RemoteProtocolError),
    "content-length abc": (
        OK_HEAD + b"content-length: abc\r\n\r\nhello",
        True,
        httpx.RemoteProtocolError,
    ),
    "negative content-length": (
        OK_HEAD + b"content-length: -5\r\n\r\nhello",
        True,
        httpx.RemoteProtocolError,
    ),
    "conflicting content-lengths": (
        OK_HEAD + b"content-length: 5\r\ncontent-length: 6\r\n\r\nhello",
        True,
        httpx.RemoteProtocolError,
    ),
    "unknown transfer-encoding": (
        OK_HEAD + b"transfer-encoding: gzip\r\n\r\nhello",
        True,
        httpx.RemoteProtocolError,
    ),
    "oversized head": (
        OK_HEAD + b"x-big: " + b"a" * 100_000 + b"\r\n\r\n",
        True,
        httpx.RemoteProtocolError,
    ),
    "10 MB head line": (OK_HEAD + b"x" * 10_000_000, True, httpx.RemoteProtocolError),
    "bad chunk size": (CHUNKED + b"zz\r\nhello\r\n", True, httpx.RemoteProtocolError),
    "0x chunk size": (CHUNKED + b"0x5\r\nhello\r\n", True, httpx.RemoteProtocolError),
    "negative chunk size": (CHUNKED + b"-5\r\nhello\r\n", True, httpx.RemoteProtocolError),
    "underscore chunk size": (CHUNKED + b"1_0\r\n", True, httpx.RemoteProtocolError),
    "chunk without CRLF": (CHUNKED + b"3\r\nabcXY", True, httpx.RemoteProtocolError),
    "10 MB chunk size line": (CHUNKED + b"1" * 10_000_000, True, httpx.RemoteProtocolError),
    "10 MB trailers": (
        CHUNKED + b"0\r\nx-trailer: " + b"a" * 10_000_000,
        True,
        httpx.RemoteProtocolError,
    ),
    "closed before answering": (b"", False, httpx.RemoteProtocolError),
    "closed mid-head": (OK_HEAD + b"content-le", False, httpx.RemoteProtocolError),
    "closed mid-body": (
        OK_HEAD + b"content-length: 10\r\n\r\nabc",
        False,
        httpx.RemoteProtocolError,
    ),
    "closed mid-chunk": (CHUNKED + b"5\r\nab", False, httpx.RemoteProtocolError),
    "closed before last chunk": (CHUNKED + b"2\r\nab\r\n", False, httpx.RemoteProtocolError),
    "never answers": (b"", True, httpx.ReadTimeout),
    "head then stalls": (OK_HEAD + b"content-length: 10\r\n\r\nabc", True, httpx.ReadTimeout),
    "half a head then stalls": (OK_HEAD + b"content-le", True, httpx.ReadTimeout),
    "chunked then stalls": (CHUNKED + b"2\r\nab\r\n", True, httpx.ReadTimeout),
}


async def broken_then_good(
    shape: bytes, hang: bool, stream: trio.SocketStream, number: int
) -> None:
    """The first connection gets the broken shape; later ones answer well, kept alive."""
    if number > 1:
        while await read_request(stream):
            await stream.send_all(GOOD)
        return
    await read_request(stream)
    if shape:
        await stream.send_all(shape)
    if hang:
        await trio.sleep_forever()
    await stream.aclose()


@pytest.mark.realtime
@pytest.mark.parametrize("name", list(BROKEN))
async def test_a_broken_answer_is_an_httpx_error_and_gives_its_slot_back(
    nursery: trio.Nursery, name: str
) -> None:
    shape, hang, error = BROKEN[name]
    url, connections = await serve(nursery, partial(broken_then_good, shape, hang))
    timeout = httpx.Timeout(connect=2.0, read=0.3, write=2.0, pool=0.5)
    transport = EngineTransport(max_connections=1, timeout=timeout)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=url, transport=transport) as http:
            with pytest.raises(error):
                await http.post("/v1/chat/completions", content=b"{}")
            # the one slot is free again (a leak would be a PoolTimeout), and the broken
            # connection was not pooled
            for _ in range(3):
                response = await http.post("/v1/chat/completions", content=b"{}")
                assert response.status_code == 200 and response.content == b"ok"
    assert len(connections) == 2


@pytest.mark.realtime
@pytest.mark.parametrize("name", ["content-length abc", "bad chunk size", "closed mid-chunk"])
async def test_a_broken_stream_read_by_hand_gives_its_slot_back(
    nursery: trio.Nursery, name: str
) -> None:
    shape, hang, error = BROKEN[name]
    url, _ = await serve(nursery, partial(broken_then_good, shape, hang))
    timeout = httpx.Timeout(connect=2.0, read=0.3, write=2.0, pool=0.5)
    transport = EngineTransport(max_connections=1, timeout=timeout)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=url, transport=transport) as http:
            with pytest.raises(error):
                async with http.stream("POST", "/x", content=b"{}") as response:
                    async for _ in response.aiter_raw():
                        pass
            assert (await http.get("/good")).content == b"ok"


@pytest.mark.realtime
async def test_a_cancelled_read_gives_its_slot_back(nursery: trio.Nursery) -> None:
    url, connections = await serve(
        nursery, partial(broken_then_good, CHUNKED + b"2\r\nab\r\n", True)
    )
    timeout = httpx.Timeout(connect=2.0, read=5.0, write=2.0, pool=0.5)
    transport = EngineTransport(max_connections=1, timeout=timeout)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=url, transport=transport) as http:
            with trio.move_on_after(0.2) as scope:
                await http.post("/x", content=b"{}")
            assert scope.cancelled_caught
            assert (await http.get("/good")).content == b"ok"
    assert len(connections) == 2


@pytest.mark.realtime
async def test_answers_that_are_well_formed_if_unusual(nursery: trio.Nursery) -> None:
    answers = {
        b"/http10": b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: x\n\n",
        b"/continue": b"HTTP/1.1 100 Continue\r\n\r\n" + GOOD,
        b"/lf-only": b"HTTP/1.1 200 OK\ncontent-length: 2\n\nok",
        b"/extensions": CHUNKED + b"2;name=value \r\nok\r\n0\r\n\r\n",
        b"/trailers": CHUNKED + b"2\r\nok\r\n0\r\nx-t: 1\r\nx-u: 2\r\n\r\n",
        b"/duplicate-equal-lengths": OK_HEAD + b"content-length: 2\r\ncontent-length: 2\r\n\r\nok",
        b"/leftover": OK_HEAD + b"content-length: 2\r\n\r\nokEXTRA",
        b"/no-content": b"HTTP/1.1 204 No Content\r\n\r\n",
    }

    async def server(stream: trio.SocketStream, number: int) -> None:
        while head := await read_request(stream):
            target = head.split(b" ")[1]
            await stream.send_all(answers[target])
            if target in (b"/http10", b"/leftover"):
                await stream.aclose()
                return

    url, connections = await serve(nursery, server)
    with trio.fail_after(10):
        async with client(url) as http:
            for target in answers:
                response = await http.get(target.decode())
                expected = b"data: x\n\n" if target == b"/http10" else b"ok"
                if target == b"/no-content":
                    assert response.status_code == 204 and response.content == b""
                else:
                    assert response.content == expected, target
    # the HTTP/1.0 answer and the one with bytes after its end were not pooled
    assert len(connections) == 3


async def _recorded_requests(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, str]]
) -> list[tuple[list[bytes], bytes]]:
    """Open one stream per set of headers in ``calls`` through an :class:`EngineClient` with an
    API key; return each request's head lines and body as the engine read them."""
    seen: list[tuple[list[bytes], bytes]] = []

    async def recording_server(stream: trio.SocketStream, number: int) -> None:
        data = b""
        while True:
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                data += chunk
            head, _, data = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            length = next(
                int(line.partition(b":")[2])
                for line in lines
                if line.lower().startswith(b"content-length:")
            )
            while len(data) < length:
                data += await stream.receive_some(65536)
            seen.append((lines, data[:length]))
            data = data[length:]
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 14\r\n\r\n"
                b"data: [DONE]\n\n"
            )

    url, _ = await serve(nursery, recording_server)
    monkeypatch.setenv("NARWHAL_TEST_KEY", "sk-test")
    engine = EngineConfig(name="gpu-7", url=url, api_key_env="NARWHAL_TEST_KEY")
    upstream = UpstreamConfig(connect_timeout_s=2.0, read_timeout_s=5.0, max_connections=2)
    engine_client = EngineClient(engine, upstream)
    try:
        for number, headers in enumerate(calls):
            if number == 1:
                engine_client.set_fence(7)
            body = b'{"prompt": "%d"}' % number
            async with await engine_client.open_stream(
                "completions", body, ids_required=False, headers=headers
            ) as stream:
                assert type(await stream.next_event()).__name__ == "DoneEvent"
    finally:
        await engine_client.aclose()
    return seen


@pytest.mark.realtime
async def test_a_stream_request_carries_the_client_headers_ours_and_the_callers(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head made once per route (the key, httpx's defaults, ours) with the caller's headers
    and the length of each body; a fence set later is in every request after it; a caller's
    header the head already has replaces it (through httpx's request)."""
    calls = [{"x-request-id": "r-1"}, {"x-request-id": "r-2"}, {"accept": "application/json"}]
    seen = await _recorded_requests(nursery, monkeypatch, calls)
    assert [body for _, body in seen] == [b'{"prompt": "%d"}' % n for n in range(3)]
    heads = [
        (
            lines[0],
            {line.partition(b":")[0].lower(): line.partition(b": ")[2] for line in lines[1:]},
            len(lines),
        )
        for lines, _ in seen
    ]
    for number, (request_line, fields, count) in enumerate(heads):
        assert request_line == b"POST /v1/completions HTTP/1.1"
        assert count == len(fields) + 1  # no header twice
        assert fields[b"authorization"] == b"Bearer sk-test"
        assert fields[b"host"].startswith(b"127.0.0.1:")
        assert fields[b"content-type"] == b"application/json"
        assert fields[b"content-length"] == b"%d" % len(seen[number][1])
        assert (b"x-narwhal-fence" in fields) == (number >= 1)
    assert heads[0][1][b"accept"] == b"text/event-stream"
    assert heads[0][1][b"x-request-id"] == b"r-1"
    assert heads[1][1][b"x-request-id"] == b"r-2"
    assert heads[1][1][b"x-narwhal-fence"] == b"7"
    assert heads[2][1][b"accept"] == b"application/json"
    assert heads[2][1][b"x-narwhal-fence"] == b"7"


async def test_reads_that_wait_time_out_at_their_own_deadlines_exactly(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Virtual time: each stream's silence is timed from its own read (one task keeps every
    deadline); a stream whose gaps stay under the read timeout is never cut; a connection
    that timed out is not reused."""
    gaps = {1: [], 2: [3.0], 3: [4.9, 4.9, 4.9]}  # after the first chunk; then 1, 2 stall

    async def engine(stream: trio.SocketStream, number: int) -> None:
        await read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
        for gap in gaps[number]:
            await trio.sleep(gap)
            await stream.send_all(b"2\r\ncd\r\n")
        if number == 3:
            await stream.send_all(b"0\r\n\r\n")
        await trio.sleep_forever()

    url, connections = await serve(nursery, engine)
    outcomes: dict[int, tuple[str, object]] = {}

    async def read(http: httpx.AsyncClient, number: int, start: float) -> None:
        await trio.sleep_until(start)
        try:
            async with http.stream("GET", f"/{number}") as response:
                async for _ in response.aiter_raw():
                    pass
        except httpx.ReadTimeout:
            outcomes[number] = ("timed out", trio.current_time() - t0)
        else:
            outcomes[number] = ("complete", trio.current_time() - t0)

    t0 = trio.current_time()
    with trio.fail_after(60):  # virtual seconds
        async with client(url, read_s=5.0) as http, trio.open_nursery() as readers:
            # One at a time onto a fresh connection each: connection n serves stream n.
            for number, start in ((1, 0.0), (2, 1.0), (3, 2.0)):
                readers.start_soon(read, http, number, t0 + start)
                await trio.sleep_until(t0 + start + 0.001)
    assert outcomes == {
        1: ("timed out", pytest.approx(5.0)),
        2: ("timed out", pytest.approx(1.0 + 3.0 + 5.0)),
        3: ("complete", pytest.approx(2.0 + 3 * 4.9)),
    }
    assert len(connections) == 3


async def test_a_read_with_an_earlier_deadline_than_the_one_watched_still_times_out_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The watch sleeps until the earliest deadline: a later read with a shorter timeout wakes
    it to sleep less."""
    watch = _ReadWatch()
    pairs = [socket.socketpair() for _ in range(2)]
    long, short = (_Connection(SocketStream(ours), watch) for ours, _ in pairs)
    request = httpx.Request("GET", "http://engine/")
    ended: dict[str, float] = {}
    t0 = trio.current_time()

    async def read(name: str, connection: _Connection, read_s: float) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await connection.receive(read_s, request)
        ended[name] = trio.current_time() - t0

    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as readers:
                readers.start_soon(read, "long", long, 10.0)
                await trio.sleep(1.0)
                readers.start_soon(read, "short", short, 2.0)
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
    assert ended == {"long": pytest.approx(10.0), "short": pytest.approx(3.0)}
