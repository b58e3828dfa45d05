"""Reading a request body without ever holding more than the limit.

Quart would answer an oversized body with its own 413 page; Narwhal reads the body itself and
refuses as soon as ``Content-Length`` or the running count passes ``serving.max_request_bytes``.
A bounded amount of the rest is then drained, so a client still writing its body reads the
413 instead of a connection reset.
"""

from __future__ import annotations

from typing import Any

import trio
from quart_trio.wrappers.request import TrioBody, TrioRequest
from werkzeug.exceptions import RequestEntityTooLarge

from narwhal.errors import RequestTooLarge

__all__ = ["BoundedBody", "NarwhalRequest", "read_body"]

DRAIN_BYTES = 4 * 1024 * 1024
DRAIN_S = 1.0


class BoundedBody(TrioBody):
    """Quart's body that keeps counting (and discarding) bytes once over the limit."""

    def __init__(self, expected_content_length: int | None, max_content_length: int | None) -> None:
        super().__init__(expected_content_length, max_content_length)
        self.received = 0
        self.ended = False
        self._progress = trio.Event()
        self._appending = False

    def append(self, data: bytes) -> None:
        self.received += len(data)
        self._appending = True
        try:
            super().append(data)  # over the limit, Quart stores nothing and marks it complete
        finally:
            self._appending = False
        self._wake()

    def set_complete(self) -> None:
        super().set_complete()
        if not self._appending:  # the client's last byte, not Quart's overflow
            self.ended = True
            self._wake()

    def _wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def wait_progress(self) -> None:
        """Wait for more bytes or the end of the body."""
        await self._progress.wait()


class NarwhalRequest(TrioRequest):
    """Quart-Trio's request with a :class:`BoundedBody`."""

    body_class = BoundedBody


async def read_body(request: Any, limit: int) -> bytes:
    """The whole body, or :class:`RequestTooLarge` once it passes ``limit`` bytes."""
    body = request.body
    declared = request.content_length
    if declared is not None and declared > limit:
        await _drain(body, limit)
        raise RequestTooLarge(_too_large(limit))
    parts: list[bytes] = []
    size = 0
    try:
        async for part in body:
            size += len(part)
            if size > limit:
                raise RequestEntityTooLarge()
            parts.append(part)
    except RequestEntityTooLarge:
        await _drain(body, limit)
        raise RequestTooLarge(_too_large(limit)) from None
    return b"".join(parts)


async def _drain(body: Any, limit: int) -> None:
    if not isinstance(body, BoundedBody):
        return
    with trio.move_on_after(DRAIN_S):
        while not body.ended and body.received <= limit + DRAIN_BYTES:
            await body.wait_progress()


def _too_large(limit: int) -> str:
    return f"The request body is larger than the limit of {limit} bytes."
