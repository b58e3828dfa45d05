"""The serving layer (narwhal.web.http11, narwhal.server) over real sockets: what a client's bytes
can and cannot do, the request-head timeout, and the graceful shutdown. Real clock, bounded.

Responses are parsed with h11 as a client, so a response that is cut or badly framed fails the
test rather than passing by accident.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import h11
import httpx
import pytest
import trio

from narwhal.config import Config, ControlConfig, EngineConfig, MonitoringConfig, ServingConfig
from narwhal.demo import demo_transports
from narwhal.server import CLOSE_GRACE_S, CUT_GRACE_S, serve
from tests.support import sse_payloads, wait_ready

pytestmark = pytest.mark.realtime

MODEL = "llama-3.1-8b-instruct"
LIMIT = 4096
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}).encode()


@attrs.define
class Served:
    """A router served on a loopback port, and how to stop it gracefully."""

    url: str
    port: int
    stop: trio.Event
    stopped: trio.Event
    stopped_at: float | None = None

    async def shut_down(self) -> float:
        """Trigger the graceful shutdown; the seconds until ``serve`` returned."""
        began = trio.current_time()
        self.stop.set()
        await self.stopped.wait()
        assert self.stopped_at is not None
        return self.stopped_at - began


def config(**serving: Any) -> Config:
    control = serving.pop("control", ControlConfig())
    return Config(
        serving=ServingConfig(model=MODEL, max_request_bytes=LIMIT, **serving),
        engines=(
            EngineConfig(name="sim-a", url="http://sim-a.invalid"),
            EngineConfig(name="sim-b", url="http://sim-b.invalid"),
        ),
        control=control,
        # The simulated engines run in the router's own loop, on the real clock: on a busy
        # machine their steps are the loop's lag, and these tests are not about the watchdog
        # (tests/control/test_watchdog.py is).
        monitoring=MonitoringConfig(lag_sustain_s=3600.0),
    )


async def start(nursery: trio.Nursery, settings: Config, *, time_scale: float = 0.05) -> Served:
    stop, stopped = trio.Event(), trio.Event()
    transports = demo_transports(settings, time_scale=time_scale)

    async def run(task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            await serve(
                settings,
                bind="127.0.0.1:0",
                transports=transports,
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )
        finally:
            served.stopped_at = trio.current_time()
            stopped.set()

    urls = await nursery.start(run)
    served = Served(urls[0], int(urls[0].rpartition(":")[2]), stop, stopped)
    await wait_ready(served.url)
    return served


@pytest.fixture
async def router(nursery: trio.Nursery) -> AsyncIterator[Served]:
    yield await start(nursery, config())


# -- raw sockets ----------------------------------------------------------------------------------


@attrs.frozen
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The envelope's ``error``, checked: all four keys, a string code."""
        error: dict[str, Any] = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["code"], str), error
        return error


@attrs.frozen
class Exchange:
    answers: list[Answer]
    closed: bool  # the server closed the connection (rather than the read timing out)
    raw: bytes


def parse(raw: bytes, *, closed: bool, requests: int = 1) -> list[Answer]:
    """Every response in ``raw``, read by h11 as a client that sent ``requests`` requests."""
    client = h11.Connection(h11.CLIENT)
    answers: list[Answer] = []
    client.receive_data(raw)
    if closed:
        client.receive_data(b"")
    for _ in range(requests):
        if client.our_state is not h11.IDLE:
            break
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            try:
                event = client.next_event()
            except h11.RemoteProtocolError:  # closed before (or within) a response
                return answers
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return answers
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {name.lower(): value for name, value in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                answers.append(Answer(status, headers, body))
                break
        if client.our_state is h11.DONE and client.their_state is h11.DONE:
            client.start_next_cycle()
    return answers


async def exchange(
    port: int,
    pieces: Sequence[bytes],
    *,
    gap_s: float = 0.0,
    half_close: bool = False,
    read_s: float = 5.0,
    requests: int = 1,
) -> Exchange:
    """Send ``pieces`` (``gap_s`` apart), reading until the server closes or ``read_s`` ends."""
    received = bytearray()
    closed = False
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream, trio.open_nursery() as nursery:

        async def write() -> None:
            try:
                for index, piece in enumerate(pieces):
                    if index and gap_s:
                        await trio.sleep(gap_s)
                    await stream.send_all(piece)
                if half_close:
                    await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        nursery.start_soon(write)
        with trio.move_on_after(read_s + gap_s * len(pieces)):
            try:
                while data := await stream.receive_some(65536):
                    received.extend(data)
            except trio.BrokenResourceError:
                pass
            closed = True
        nursery.cancel_scope.cancel()
    raw = bytes(received)
    return Exchange(parse(raw, closed=closed, requests=requests), closed, raw)


def request(
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    line: bytes = b"POST /v1/chat/completions HTTP/1.1",
    host: bool = True,
) -> bytes:
    head = [line, *([b"Host: 127.0.0.1"] if host else [])]
    head.extend(f"{name}: {value}".encode() for name, value in headers)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def still_serving(served: Served) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        with trio.fail_after(15):
            health = await client.get(f"{served.url}/health")
            chat = await client.post(
                f"{served.url}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "still there?"}],
                    "narwhal_sim": {"output_tokens": 3},
                },
            )
    assert health.status_code == 200
    assert chat.status_code == 200, chat.text


