"""Narwhal's own socket calls (narwhal.sockets): Trio's stream contract where callers rely on it
(cancellation, errors, closing, fairness), without a trip through the scheduler per call.

Local socket pairs, no network; the fairness test runs on a MockClock that only moves when told.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio
import trio.testing

from narwhal.sockets import SLICE_S, SocketStream

_open: list[socket.socket] = []


def pair() -> tuple[SocketStream, SocketStream]:
    left, right = socket.socketpair()
    _open.extend((left, right))
    return SocketStream(left), SocketStream(right)


@pytest.fixture(autouse=True)
def _close_sockets() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


async def test_what_is_sent_arrives_whole_also_past_what_the_kernel_takes_at_once() -> None:
    sender, receiver = pair()
    payload = bytes(range(256)) * 16384  # 4 MiB: many times a socket buffer
    received = bytearray()

    async def read() -> None:
        while len(received) < len(payload):
            received.extend(await receiver.receive_some())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await sender.send_all(payload)
    assert received == payload
    await sender.aclose()
    await receiver.aclose()


async def test_a_cancelled_task_never_begins_a_write_or_a_read() -> None:
    sender, receiver = pair()
    await sender.send_all(b"before")
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await sender.send_all(b"never")
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await receiver.receive_some()
    assert await receiver.receive_some() == b"before"
    assert receiver.receive_nowait() is None  # "never" was not sent


async def test_closing_wakes_a_waiting_reader_and_later_calls_say_closed() -> None:
    stream, _peer = pair()
    failures: list[BaseException] = []

    async def wait_for_data() -> None:
        try:
            await stream.receive_some()
        except trio.ClosedResourceError as exc:
            failures.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_data)
            await trio.testing.wait_all_tasks_blocked()
            await stream.aclose()
    assert len(failures) == 1
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_all(b"x")
    with pytest.raises(trio.ClosedResourceError):
        stream.receive_nowait()
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_eof()
    await stream.aclose()  # twice is harmless
    assert stream.peer_closed()


async def test_the_peer_ending_is_an_empty_read_and_a_reset_is_broken() -> None:
    stream, peer = pair()
    assert not stream.peer_closed()
    await peer.send_eof()
    assert stream.peer_closed()
    assert await stream.receive_some() == b""
    await stream.send_all(b"still open this way")
    assert await peer.receive_some() == b"still open this way"

    stream, peer = pair()
    peer.socket.close()
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(100):  # the first send may still be accepted
            await stream.send_all(b"x" * 65536)


@contextmanager
def no_schedule_point() -> Iterator[None]:
    """The block checks for cancellation (a cancel point) but never yields to the scheduler:
    Trio's ``assert_checkpoints`` wants both and says the block did not yield."""
    with pytest.raises(AssertionError, match="did not yield"):
        with trio.testing.assert_checkpoints():
            yield


async def test_calls_completed_at_once_yield_once_per_slice(
    mock_clock: trio.testing.MockClock,  # time moves only when jumped
) -> None:
    sender, receiver = pair()
    with trio.testing.assert_checkpoints():
        await sender.send_all(b"a")  # a stream's first call yields
    with no_schedule_point():
        await sender.send_all(b"b")
    with trio.testing.assert_checkpoints():
        assert await receiver.receive_some() == b"ab"  # the receiver's first call
    with no_schedule_point():
        await sender.send_all(b"c")
    with no_schedule_point():
        assert await receiver.receive_some() == b"c"
    mock_clock.jump(SLICE_S)
    with trio.testing.assert_checkpoints():
        await sender.send_all(b"d")
    with trio.testing.assert_checkpoints():
        assert await receiver.receive_some() == b"d"
    mock_clock.autojump_threshold = 0
    with trio.testing.assert_checkpoints():  # a call that waits yields, as Trio's do
        with trio.move_on_after(1):
            await receiver.receive_some()


async def test_an_adopted_trio_stream_keeps_its_options() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        accepted = await listener.accept()
        adopted = SocketStream.adopt(client)
        assert adopted.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        server = SocketStream.adopt(accepted)
        await adopted.send_all(b"hello")
        assert await server.receive_some() == b"hello"
        await adopted.aclose()
        assert await server.receive_some() == b""
        await server.aclose()
