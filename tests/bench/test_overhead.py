"""The overhead benchmark's rounds, over mock targets in virtual time."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import trio

from narwhal.bench import load
from narwhal.bench.overhead import Level, OverheadSettings, _measure_level, _Target

CHUNKS = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
    b"data: [DONE]\n\n",
)


async def stream() -> AsyncIterator[bytes]:
    """A streamed body (a body given as bytes is read at once and cannot be streamed)."""
    for chunk in CHUNKS:
        yield chunk


class IdleClosingServer:
    """A target that answers after ``delay_s``, and closes a connection left idle longer than
    ``idle_close_s`` the way a server does: a request sent on it fails."""

    def __init__(self, *, delay_s: float, idle_close_s: float) -> None:
        self.delay_s = delay_s
        self.idle_close_s = idle_close_s
        self.requests = 0

    def client(self) -> httpx.AsyncClient:
        last_answer: list[float] = []

        async def handle(request: httpx.Request) -> httpx.Response:
            if last_answer and trio.current_time() - last_answer[-1] > self.idle_close_s:
                last_answer.clear()  # httpx drops the connection and opens a new one
                raise httpx.RemoteProtocolError("Server disconnected", request=request)
            self.requests += 1
            await trio.sleep(self.delay_s)
            last_answer.append(trio.current_time())
            return httpx.Response(200, content=stream())

        return httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://t")


async def test_no_measured_request_meets_a_connection_the_other_rounds_left_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Each target's round takes 12 s of virtual time (4 requests, 2 at once, 6 s each), so
    # between its own rounds a target's connections sit idle past a 10 s idle close.
    servers = {name: IdleClosingServer(delay_s=6.0, idle_close_s=10.0) for name in ("a", "b")}
    targets = [_Target(name=name, url="http://t", service=None) for name in servers]
    settings = OverheadSettings(levels=(Level(2, 8),), warmup=2, rounds=2, vllm_router=False)
    async with load.ClientPool(servers["a"].client) as a, load.ClientPool(servers["b"].client) as b:
        pools = {"a": a, "b": b}
        with trio.fail_after(600):
            report, _ = await _measure_level(
                settings,
                settings.levels[0],
                targets,
                None,
                pools,
                lambda index: load.chat_body("m", output_tokens=1, index=index),
            )
        assert a.size == b.size == 2  # the stale connections were closed, not kept
    for result in report.results:
        assert (result.requests, result.errors) == (8, 0), result.error_kinds
    # Warm-up (2 each, "a" then "b"), then rounds of 4 ("a" "b", then "b" "a"). Every round
    # that follows the other target's is preceded by 2 requests on new connections: "a"'s
    # first (idle 6 s since its warm-up: past reuse, not yet closed) and second, "b"'s first.
    assert (servers["a"].requests, servers["b"].requests) == (2 + 2 + 4 + 2 + 4, 2 + 2 + 4 + 4)