async def header_timeouts(served: Served) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{served.url}/metrics")).text
    for line in text.splitlines():
        if line.startswith('narwhal_client_timeouts_total{phase="headers"}'):
            return float(line.split()[-1])
    raise AssertionError("no narwhal_client_timeouts_total{phase=headers} sample")


# -- item 1: no byte sequence ends the process ----------------------------------------------------


async def test_content_length_ten_bytes_short_then_close_a_hundred_times(router: Served) -> None:
    """Issue 7 item 1 exactly: this ended ``narwhal serve`` within about five requests
    (Hypercorn #203: h11 "Got data when expecting EOF", then a BusyResourceError)."""
    raw = request(
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(CHAT) - 10)),
            ("Connection", "close"),
        ],
        CHAT,
    )
    with trio.fail_after(60):
        for _ in range(100):
            result = await exchange(router.port, [raw])
            assert result.closed
            # The first Content-Length bytes are the request (RFC 9112 9.6: nothing after a
            # request that asked to close is read): a cut JSON body, refused by the router.
            [answer] = result.answers
            assert answer.status == 400, answer
            assert answer.error()["code"] == "invalid_request"
        await still_serving(router)


# -- item 8: framing errors get the envelope ------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        pytest.param(request([("Content-Length", "-5")], b"{}"), 400, id="negative length"),
        pytest.param(
            request([("Content-Length", "2"), ("Content-Length", "3")], b"{}x"),
            400,
            id="conflicting lengths",
        ),
        pytest.param(request([("Content-Length", "abc")], b"{}"), 400, id="length not a number"),
        pytest.param(
            request([("Transfer-Encoding", "chunked")], b"zz\r\n{}\r\n0\r\n\r\n"),
            400,
            id="bad chunk size",
        ),
        pytest.param(
            request([("Content-Length", "2"), ("Transfer-Encoding", "chunked")], b"2\r\n{}\r\n"),
            400,
            id="length and chunked",
        ),
        # Whole under either reading: which one ends the body decides where the next request
        # begins (smuggling, RFC 9112 6.3). It was served, and the connection kept.
        pytest.param(
            request(
                [("Content-Length", "12"), ("Transfer-Encoding", "chunked")],
                b"2\r\n{}\r\n0\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
            ),
            400,
            id="length and whole chunked",
        ),
        pytest.param(b"GARBAGE\r\n\r\n", 400, id="garbage request line"),
        pytest.param(request([("Content-Length", "2")], b"{}", host=False), 400, id="no host"),
        pytest.param(request(line=b"GET /h\xc3\xa4 HTTP/1.1"), 400, id="non-ascii target"),
        pytest.param(request(line=b"GET /health HTTP/9.9"), 505, id="unknown version"),
        pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, id="http/2 prior knowledge"),
        pytest.param(request([("X-Big", "a" * 70_000)]), 431, id="oversized head"),
    ],
)
async def test_framing_errors_get_the_envelope_and_a_close(
    router: Served, raw: bytes, status: int
) -> None:
    with trio.fail_after(20):
        result = await exchange(router.port, [raw], half_close=True)
    assert result.closed, result
    [answer] = result.answers
    assert answer.status == status, answer
    assert answer.headers[b"connection"] == b"close"
    error = answer.error()
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_request",
        None,
    )
    assert "Error(" not in error["message"], error
    # h11's own words, without the Python reprs of the client's bytes that they quote.
    assert "b'" not in error["message"] and "bytearray" not in error["message"], error
    await still_serving(router)


