"""Incremental server-sent-events decoding and encoding (pure, no I/O).

Engines frame every event as ``data: <json>\\n\\n`` and end with ``data: [DONE]``. The decoder
accepts the whole WHATWG framing (CR, LF or CRLF line ends, comments, several ``data:`` lines
joined with ``\\n``), because a relay must never hang on a framing it did not expect.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DONE", "SSEDecoder", "SSEEvent", "encode_data", "encode_done"]

DONE = b"[DONE]"


class SSEEvent(NamedTuple):
    """One dispatched event: its joined ``data`` and its ``event`` name, if any.

    A named tuple: one is made for every event an engine sends, and a tuple is the cheapest
    immutable record to make."""

    data: bytes
    event: str | None = None


class SSEDecoder:
    """Feed bytes as they arrive; get complete events back.

    Comment-only blocks (keep-alives) and blocks without a ``data`` or ``event`` field produce
    nothing, as in the browser's EventSource.
    """

    __slots__ = ("_buffer", "_pending_cr")

    def __init__(self) -> None:
        self._buffer = b""
        self._pending_cr = False

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Add bytes and return the events they complete."""
        if self._pending_cr:
            data = b"\r" + data
            self._pending_cr = False
        if b"\r" in data:
            # Rare framings: normalise CRLF and CR to LF. A CR at the end of a read may be the
            # first half of a CRLF, so it waits for the next read.
            if data.endswith(b"\r"):
                data = data[:-1]
                self._pending_cr = True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._buffer + data if self._buffer else data
        events: list[SSEEvent] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            event = _parse_block(buffer[start:end])
            if event is not None:
                events.append(event)
            start = end + 2
        self._buffer = buffer[start:]
        return events

    def flush(self) -> SSEEvent | None:
        """At end of stream: an event left without its blank line, if any (WHATWG drops it;
        we return it so a truncated stream can be diagnosed)."""
        rest = self._buffer.strip(b"\n")
        self._buffer = b""
        self._pending_cr = False
        return _parse_block(rest) if rest else None


def _parse_block(block: bytes) -> SSEEvent | None:
    if block.startswith(b"data: ") and b"\n" not in block:
        return SSEEvent(block[6:])  # the common case: one data line
    data: list[bytes] = []
    name: str | None = None
    seen = False
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
            seen = True
        elif field == b"event":
            name = value.decode("utf-8", "replace")
            seen = True
        elif field in (b"id", b"retry"):
            seen = True
    if not seen:
        return None
    return SSEEvent(b"\n".join(data), name)


def encode_data(payload: bytes) -> bytes:
    """Frame a JSON payload as one SSE event."""
    return b"data: " + payload + b"\n\n"


def encode_done() -> bytes:
    """The stream terminator."""
    return b"data: [DONE]\n\n"
