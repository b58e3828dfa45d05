"""Socket streams whose calls Narwhal makes itself: non-blocking ``recv`` and ``send`` on a
standard-library socket, with Trio only to wait for readiness.

Every relayed token crosses two sockets: a read from the engine and a write to the client. On
:class:`trio.SocketStream` each of those calls is a full checkpoint: a trip through the
scheduler even when the kernel had the bytes ready (or the room) at once, under a conflict
detector, an error-translating context manager and Trio's ``_try_sync`` sandwich. On the relay
benchmark (``narwhal bench overhead``) the reads and writes were about a third of the router's
CPU, and a Trio send and receive pair costs several times the system calls themselves
(benchmarks/README.md has the figures).

:class:`SocketStream` keeps Trio's contract where it matters and drops the rest:

* **Cancellation:** every call checks for it first (``checkpoint_if_cancelled``), so a
  cancelled task never begins a read or a write, and a call that has to wait waits in
  ``wait_readable``/``wait_writable``, a full checkpoint.
* **Fairness:** a call the kernel completes at once does not yield, unless the stream has run
  :data:`SLICE_S` since it last did; then it yields (shielded, as Trio's own ``_try_sync``
  does after a completed call), so a task that always finds data ready still lets the others
  run.
* **Errors:** the peer going away is :class:`trio.BrokenResourceError`, a stream closed here
  is :class:`trio.ClosedResourceError` (also for a task waiting on it when it closes:
  ``notify_closing``), as on Trio's stream.

The synchronous halves (:meth:`SocketStream.send_nowait`, :meth:`SocketStream.receive_nowait`)
let a caller skip even the scopes it would otherwise need around an ``await``: the client
connection's write lock and shield (``narwhal.web.http11``), the engine read's deadline
(``narwhal.upstream.transport``), which are needed only when the call has to wait.
"""

from __future__ import annotations

import errno
import select
import socket
from collections.abc import Awaitable, Callable

import trio

__all__ = ["SLICE_S", "SocketStream"]

SLICE_S = 0.001
"""The longest a stream's calls run without yielding while the kernel completes each at once."""

DEFAULT_RECEIVE = 65536

_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.ENOTSOCK})


class SocketStream(trio.abc.HalfCloseableStream):
    """A connected stream socket (``SOCK_STREAM``) in non-blocking mode.

    Args:
        sock: a connected standard-library socket; the stream owns it (and sets it
            non-blocking).
    """

    __slots__ = ("_yield_at", "socket")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.socket = sock
        self._yield_at = -1.0  # the first call completed at once yields

    @classmethod
    def adopt(cls, stream: trio.SocketStream) -> SocketStream:
        """Take over the socket of Trio's ``stream`` (its options, ``TCP_NODELAY`` among
        them, stay set); ``stream`` is left detached and must not be used again."""
        wrapped = stream.socket
        family, kind, proto = wrapped.family, wrapped.type, wrapped.proto
        return cls(socket.socket(family, kind, proto, fileno=wrapped.detach()))

    # -- the synchronous halves -------------------------------------------------------------------

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Send what the kernel takes now; how many bytes that was (0 when it has no room).

        Raises:
            trio.BrokenResourceError: the peer went away.
            trio.ClosedResourceError: the stream was closed here.
        """
        try:
            return self.socket.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise self._failure(exc) from exc

    def receive_nowait(self, max_bytes: int = DEFAULT_RECEIVE) -> bytes | None:
        """What the kernel has now, up to ``max_bytes``: ``b""`` once the peer has ended its
        side, ``None`` when nothing is there yet.

        Raises:
            trio.BrokenResourceError: the peer went away.
            trio.ClosedResourceError: the stream was closed here.
        """
        try:
            return self.socket.recv(max_bytes)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise self._failure(exc) from exc

    def peer_closed(self) -> bool:
        """Something is readable on a connection that expects nothing: the peer closed it,
        broke it or sent what it should not have (an idle keep-alive connection's check)."""
        if self.socket.fileno() == -1:
            return True
        poller = select.poll()
        poller.register(self.socket, select.POLLIN)
        return bool(poller.poll(0))

    # -- the stream -------------------------------------------------------------------------------

    async def yield_if_due(self) -> None:
        """Yield (shielded) if this stream's calls have run :data:`SLICE_S` without it."""
        now = trio.current_time()
        if now >= self._yield_at:
            await trio.lowlevel.cancel_shielded_checkpoint()
            self._yield_at = trio.current_time() + SLICE_S

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        with memoryview(data) as view:
            sent = self.send_nowait(view) if view else 0
            if sent == len(view):
                if not view:
                    self._check_open()
                await self.yield_if_due()
                return
            while sent < len(view):
                await self.wait_writable()
                with view[sent:] as rest:
                    sent += self.send_nowait(rest)

    async def wait_send_all_might_not_block(self) -> None:
        await self.wait_writable()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        size = DEFAULT_RECEIVE if max_bytes is None else max_bytes
        if size < 1:
            raise ValueError("max_bytes must be >= 1")
        data = self.receive_nowait(size)
        if data is not None:
            await self.yield_if_due()
            return data
        while data is None:
            await self.wait_readable()
            data = self.receive_nowait(size)
        return data

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        self._check_open()
        try:
            self.socket.shutdown(socket.SHUT_WR)
        except OSError as exc:
            raise self._failure(exc) from exc

    async def aclose(self) -> None:
        if self.socket.fileno() != -1:
            trio.lowlevel.notify_closing(self.socket)
            self.socket.close()
        await trio.lowlevel.checkpoint()

    async def wait_readable(self) -> None:
        """Wait until a read may not block (a full checkpoint, as every wait is).

        Raises:
            trio.ClosedResourceError: the stream is closed, or closes while waiting.
        """
        await self._wait(trio.lowlevel.wait_readable)

    async def wait_writable(self) -> None:
        """Wait until a write may not block (a full checkpoint, as every wait is).

        Raises:
            trio.ClosedResourceError: the stream is closed, or closes while waiting.
        """
        await self._wait(trio.lowlevel.wait_writable)

    # -- inside -----------------------------------------------------------------------------------

    async def _wait(self, wait: Callable[[socket.socket], Awaitable[None]]) -> None:
        self._check_open()
        await wait(self.socket)
        self._yield_at = trio.current_time() + SLICE_S

    def _check_open(self) -> None:
        if self.socket.fileno() == -1:
            raise trio.ClosedResourceError("the stream was closed")

    def _failure(self, exc: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
        if self.socket.fileno() == -1 or exc.errno in _CLOSED_ERRNOS:
            return trio.ClosedResourceError("the stream was closed")
        return trio.BrokenResourceError(f"the connection broke: {exc!r}")