async def test_a_body_the_server_cannot_read_is_counted_invalid_not_cancelled(
    router: Served,
) -> None:
    """A malformed chunk in a completion request's body: the server answers the 400 itself,
    and the request is counted ``invalid_requests`` (it was ``cancelled``: the application saw
    the client go away)."""
    raw = request([("Transfer-Encoding", "chunked")], b"2\r\n{}\r\n" + b"zz\r\n{}\r\n0\r\n\r\n")
    async with httpx.AsyncClient() as client:
        before = await _counters(client, router)
        with trio.fail_after(20):
            result = await exchange(router.port, [raw], half_close=True)
            [answer] = result.answers
            assert answer.status == 400, answer
            assert answer.error()["message"] == "Malformed HTTP request: illegal chunk header."
            while (after := await _counters(client, router))["in_flight"]:  # noqa: ASYNC110
                await trio.sleep(0.01)
    changed = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    assert changed == {"offered": 1, "unsized_offered": 1, "invalid_requests": 1}, changed
    await still_serving(router)


async def test_identical_duplicate_lengths_are_one_length(router: Served) -> None:
    """RFC 9110 8.6 lets a recipient take identical duplicates as one value (h11 does)."""
    raw = request(
        [
            ("Content-Length", str(len(CHAT))),
            ("Content-Length", str(len(CHAT))),
            ("Connection", "close"),
        ],
        CHAT,
    ).replace(b'"Hello"', b'"Hi!!!"')
    result = await exchange(router.port, [raw])
    assert [answer.status for answer in result.answers] == [200], result.raw[:300]


async def test_an_http_1_0_post_over_the_limit_without_length_is_a_413(router: Served) -> None:
    """Its body runs to the end of the connection; the byte limit applies as it arrives."""
    body = b'{"model": "' + b"x" * (LIMIT * 4) + b'"}'
    raw = b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n\r\n" + body
    with trio.fail_after(20):
        result = await exchange(router.port, [raw], half_close=True)
    [answer] = result.answers
    assert answer.status == 413, answer
    assert answer.error()["code"] == "request_too_large"
    await still_serving(router)


async def test_an_http_1_0_post_within_the_limit_is_served(router: Served) -> None:
    raw = b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n\r\n" + CHAT
    with trio.fail_after(20):
        result = await exchange(router.port, [raw], half_close=True)
    [answer] = result.answers
    assert answer.status == 200, answer
    assert json.loads(answer.body)["object"] == "chat.completion"


async def test_an_absolute_form_target_is_its_path(router: Served) -> None:
    raw = request(
        [("Connection", "close")], line=b"GET http://router.example/health HTTP/1.1", host=True
    )
    result = await exchange(router.port, [raw])
    assert [answer.status for answer in result.answers] == [200]


