"""The relay's hot path: a streamed body's parts framed by the serving layer itself
(``narwhal.send_body``), the application queue, and the chunked decoder's whole-chunk path.
Real sockets, bounded."""

from __future__ import annotations

import logging
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig

from narwhal.upstream.transport import ChunkedDecoder
from narwhal.web.client import Client
from narwhal.web.http11 import BODY_EXTENSION, AppTasks, Connections

PARTS = [b"data: {}\n\n", b"data: " + b"x" * 70000 + b"\n\n", b'data: {"a": 1}\n\n']
END = b"data: [DONE]\n\n"


async def _stream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    seen.append(BODY_EXTENSION in scope["extensions"])
    client = Client(scope, receive, send)
    await client.read_body(1 << 20)
    await client.start_stream()
    for part in PARTS:
        await client.write(part)
    await client.write(b"")  # nothing to send: no empty chunk (it would end the body)
    await client.end(END)


seen: list[bool] = []


async def _ask(request: bytes) -> bytes:
    settings = HypercornConfig()
    settings.accesslog = None
    settings.errorlog = logging.getLogger("hypercorn.error")
    connections = Connections(ASGIWrapper(_stream_app), settings, header_timeout_s=10)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, connections.handle, 0)
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request)
            received = bytearray()
            with trio.fail_after(10):
                while data := await stream.receive_some(65536):
                    received.extend(data)
        nursery.cancel_scope.cancel()
    return bytes(received)


@pytest.mark.realtime
async def test_a_streamed_body_framed_by_the_serving_layer_reads_whole_as_chunks() -> None:
    seen.clear()
    raw = await _ask(
        b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert seen == [True]
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/x", headers=[("host", "a")]))
    client.receive_data(raw)
    client.receive_data(b"")
    body = b""
    chunks = 0
    while True:
        event = client.next_event()
        if isinstance(event, h11.Response):
            assert event.status_code == 200
            assert (b"transfer-encoding", b"chunked") in list(event.headers)
        elif isinstance(event, h11.Data):
            body += event.data
            chunks += 1
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            raise AssertionError(event)
    assert body == b"".join(PARTS) + END
    assert raw.endswith(b"\r\n0\r\n\r\n")


@pytest.mark.realtime
async def test_an_http_1_0_client_gets_the_stream_delimited_by_the_close() -> None:
    seen.clear()
    raw = await _ask(b"POST /x HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
    assert seen == [True]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    assert body == b"".join(PARTS) + END


def test_whole_chunks_in_one_read_come_out_joined() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"3\r\nabc\r\n2\r\nde\r\n1") == b"abcde"
    assert decoder.feed(b"\r\nf\r\n0\r\n\r\n") == b"f"
    assert decoder.done


@pytest.mark.parametrize("after", [b"xx", b"\rx", b"\n\r"])
def test_a_whole_chunk_not_followed_by_crlf_is_malformed(after: bytes) -> None:
    with pytest.raises(ValueError, match="CRLF"):
        ChunkedDecoder().feed(b"3\r\nabc" + after + b"0\r\n\r\n")


async def test_the_app_queue_hands_over_at_once_and_a_full_one_still_holds_the_reader() -> None:
    """:class:`AppTasks`: a put that finds room returns without waiting, in order; one that
    finds the queue full (``max_app_queue_size``) waits until the application reads, so a client
    sending faster than its route reads is held back; a read of an empty queue waits."""
    settings = HypercornConfig()
    settings.max_app_queue_size = 2
    may_read = trio.Event()
    received: list[Any] = []
    finished = trio.Event()

    async def app(scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> None:
        await may_read.wait()
        for _ in range(4):
            received.append(await receive())

    async def send(message: Any) -> None:
        if message is None:
            finished.set()

    messages = [{"type": "http.request", "body": bytes([n]), "more_body": True} for n in range(4)]
    put_done: list[int] = []
    async with AppTasks() as tasks:
        put = await tasks.spawn_app(app, settings, {"type": "http"}, send)

        async def put_all() -> None:
            for n, message in enumerate(messages[:3]):
                await put(message)
                put_done.append(n)

        tasks.spawn(put_all)
        await trio.testing.wait_all_tasks_blocked()
        assert put_done == [0, 1]  # the third waits for room
        may_read.set()
        await trio.testing.wait_all_tasks_blocked()
        assert put_done == [0, 1, 2]
        assert received == messages[:3]  # the fourth read waits for its message
        await put(messages[3])
        with trio.fail_after(5):
            await finished.wait()
    assert received == messages


async def test_a_put_with_room_and_a_read_with_a_message_skip_the_scheduler() -> None:
    """Neither is a checkpoint (a cancelled caller still completes it): no scheduler pass per
    body message on the request path."""
    settings = HypercornConfig()
    got: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> None:
        with trio.CancelScope() as cancelled:
            cancelled.cancel()
            got.append(await receive())
        got.append(cancelled.cancelled_caught)

    async def send(message: Any) -> None:
        pass

    async with AppTasks() as tasks:
        put = await tasks.spawn_app(app, settings, {"type": "http"}, send)
        with trio.CancelScope() as cancelled:
            cancelled.cancel()
            await put({"type": "http.disconnect"})
        assert not cancelled.cancelled_caught
    assert got == [{"type": "http.disconnect"}, False]
