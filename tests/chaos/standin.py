"""A stand-in engine with every broken shape: a tiny HTTP/1.1 server on raw Trio sockets.

It answers ``/health``, ``/v1/models`` and ``/metrics`` correctly (so the router lets it join and
keeps it eligible), and every completion request with the shape of :attr:`StandIn.shape`, which a
test changes at run time. The router reaches it through its real upstream transport: the engine
is configured by URL, with no in-process transport.

Shapes:

``good``            a whole SSE stream (chunked, keep-alive): role, two content chunks, the
                    finish, the usage chunk when asked, ``[DONE]``.
``json_200``        a 200 with a JSON ``chat.completion`` body instead of SSE.
``no_done_idle``    two content chunks, then silence on an open connection (no finish).
``finish_idle``     everything but ``[DONE]``, then silence (issue item 11).
``invalid_utf8``    a content chunk whose ``data:`` line holds invalid UTF-8, then the rest.
``huge_line``       a 10 MB ``data:`` line without a newline, then silence.
``http10_close``    an HTTP/1.0 200 without ``Content-Length``: the SSE body runs to the close.
``black_hole``      reads the request and never answers.
``bad_length``      a 200 with ``content-length: abc`` (issue item 4).
``http_500``        a 500 with a JSON error body.
``http_503_html``   a 503 with an HTML body.
``garbage_status``  a status line that is not HTTP.
``reset``           closes the connection as soon as the request is read.
``bad_chunk``       a chunked body with a chunk size that is not hex.
``short_length``    a ``Content-Length`` larger than the body, then the close.
"""

from __future__ import annotations

import json
from typing import Any

import trio

from tests.conftest import MODEL

SHAPES = (
    "good",
    "json_200",
    "no_done_idle",
    "finish_idle",
    "invalid_utf8",
    "huge_line",
    "http10_close",
    "black_hole",
    "bad_length",
    "http_500",
    "http_503_html",
    "garbage_status",
    "reset",
    "bad_chunk",
    "short_length",
)
TEXT = ("Hi", " there")


class _Closed(Exception):
    pass