@pytest.mark.parametrize(
    "extra",
    [b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n", b""],
    ids=["valid handshake", "invalid handshake"],
)
async def test_a_websocket_upgrade_is_served_as_plain_http(router: Served, extra: bytes) -> None:
    """Off the WebSocket routes, Hypercorn's WebSocket stream (empty 400s, its issue #225 on
    trailing data) is never entered: the upgrade is a plain request."""
    raw = (
        b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\n" + extra + b"\r\nx"
    )
    result = await exchange(router.port, [raw], half_close=True)
    [answer] = result.answers
    assert answer.status == 404, answer
    assert answer.error()["code"] == "not_found"
    await still_serving(router)


@pytest.mark.parametrize(
    ("trailing", "refused"),
    [
        (b"", {(403, "admin_disabled")}),
        # The application's refusal, or the server's to the early bytes: whichever began first.
        (b"x", {(403, "admin_disabled"), (400, "invalid_request")}),
    ],
    ids=["alone", "bytes after the head"],
)
async def test_a_refused_event_feed_upgrade_is_an_envelope(
    router: Served, trailing: bytes, refused: set[tuple[int, str]]
) -> None:
    """The event feed is the one WebSocket route. An upgrade it refuses (no admin token is set
    here) is the envelope before any upgrade; bytes sent before the upgrade was accepted
    (Hypercorn's own answer: an empty 400) are one whole envelope, the application's refusal
    or a 400; a malformed handshake is a 400 envelope."""
    head = b"GET /admin/events HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    valid = b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n"
    for extra, expected in ((valid, refused), (b"", {(400, "invalid_request")})):
        result = await exchange(router.port, [head + extra + b"\r\n" + trailing], read_s=2)
        [answer] = result.answers
        assert (answer.status, answer.error()["code"]) in expected, answer
    await still_serving(router)


async def test_a_client_that_closes_after_its_request_is_gone_at_once(router: Served) -> None:
    """The end of the connection is the client going away (but for an HTTP/1.0 body that it
    ends): the request is cancelled at once, the engine stops, nothing is held for nobody."""
    raw = _long_stream()
    async with httpx.AsyncClient() as client:
        cancelled = (await _counters(client, router))["cancelled"]
        with trio.fail_after(20):
            await exchange(router.port, [raw], half_close=True, read_s=0.5)
            while (now := await _counters(client, router))["cancelled"] == cancelled:  # noqa: ASYNC110
                await trio.sleep(0.01)
    assert now["in_flight"] == 0 and now["failed"] == 0
    await still_serving(router)


async def test_a_client_gone_while_its_answer_is_all_in_hand_is_cancelled_at_once(
    router: Served,
) -> None:
    """A client that takes the head of a long stream and leaves (a reset), while the engine's
    whole answer is already in hand: the relay stops at its first write that finds the
    connection broken, and the request is ``cancelled``. (It went on through the rest of the
    answer, written nowhere, before its next checkpoint, and counted it ``completed``: a
    demo's 60 such clients held its loop for 12 s.)"""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "logprobs": True,
            "top_logprobs": 5,
            "narwhal_sim": {"output_tokens": 3_000, "itl_s": 0.0},
        }
    ).encode()
    raw = request([("Content-Length", str(len(body))), ("Content-Type", "application/json")], body)
    async with httpx.AsyncClient() as client:
        before = await _counters(client, router)
        with trio.fail_after(20):
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            await sock.connect(("127.0.0.1", router.port))
            with sock:
                await sock.send(raw)
                assert (await sock.recv(64)).startswith(b"HTTP/1.1 200")
                # Closed with unread bytes, and lingering for nothing: a reset.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            while (after := await _counters(client, router))["in_flight"]:  # noqa: ASYNC110
                await trio.sleep(0.01)
    changed = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    assert changed == {"offered": 1, "cancelled": 1}, changed
    await still_serving(router)


