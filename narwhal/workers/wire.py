"""The messages between relay workers and their admission controller, over one stream.

A frame is a 4-byte big-endian length and an orjson object. Each side sends whenever it likes;
what one side sends while its writer is busy goes out in the writer's next write, so the
messages of one loop iteration (a request's ticket, its release and its lesson, say) cost one
system call, not one each. A call (:meth:`Channel.call`) is a message with a number ``c`` that
the other side answers with ``{"r": c, ...}``; every other message is one way.

A channel that closes (the other side went away, or sent what is not a frame) fails its pending
calls with :class:`ChannelClosed`, and sending on it is a no-op: what the closed side held is
its peer's to account for (:mod:`narwhal.workers.controller`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import Any

import orjson
import trio

__all__ = ["MAX_FRAME_BYTES", "Channel", "ChannelClosed", "Message"]

log = logging.getLogger(__name__)

Message = dict[str, Any]

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""The largest frame either side accepts; a larger length is a broken peer (the channel
closes)."""

_LENGTH = struct.Struct(">I")
_READ_BYTES = 256 * 1024


class ChannelClosed(Exception):
    """The channel closed before the call was answered."""


class _Pending:
    __slots__ = ("answer", "done")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.answer: Message | None = None


class Channel:
    """Framed messages both ways over ``stream``; run :meth:`run` to move them.

    Args:
        stream: a connected byte stream (a Unix socket; a memory stream in tests).
        name: who the peer is, for the log.
    """

    def __init__(self, stream: trio.abc.Stream, *, name: str = "peer") -> None:
        self.stream = stream
        self.name = name
        self.closed = False
        self._outbox: list[bytes] = []
        self._wake = trio.Event()
        self._calls: dict[int, _Pending] = {}
        self._next_call = 0
        self._gone = trio.Event()
        self._scope: trio.CancelScope | None = None

    # -- sending ------------------------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Queue ``message`` for the next write (a no-op once closed)."""
        if self.closed:
            return
        body = orjson.dumps(message)
        self._outbox.append(_LENGTH.pack(len(body)) + body)
        self._wake.set()

    async def call(self, message: Message) -> Message:
        """Send ``message`` as a call and return the answer.

        Raises:
            ChannelClosed: the channel closed first (or was closed already).
        """
        if self.closed:
            raise ChannelClosed(f"the channel to {self.name} is closed")
        self._next_call += 1
        number = self._next_call
        pending = self._calls[number] = _Pending()
        try:
            self.send(message | {"c": number})
            await pending.done.wait()
        finally:
            self._calls.pop(number, None)
        if pending.answer is None:
            raise ChannelClosed(f"the channel to {self.name} closed before answering")
        return pending.answer

    def answer(self, call: Message, answer: Message) -> None:
        """Answer the call ``call`` with ``answer``."""
        self.send(answer | {"r": call["c"]})

    # -- running ------------------------------------------------------------------------------

    async def run(
        self,
        handle: Callable[[Message], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Write what is sent and hand every message that is not an answer to ``handle``,
        in order, until the stream ends or breaks; then close. ``handle`` must not block (it
        starts tasks for what takes time)."""
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                if self.closed:
                    nursery.cancel_scope.cancel()
                nursery.start_soon(self._write)
                task_status.started()
                await self._read(handle)
                nursery.cancel_scope.cancel()
        finally:
            self._close()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.stream.aclose()

    def close(self) -> None:
        """Close the channel now; :meth:`run` returns."""
        self._close()
        if self._scope is not None:
            self._scope.cancel()

    async def wait_closed(self) -> None:
        """Return once the channel has closed."""
        await self._gone.wait()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._outbox.clear()
        for pending in self._calls.values():
            pending.done.set()  # no answer: ChannelClosed
        self._wake.set()
        self._gone.set()

    async def _write(self) -> None:
        stream = self.stream
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self.closed:
                return
            data, self._outbox = b"".join(self._outbox), []
            try:
                await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self._close()
                return

    async def _read(self, handle: Callable[[Message], None]) -> None:
        stream = self.stream
        buffer = bytearray()
        gone = self._gone
        while not gone.is_set():
            try:
                data = await stream.receive_some(_READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            buffer += data
            start = 0
            while len(buffer) - start >= 4:
                (size,) = _LENGTH.unpack_from(buffer, start)
                if size > MAX_FRAME_BYTES:
                    log.error("%s sent a frame of %d bytes; closing the channel", self.name, size)
                    return
                end = start + 4 + size
                if end > len(buffer):
                    break
                try:
                    message = orjson.loads(buffer[start + 4 : end])
                except orjson.JSONDecodeError:
                    log.error("%s sent a frame that is not JSON; closing the channel", self.name)
                    return
                start = end
                if type(message) is not dict:
                    log.error("%s sent a frame that is not an object; closing", self.name)
                    return
                number = message.get("r")
                if number is not None:
                    pending = self._calls.get(number)
                    if pending is not None:
                        pending.answer = message
                        pending.done.set()
                    continue
                handle(message)
            del buffer[:start]
