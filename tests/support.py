"""Test plumbing: the streaming ASGI transport and the lifespan runner are the product's
(:mod:`narwhal.bench.inprocess`, which the benchmarks use too); a few helpers of our own."""

from __future__ import annotations

from typing import Any

import httpx
import trio


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]


async def wait_ready(url: str, *, within_s: float = 20.0, step_s: float = 0.02) -> None:
    """Poll ``url``'s ``/ready`` until it answers 200, failing after ``within_s`` (real clock).

    Each poll opens its own connection: a pooled one can be closed by the router (at its
    header timeout, a few tenths of a second in some tests) just as the next poll is sent on
    it, and httpx does not resend. A poll that finds no server yet (a process still starting)
    is tried again.
    """
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        with trio.fail_after(within_s):
            while True:
                try:
                    if (await client.get(f"{url}/ready")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(step_s)


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