def _long_stream() -> bytes:
    """A streamed chat request that runs far longer than a test: long in time, short in
    tokens (a long answer's tokens are generated before its first byte, in the router's loop
    here)."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "narwhal_sim": {"output_tokens": 1_000, "itl_s": 1.0},
        }
    ).encode()
    return request([("Content-Length", str(len(body))), ("Content-Type", "application/json")], body)


async def _counters(client: httpx.AsyncClient, served: Served) -> dict[str, int]:
    counters: dict[str, int] = (await client.get(f"{served.url}/ready")).json()["counters"]
    return counters


def _tasks_running(name: str) -> int:
    """How many tasks of this Trio run are running a coroutine called ``name``."""
    found, todo = 0, [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        found += task.coro.cr_code.co_qualname == name
        todo.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return found


async def test_a_client_gone_mid_stream_is_noticed_without_a_watching_task(
    router: Served,
) -> None:
    """Narwhal's server tells the request of the connection's end: no task per request waits
    for ``http.disconnect``, and leaving mid-stream still cancels at once."""
    async with httpx.AsyncClient() as client:
        cancelled = (await _counters(client, router))["cancelled"]
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream("127.0.0.1", router.port)
            async with stream:
                await stream.send_all(_long_stream())
                received = b""
                while b"data: " not in received:  # the stream runs
                    received += await stream.receive_some(65536)
                assert (await _counters(client, router))["in_flight"] == 1
                assert _tasks_running("Client.watch") == 0
            while (now := await _counters(client, router))["cancelled"] == cancelled:  # noqa: ASYNC110
                await trio.sleep(0.01)
    assert now["in_flight"] == 0 and now["failed"] == 0
    await still_serving(router)


async def test_pipelined_requests_after_a_close_are_not_read(router: Served) -> None:
    one = request(line=b"GET /health HTTP/1.1").replace(
        b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"
    )
    result = await exchange(router.port, [one * 3], requests=3)
    assert result.closed
    assert [answer.status for answer in result.answers] == [200]


# -- item 9: request heads that never end ---------------------------------------------------------


async def test_slowloris_heads_get_a_408_at_the_header_timeout(nursery: trio.Nursery) -> None:
    timeout = 0.5
    served = await start(nursery, config(header_timeout_s=timeout))
    head = request([("Content-Type", "application/json"), ("Content-Length", "2")], b"{}")
    pieces = [head[i : i + 1] for i in range(len(head))]  # the whole head would take ~10 s
    ended_after: list[float] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as attackers:

            async def attack() -> None:
                began = trio.current_time()
                result = await exchange(served.port, pieces, gap_s=0.1, read_s=0)
                ended_after.append(trio.current_time() - began)
                assert result.closed
                [answer] = result.answers
                assert answer.status == 408, answer
                assert answer.error()["code"] == "request_header_timeout"

            for _ in range(20):
                attackers.start_soon(attack)
            await trio.sleep(timeout / 2)
            await still_serving(served)  # served while the heads dribble
    print(f"slowloris: 20 connections closed {min(ended_after):.3f}-{max(ended_after):.3f} s")
    assert max(ended_after) < timeout + 1.5, ended_after
    assert await header_timeouts(served) == 20
    await still_serving(served)


async def test_a_silent_new_connection_is_closed_at_the_header_timeout(
    nursery: trio.Nursery,
) -> None:
    timeout = 0.3
    served = await start(nursery, config(header_timeout_s=timeout))
    began = trio.current_time()
    result = await exchange(served.port, [], read_s=10)
    assert result.closed and result.raw == b"", result  # nothing begun: nothing to answer
    assert trio.current_time() - began < timeout + 1.5
    assert await header_timeouts(served) == 1


async def test_an_idle_keep_alive_connection_closes_quietly(nursery: trio.Nursery) -> None:
    """From the end of a response the next head has the timeout too; an idle connection's close
    is routine: no 408, not counted."""
    timeout = 0.3
    served = await start(nursery, config(header_timeout_s=timeout))
    began = trio.current_time()
    result = await exchange(served.port, [request(line=b"GET /health HTTP/1.1")], read_s=10)
    assert result.closed
    assert [answer.status for answer in result.answers] == [200]
    assert result.raw.count(b"HTTP/1.1") == 1
    assert trio.current_time() - began < timeout + 1.5
    assert await header_timeouts(served) == 0


# -- item 6: shutdown ------------------------------------------------------------------------


async def test_shutdown_with_an_idle_pooled_connection_is_prompt(nursery: trio.Nursery) -> None:
    """Hypercorn never closed an idle keep-alive connection (its idle timer was started from a
    task Quart cancels), so shutdown waited out the whole drain deadline."""
    served = await start(nursery, config(control=ControlConfig(drain_deadline_s=30)))
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{served.url}/health")).status_code == 200
        with trio.fail_after(10):
            took = await served.shut_down()
    print(f"shutdown with an idle pooled connection: {took:.3f} s")
    assert took < 5


async def stream_chat(url: str, output_tokens: int, started: Callable[[], None]) -> list[str]:
    """One streamed chat; calls ``started`` at its first event; returns its SSE payloads."""
    body = {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "a long story"}],
        "narwhal_sim": {"output_tokens": output_tokens},
    }
    text = ""
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for piece in response.aiter_text():
            if not text:
                started()
            text += piece
    return sse_payloads(text)


async def run_streams(
    served: Served, count: int, output_tokens: int, then: Callable[[], Awaitable[None]]
) -> list[list[str]]:
    """``count`` streams; once each has begun, ``then()``; every stream's payloads."""
    results: list[list[str]] = []
    begun = 0
    all_begun = trio.Event()

    def started() -> None:
        nonlocal begun
        begun += 1
        if begun == count:
            all_begun.set()

    async def one() -> None:
        results.append(await stream_chat(served.url, output_tokens, started))

    async with trio.open_nursery() as clients:
        for _ in range(count):
            clients.start_soon(one)
        await all_begun.wait()
        await then()
    return results


