"""The stack floor: the cheapest relay an ASGI app on this stack can be, a target of
``narwhal bench overhead --stack-floor``.

``python -m narwhal.bench.stack_floor --bind 127.0.0.1:PORT --upstream http://127.0.0.1:EPORT
[--front hypercorn|narwhal]`` serves a minimal ASGI application that reads a request's body,
sends it with the request's method, path and ``content-type`` to the engine through an
``httpx.AsyncClient`` on Narwhal's engine transport (:class:`~narwhal.upstream.transport.
EngineTransport`, the cheapest httpx transport we have), and passes the engine's status,
``content-type`` and body back, one ASGI body message per upstream read. The HTTP server in
front of it is either stock Hypercorn (``--front hypercorn``: ``hypercorn.trio.serve``, its own
connection handling over h11) or Narwhal's own connection shell around Hypercorn's HTTP stream
and h11 (``--front narwhal``: :mod:`narwhal.web.http11`, what ``narwhal serve`` runs).

What it is not: a router. It parses no JSON, admits, places, checks and learns nothing, and
relays one engine. An engine that cannot be reached is a 502 with a one-line text body.

Why: issue 11 asks, for any relay target not met, for the measurement that shows why the
remaining time cannot go lower in this stack. :mod:`narwhal.bench.floor` is the cheapest relay
on Trio sockets, below the HTTP server the stack prescribes. This one keeps that server and the
ASGI boundary and drops everything Narwhal does: measured in the same rounds, what it adds
over the direct path is the stack's own price for an ASGI relay, and what Narwhal adds beyond
it is Narwhal's work.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import httpx
import trio
from hypercorn.trio import serve as hypercorn_serve

from narwhal.bench.floor import run_relay, upstream_address
from narwhal.server import hypercorn_config, lifespan, listening
from narwhal.upstream.transport import EngineTransport
from narwhal.web.http11 import Connections

__all__ = ["FRONTS", "MAX_BODY_BYTES", "Front", "StackFloorApp", "main", "serve_stack_floor"]

Front = Literal["hypercorn", "narwhal"]
FRONTS: tuple[Front, ...] = ("hypercorn", "narwhal")

MAX_BODY_BYTES = 16 * 1024 * 1024
"""The longest request body relayed; a longer one is answered 413."""

_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
_UPSTREAM_CONNECTIONS = 4096


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


class StackFloorApp:
    """The minimal ASGI relay: one engine at ``upstream_url``, bodies passed through."""

    def __init__(self, upstream_url: str) -> None:
        upstream_address(upstream_url)  # an engine at the root, over plain HTTP
        self._upstream = upstream_url.rstrip("/")
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._relay(scope, receive, send)
        # A WebSocket is never accepted (the app returns without accepting it).

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                transport = EngineTransport(max_connections=_UPSTREAM_CONNECTIONS, timeout=_TIMEOUT)
                self._client = httpx.AsyncClient(transport=transport, timeout=_TIMEOUT)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def aclose(self) -> None:
        """Close the engine connections (the lifespan's shutdown does; a cancelled serve must
        too)."""
        if self._client is not None:
            await self._client.aclose()

    async def _relay(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES:
                await _plain(send, 413, b"request body too large\n")
                return
            if not message.get("more_body", False):
                break
        assert self._client is not None, "the lifespan starts the client"
        url = self._upstream + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = {}
        content_type = _header(scope, b"content-type")
        if content_type is not None:
            headers["content-type"] = content_type.decode("latin-1")
        request = self._client.build_request(scope["method"], url, content=body, headers=headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError:
            await _plain(send, 502, b"the engine cannot be reached\n")
            return
        try:
            start: list[tuple[bytes, bytes]] = []
            if "content-type" in response.headers:
                start.append((b"content-type", response.headers["content-type"].encode()))
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": start}
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


async def _plain(send: Any, status: int, text: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(text)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text, "more_body": False})


async def serve_stack_floor(
    bind_port: int,
    upstream_url: str,
    *,
    front: Front = "narwhal",
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Relay ``host:bind_port`` (port 0 picks a free one) to ``upstream_url`` until cancelled.

    Args:
        bind_port: the port to listen on.
        upstream_url: the engine's base URL (``http://HOST[:PORT]``).
        front: the HTTP server: stock Hypercorn, or Narwhal's connection shell.
        host: the address to listen on.
        task_status: receives the bound port.

    Raises:
        ValueError: ``upstream_url`` is not ``http://HOST[:PORT]``, or ``front`` is unknown.
        OSError: the port cannot be bound.
    """
    if front not in FRONTS:
        raise ValueError(f"front: expected one of {FRONTS}, got {front!r}")
    app = StackFloorApp(upstream_url)
    settings = hypercorn_config(f"{host}:{bind_port}")
    try:
        if front == "hypercorn":
            async with trio.open_nursery() as nursery:
                urls: list[str] = await nursery.start(
                    partial(hypercorn_serve, app, settings, mode="asgi")  # type: ignore[arg-type]
                )
                task_status.started(_port(urls[0]))
            return
        sockets = settings.create_sockets().insecure_sockets
        async with lifespan(app, settings) as asgi:  # type: ignore[arg-type]
            connections = Connections(asgi, settings, header_timeout_s=10.0)
            async with trio.open_nursery() as handlers:
                try:
                    async with listening(sockets, settings.backlog) as (listeners, bound):
                        handlers.start_soon(
                            partial(trio.serve_listeners, connections.handle, listeners)
                        )
                        task_status.started(_port(bound[0]))
                        await trio.sleep_forever()
                finally:
                    connections.abort()
                    handlers.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await app.aclose()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m narwhal.bench.stack_floor",
        description="The cheapest relay an ASGI app on this stack can be (Hypercorn, h11, "
        "httpx), a measuring stick for `narwhal bench overhead --stack-floor`: bodies passed "
        "through, no JSON parsed. Not a router.",
    )
    parser.add_argument("--bind", required=True, metavar="HOST:PORT", help="where to listen")
    parser.add_argument("--upstream", required=True, metavar="URL", help="the engine's base URL")
    parser.add_argument(
        "--front",
        choices=FRONTS,
        default="narwhal",
        help="the HTTP server: stock Hypercorn, or Narwhal's connection shell (default)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the relay until SIGTERM or SIGINT (exit 0); 2 for a wrong command line or a port
    that cannot be bound."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    serve = partial(serve_stack_floor, front=args.front)
    return run_relay("stack floor", str(args.bind), args.upstream, serve)


if __name__ == "__main__":
    sys.exit(main())
