"""Test plumbing: drive the ASGI app through httpx, streaming, in virtual time.

httpx's own ``ASGITransport`` buffers the whole response body, which hides streaming timing and
disconnects. This transport runs the app in a task of the test's nursery, returns the response
as soon as its headers go out, yields body chunks as the app sends them, and tells the app the
client went away (``http.disconnect``) when the response is closed early.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: trio.MemoryReceiveChannel[bytes], done: trio.Event) -> None:
        self._chunks = chunks
        self._done = done
        self.on_close: Any = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        if self.on_close is not None:
            await self.on_close()


class ASGIStreamTransport(httpx.AsyncBaseTransport):
    """An httpx transport that serves requests from an ASGI app in ``nursery``."""

    def __init__(self, app: Any, nursery: trio.Nursery) -> None:
        self.app = app
        self.nursery = nursery

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path,
            "query_string": request.url.query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 80),
            "extensions": {},
        }
        step = 1 << 16
        pieces = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
        to_app_send, to_app_receive = trio.open_memory_channel[dict[str, Any]](len(pieces))
        chunks_send, chunks_receive = trio.open_memory_channel[bytes](64)
        started: dict[str, Any] = {}
        headers_ready = trio.Event()
        done = trio.Event()
        disconnected = trio.Event()
        for index, piece in enumerate(pieces):
            to_app_send.send_nowait(
                {"type": "http.request", "body": piece, "more_body": index < len(pieces) - 1}
            )

        async def receive() -> dict[str, Any]:
            try:
                return await to_app_receive.receive()
            except trio.EndOfChannel:
                await disconnected.wait()
                return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
                headers_ready.set()
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    try:
                        await chunks_send.send(message["body"])
                    except trio.BrokenResourceError:
                        pass
                if not message.get("more_body", False):
                    await chunks_send.aclose()

        async def run_app() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                done.set()
                headers_ready.set()
                await chunks_send.aclose()

        await to_app_send.aclose()
        self.nursery.start_soon(run_app)
        try:
            await headers_ready.wait()
        except BaseException:
            disconnected.set()  # the client gave up before the headers: it went away
            raise
        if not started:
            raise httpx.RemoteProtocolError("the app ended without a response")
        stream = _Body(chunks_receive, done)

        async def close() -> None:
            if not done.is_set():
                disconnected.set()
                with trio.move_on_after(5):
                    await done.wait()
            await chunks_receive.aclose()

        stream.on_close = close
        return httpx.Response(
            status_code=started["status"],
            headers=[(bytes(k), bytes(v)) for k, v in started.get("headers", [])],
            stream=stream,
            request=request,
        )


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]


async def run_lifespan(app: Any, *, task_status: trio.TaskStatus[None]) -> None:
    """Run the app's ASGI lifespan: startup, then (even when cancelled) a clean shutdown."""
    to_app, from_test = trio.open_memory_channel[dict[str, Any]](4)
    to_test, from_app = trio.open_memory_channel[dict[str, Any]](4)

    async def expect(kind: str) -> None:
        message = await from_app.receive()
        if message["type"] != kind:
            raise RuntimeError(f"lifespan: expected {kind}, got {message}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            app, {"type": "lifespan", "asgi": {"version": "3.0"}}, from_test.receive, to_test.send
        )
        await to_app.send({"type": "lifespan.startup"})
        await expect("lifespan.startup.complete")
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await to_app.send({"type": "lifespan.shutdown"})
                await expect("lifespan.shutdown.complete")
            nursery.cancel_scope.cancel()


async def until(predicate: Any, *, step: float = 0.001) -> None:
    """Poll plain state on the Trio clock (in virtual time the polls cost nothing)."""
    while not predicate():  # noqa: ASYNC110 - the state has no event of its own
        await trio.sleep(step)


class Pluggable(httpx.AsyncBaseTransport):
    """Wraps a transport; while ``down``, every connection is refused, like a dead host."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)
