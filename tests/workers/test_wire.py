"""The channel between relay workers and their controller: frames, calls, batching, breakage."""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from narwhal.workers.wire import MAX_FRAME_BYTES, Channel, ChannelClosed, Message
from tests.support import until

pytestmark = pytest.mark.usefixtures("autojump_clock")


class CountingStream(trio.abc.Stream):
    """A stream that counts its writes."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.writes = 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_messages_arrive_in_order_and_one_iterations_go_in_one_write(
    nursery: trio.Nursery,
) -> None:
    left, right = trio.testing.memory_stream_pair()
    counting = CountingStream(left)
    sender = Channel(counting)
    received: list[Message] = []
    await nursery.start(sender.run, received.append)
    await nursery.start(Channel(right).run, received.append)
    for number in range(100):
        sender.send({"t": "n", "n": number})
    with trio.fail_after(1):
        await until(lambda: len(received) == 100)
    assert [message["n"] for message in received] == list(range(100))
    assert counting.writes == 1


async def test_a_call_gets_its_answer_and_fails_when_the_channel_closes(
    nursery: trio.Nursery,
) -> None:
    left, right = trio.testing.memory_stream_pair()
    caller = Channel(left)
    answerer = Channel(right)
    unanswered: list[Message] = []

    def answer(message: Message) -> None:
        if message["t"] == "echo":
            answerer.answer(message, {"echo": message["v"]})
        else:
            unanswered.append(message)

    await nursery.start(caller.run, lambda message: None)
    await nursery.start(answerer.run, answer)
    with trio.fail_after(1):
        assert (await caller.call({"t": "echo", "v": 7}))["echo"] == 7
    async with trio.open_nursery() as waiting:

        async def hang() -> None:
            with pytest.raises(ChannelClosed):
                await caller.call({"t": "silence"})

        waiting.start_soon(hang)
        with trio.fail_after(1):
            await until(lambda: bool(unanswered))
        answerer.close()
    with pytest.raises(ChannelClosed):
        await caller.call({"t": "echo", "v": 1})
    caller.send({"t": "dropped"})  # a no-op once closed


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack(">I", MAX_FRAME_BYTES + 1),
        struct.pack(">I", 5) + b"nope!",
        struct.pack(">I", 2) + b"[]",
    ],
    ids=["too-large", "not-json", "not-an-object"],
)
async def test_a_peer_that_sends_garbage_is_cut_off(nursery: trio.Nursery, garbage: bytes) -> None:
    left, right = trio.testing.memory_stream_pair()
    channel = Channel(right)
    received: list[Message] = []
    await nursery.start(channel.run, received.append)
    await left.send_all(struct.pack(">I", 9) + b'{"t":"a"}' + garbage)
    with trio.fail_after(1):
        await channel.wait_closed()
    assert received == [{"t": "a"}]


async def test_a_frame_split_across_reads_is_put_back_together(nursery: trio.Nursery) -> None:
    left, right = trio.testing.memory_stream_pair()
    channel = Channel(right)
    received: list[Message] = []
    await nursery.start(channel.run, received.append)
    frame = struct.pack(">I", 13) + b'{"t":"split"}'
    for byte in frame:
        await left.send_all(bytes([byte]))
        await trio.sleep(0.001)
    with trio.fail_after(1):
        await until(lambda: bool(received))
    assert received == [{"t": "split"}]