class StandIn:
    """The server; ``await nursery.start(stand_in.serve)`` returns its URL."""

    def __init__(self, shape: str = "good") -> None:
        self.shape = shape
        self.completions = 0  # completion requests received
        self.stuck = 0  # handlers holding a connection the router has not closed yet
        self.connections = 0  # open connections
        self.last_body = b""  # the last completion request's body

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(f"http://127.0.0.1:{port}")
            await trio.serve_listeners(self._connection, listeners, handler_nursery=nursery)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = bytearray()
        try:
            async with stream:
                while True:
                    method, path, body = await _read_request(stream, buffer)
                    if not await self._answer(stream, method, path, body):
                        return
        except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.connections -= 1

    async def _answer(self, stream: trio.SocketStream, method: str, path: str, body: bytes) -> bool:
        """Answer one request; False when the connection must end."""
        if path == "/health":
            await _send_json(stream, 200, {"status": "ok"})
            return True
        if path == "/v1/models":
            await _send_json(stream, 200, {"object": "list", "data": [{"id": MODEL}]})
            return True
        if path == "/metrics":
            text = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            await stream.send_all(_head(200, "text/plain", len(text)) + text)
            return True
        if method != "POST":
            await _send_json(stream, 404, {"error": {"message": "no route"}})
            return True
        self.completions += 1
        self.last_body = body
        try:
            request = json.loads(body)
        except ValueError:
            request = {}
        return await self._completion(stream, request if isinstance(request, dict) else {})

    async def _completion(self, stream: trio.SocketStream, request: dict[str, Any]) -> bool:
        shape = self.shape
        chat = "messages" in request
        usage = bool((request.get("stream_options") or {}).get("include_usage"))
        events = _events(chat, usage)
        if shape == "good":
            await stream.send_all(_sse_head())
            for event in events:
                await stream.send_all(_chunk(event))
            await stream.send_all(b"0\r\n\r\n")
            return True
        if shape == "json_200":
            await _send_json(stream, 200, _assembled(chat))
            return True
        if shape == "no_done_idle":
            await stream.send_all(_sse_head() + b"".join(_chunk(e) for e in events[:3]))
            await self._idle(stream)
            return False
        if shape == "finish_idle":
            await stream.send_all(_sse_head() + b"".join(_chunk(e) for e in events[:-1]))
            await self._idle(stream)
            return False
        if shape == "invalid_utf8":
            broken = events[1].replace(b"Hi", b"H\xff\xfei")
            await stream.send_all(
                _sse_head() + _chunk(events[0]) + _chunk(broken) + b"".join(map(_chunk, events[2:]))
            )
            await stream.send_all(b"0\r\n\r\n")
            return True
        if shape == "huge_line":
            await stream.send_all(_sse_head() + _chunk(events[0]))
            line = b"data: {" + b'"x": "' + b"a" * (10 * 1024 * 1024)
            for start in range(0, len(line), 1 << 20):
                await stream.send_all(_chunk(line[start : start + (1 << 20)]))
            await self._idle(stream)
            return False
        if shape == "http10_close":
            head = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
            await stream.send_all(head + b"".join(events))
            return False
        if shape == "black_hole":
            await self._idle(stream)
            return False
        if shape == "bad_length":
            text = b"".join(events)
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: abc\r\n\r\n"
                + text
            )
            await self._idle(stream)
            return False
        if shape == "http_500":
            await _send_json(stream, 500, {"error": {"message": "boom", "code": 500}})
            return True
        if shape == "http_503_html":
            page = b"<html><body>503 Service Unavailable</body></html>"
            await stream.send_all(_head(503, "text/html", len(page)) + page)
            return True
        if shape == "garbage_status":
            await stream.send_all(b"SPDY/9 banana\r\n\r\n")
            return False
        if shape == "reset":
            return False
        if shape == "bad_chunk":
            await stream.send_all(_sse_head() + _chunk(events[0]) + b"zz\r\nhello\r\n")
            await self._idle(stream)
            return False
        if shape == "short_length":
            text = b"".join(events)
            await stream.send_all(_head(200, "text/event-stream", len(text) + 100) + text)
            return False
        raise AssertionError(f"unknown shape {shape!r}")

    async def _idle(self, stream: trio.SocketStream) -> None:
        """Hold the connection, saying nothing, until the router closes it."""
        self.stuck += 1
        try:
            while await stream.receive_some(65536):
                pass
        finally:
            self.stuck -= 1


async def _read_request(stream: trio.SocketStream, buffer: bytearray) -> tuple[str, str, bytes]:
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            raise _Closed
        buffer.extend(data)
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    del buffer[: end + 4]
    method, path, _ = head[0].split(" ", 2)
    length = 0
    chunked = False
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    if chunked:  # the router sends bodies with a length; keep this simple
        raise AssertionError("chunked request bodies are not expected")
    while len(buffer) < length:
        data = await stream.receive_some(65536)
        if not data:
            raise _Closed
        buffer.extend(data)
    body = bytes(buffer[:length])
    del buffer[:length]
    return method, path.split("?")[0], body


def _head(status: int, content_type: str, length: int) -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


async def _send_json(stream: trio.SocketStream, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    await stream.send_all(_head(status, "application/json", len(data)) + data)


def _sse_head() -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _events(chat: bool, usage: bool) -> list[bytes]:
    """The SSE events of a whole answer: role, content, finish, (usage), [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[Any], **extra: Any) -> bytes:
        body = {"id": "standin-1", "object": kind, "created": 1, "model": MODEL}
        body.update(choices=choices, **extra)
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def choice(text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish}

    events = [
        event([choice("", role=True)]),
        event([choice(TEXT[0])]),
        event([choice(TEXT[1])]),
        event([choice(None if chat else "", finish="stop")]),
    ]
    if usage:
        events.append(
            event([], usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
        )
    events.append(b"data: [DONE]\n\n")
    return events


def _assembled(chat: bool) -> dict[str, Any]:
    text = "".join(TEXT)
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        if chat
        else {"index": 0, "text": text, "finish_reason": "stop"}
    )
    return {
        "id": "standin-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