async def test_shutdown_ends_running_streams_in_band_at_the_deadline(
    nursery: trio.Nursery,
) -> None:
    deadline = 0.5
    served = await start(
        nursery, config(control=ControlConfig(drain_deadline_s=deadline)), time_scale=1.0
    )
    took: list[float] = []

    async def shut_down() -> None:
        began = trio.current_time()
        served.stop.set()
        async with httpx.AsyncClient() as client:  # still accepted while draining
            ready = await client.get(f"{served.url}/ready")
            refused = await client.post(f"{served.url}/v1/chat/completions", content=CHAT)
        assert ready.status_code == 503 and ready.json()["state"] == "draining", ready.text
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "router_draining"
        assert refused.headers["connection"] == "close"
        await served.stopped.wait()
        took.append(trio.current_time() - began)

    with trio.fail_after(30):
        results = await run_streams(served, 3, 5000, shut_down)
    print(f"shutdown with 3 running streams, drain deadline {deadline} s: {took[0]:.3f} s")
    assert took[0] < deadline + CUT_GRACE_S + CLOSE_GRACE_S + 2
    for payloads in results:
        assert payloads[-1] == "[DONE]", payloads[-3:]
        error = json.loads(payloads[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert all("error" not in json.loads(p) for p in payloads[:-2])


async def test_streams_that_end_within_the_deadline_complete(nursery: trio.Nursery) -> None:
    served = await start(nursery, config(control=ControlConfig(drain_deadline_s=20)))

    async def shut_down() -> None:
        served.stop.set()

    with trio.fail_after(30):
        results = await run_streams(served, 3, 60, shut_down)
        await served.stopped.wait()
    for payloads in results:
        assert payloads[-1] == "[DONE]"
        assert all("error" not in json.loads(p) for p in payloads[:-1])


async def test_a_client_that_stops_reading_cannot_hold_the_shutdown(
    nursery: trio.Nursery,
) -> None:
    """Writes are shielded from cancellation (a half-written frame would break the framing),
    but the end of the shutdown aborts them."""
    served = await start(nursery, config(control=ControlConfig(drain_deadline_s=0.2)))
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "a long story"}],
            "narwhal_sim": {"output_tokens": 200_000},
        }
    ).encode()
    raw = request([("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body)
    stream = await trio.open_tcp_stream("127.0.0.1", served.port)
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    async with stream:
        await stream.send_all(raw)
        assert (await stream.receive_some(100)).startswith(b"HTTP/1.1 200")
        await trio.sleep(1)  # never read again: the router's writes fill the buffers and block
        with trio.fail_after(20):
            took = await served.shut_down()
    print(f"shutdown with a client that stopped reading: {took:.3f} s")
    assert took < 0.2 + CUT_GRACE_S + CLOSE_GRACE_S + 3


# -- the command line: signals --------------------------------------------------------------------


@attrs.define
class Process:
    process: trio.Process
    output: bytearray = attrs.field(factory=bytearray)
    errors: bytearray = attrs.field(factory=bytearray)

    async def line_with(self, marker: bytes) -> bytes:
        """The first stdout line holding ``marker`` (stderr is collected meanwhile)."""
        assert self.process.stdout is not None
        while True:
            for line in bytes(self.output).splitlines():
                if marker in line:
                    return line
            data = await self.process.stdout.receive_some(4096)
            assert data, f"exited: {self.output!r} {self.errors!r}"
            self.output.extend(data)

    async def collect_errors(self) -> None:
        assert self.process.stderr is not None
        while data := await self.process.stderr.receive_some(4096):
            self.errors.extend(data)


async def spawn(nursery: trio.Nursery, *args: str) -> Process:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "narwhal", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    spawned = Process(process)
    nursery.start_soon(spawned.collect_errors)
    return spawned


@pytest.fixture
async def cli_router(nursery: trio.Nursery, tmp_path: Any) -> AsyncIterator[tuple[Process, str]]:
    """``narwhal serve`` in front of two ``narwhal sim`` processes, on free ports."""
    processes: list[Process] = []
    try:
        engines = []
        for index in range(2):
            sim = await spawn(nursery, "sim", "--bind", "127.0.0.1:0", "--model", MODEL)
            processes.append(sim)
            with trio.fail_after(30):
                line = await sim.line_with(b"http://")
            url = line.decode().rpartition(" at ")[2].strip()
            engines.append(f'[[engines]]\nname = "e{index}"\nurl = "{url}"\n')
        path = tmp_path / "config.toml"
        path.write_text(
            f'[serving]\nmodel = "{MODEL}"\n[control]\ndrain_deadline_s = 30\n' + "".join(engines)
        )
        router = await spawn(nursery, "serve", "--config", str(path), "--bind", "127.0.0.1:0")
        processes.append(router)
        with trio.fail_after(30):
            line = await router.line_with(b"http://")
            url = line.decode().rpartition(" on ")[2].strip()
        await wait_ready(url)
        yield router, url
    finally:
        for spawned in processes:
            if spawned.process.returncode is None:
                spawned.process.kill()
            with trio.CancelScope(shield=True):
                await spawned.process.wait()


async def test_sigusr_is_ignored_and_sighup_drains_as_sigterm_does(
    cli_router: tuple[Process, str],
) -> None:
    """A signal is no abrupt end: SIGUSR1 and SIGUSR2 are said and ignored, and SIGHUP (the
    terminal or a supervisor hung up) begins the graceful shutdown, as SIGTERM does. (Python's
    default for each ended the process at once, status 129 or 138, a running stream cut and
    nothing said.)"""
    router, url = cli_router
    async with httpx.AsyncClient() as client:
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            router.process.send_signal(signum)
            with trio.fail_after(10):
                while f"{signum.name}: ignored".encode() not in router.errors:  # noqa: ASYNC110
                    await trio.sleep(0.02)
            assert (await client.get(f"{url}/ready")).status_code == 200
        router.process.send_signal(signal.SIGHUP)
        with trio.fail_after(15):
            code = await router.process.wait()
    assert code == 0, router.errors
    assert b"SIGHUP: shutting down" in router.errors
    assert b"Traceback" not in router.errors


async def test_narwhal_sim_ignores_sigusr1_and_stops_on_sighup(nursery: trio.Nursery) -> None:
    sim = await spawn(nursery, "sim", "--bind", "127.0.0.1:0", "--model", MODEL)
    try:
        with trio.fail_after(30):
            await sim.line_with(b"http://")
            sim.process.send_signal(signal.SIGUSR1)
            await sim.line_with(b"SIGUSR1: ignored")
            assert sim.process.returncode is None
            sim.process.send_signal(signal.SIGHUP)
            assert await sim.process.wait() == 0, sim.errors
    finally:
        if sim.process.returncode is None:
            sim.process.kill()
        with trio.CancelScope(shield=True):
            await sim.process.wait()


async def test_sigterm_with_an_idle_openai_style_pooled_client_exits_at_once(
    cli_router: tuple[Process, str],
) -> None:
    router, url = cli_router
    async with httpx.AsyncClient() as client:  # keeps its connection pooled, as openai does
        assert (await client.get(f"{url}/health")).status_code == 200
        began = trio.current_time()
        router.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            code = await router.process.wait()
    took = trio.current_time() - began
    print(f"narwhal serve: SIGTERM with an idle pooled connection exited in {took:.3f} s")
    assert code == 0, router.errors
    assert took < 10  # was the whole 30 s drain deadline
    assert b"Traceback" not in router.errors


async def test_two_interrupts_end_running_streams_in_band_and_exit_cleanly(
    cli_router: tuple[Process, str],
) -> None:
    router, url = cli_router
    served = Served(url, 0, trio.Event(), trio.Event())

    async def interrupt_twice() -> None:
        router.process.send_signal(signal.SIGINT)
        with trio.fail_after(10):
            while b"draining" not in router.errors:  # noqa: ASYNC110
                await trio.sleep(0.02)
        router.process.send_signal(signal.SIGINT)

    with trio.fail_after(30):
        results = await run_streams(served, 2, 50_000, interrupt_twice)
        code = await router.process.wait()
    errors = router.errors.decode()
    print(errors)
    assert code == 0, errors
    assert "Traceback" not in errors and "Exceptions from Trio" not in errors
    assert "2 requests still running" in errors
    for payloads in results:
        assert payloads[-1] == "[DONE]"
        assert "error" in json.loads(payloads[-2])
