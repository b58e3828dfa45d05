"""Hundreds of clients leaving at every point, slow readers, and the conservation law counted by
the client (virtual time).

The client keeps its own books (:class:`~tests.chaos.support.Tally`): requests sent and not yet
ended are live. While every request is parked (streaming, stalled before headers, queued), the
router's ``in_flight`` and ``offered - sum(terminals)`` from ``/ready`` must both equal that
count; after the disconnects every one of them must be ``cancelled`` (issue item 7), none
``failed``, and every gauge back to zero.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import AdmissionConfig
from tests.chaos.support import (
    Tally,
    chaos_config,
    check_answer,
    count_case,
    open_fleet,
    serve_router,
    served_books,
    settle_and_check,
    sim_transports,
)
from tests.conftest import MODEL, Fleet
from tests.support import until

CHAT = "/v1/chat/completions"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


async def ready_counters(fleet: Fleet) -> dict[str, int]:
    counters: dict[str, int] = (await fleet.client.get("/ready")).json()["counters"]
    return counters


def ended(counters: dict[str, int]) -> int:
    return sum(
        v for k, v in counters.items() if k not in ("offered", "unsized_offered", "in_flight")
    )


async def assert_conserved(fleet: Fleet, tally: Tally) -> None:
    """The law from both sides: the router's two readings and the client's own count agree."""
    counters = await ready_counters(fleet)
    assert counters["offered"] == tally.sent, (counters, tally)
    assert counters["in_flight"] == tally.live, (counters, tally)
    assert counters["offered"] - ended(counters) == tally.live, (counters, tally)
    check = getattr(fleet.router.accounting, "check", None)  # the books' own audit, if any
    if check is not None:
        check()


async def test_hundreds_of_disconnects_at_every_point_are_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = chaos_config(
        admission=AdmissionConfig(
            mode="open", prefill_concurrency=2, queue_limit=1024, admission_wait_s=600
        )
    )
    streaming, stalled, queued, normal = 160, 100, 60, 40
    async with open_fleet(config) as fleet:
        tally = Tally()
        parked = 0
        leave = trio.Event()
        scopes: list[trio.CancelScope] = []

        async def mid_stream(index: int) -> None:
            nonlocal parked
            body = chat(stream=True, narwhal_sim={"output_tokens": 2000, "itl_s": 0.05})
            with tally.request():
                async with fleet.client.stream("POST", CHAT, json=body) as response:
                    assert response.status_code == 200
                    lines = response.aiter_lines()
                    async for line in lines:
                        if '"content":"' in line and '"content":""' not in line:
                            break
                    parked += 1
                    await leave.wait()
                    # Leave at different points: some right away, some after more tokens.
                    for _ in range(index % 7):
                        await lines.__anext__()
            tally.end("cancelled")
            count_case("disconnect", "mid-stream")

        async def parked_request(body: dict[str, Any], kind: str) -> None:
            with tally.request():
                response = None
                with trio.CancelScope() as scope:
                    scopes.append(scope)
                    response = await fleet.client.post(CHAT, json=body)
                assert scope.cancelled_caught, f"a parked request ended: {response.text[:300]}"
            tally.end("cancelled")
            count_case("disconnect", kind)

        async def normal_one() -> None:
            with tally.request():
                response = await fleet.client.post(
                    CHAT, json=chat(stream=True, narwhal_sim={"output_tokens": 3})
                )
            answer = check_answer(response.status_code, response.content, streamed=True)
            tally.end(answer.terminal)

        with trio.fail_after(600):
            async with trio.open_nursery() as clients:
                for index in range(streaming):
                    clients.start_soon(mid_stream, index)
                await until(lambda: parked == streaming)
                # Every prefill slot is free again (the streams decode): these stall in a
                # placed prefill, and the rest of them, and the queued ones, wait in the queue.
                for _ in range(stalled):
                    body = chat(stream=True, narwhal_sim={"fault": "stall", "output_tokens": 3})
                    clients.start_soon(parked_request, body, "before headers")
                await until(
                    lambda: fleet.router.accounting.statistics().offered == streaming + stalled
                )
                for _ in range(queued):
                    clients.start_soon(parked_request, chat(max_tokens=3), "queued")
                total = streaming + stalled + queued
                await until(lambda: fleet.router.accounting.statistics().offered == total)
                await trio.sleep(1)
                assert tally.live == total
                await assert_conserved(fleet, tally)
                assert fleet.router.statistics().queue.depth > 0, "nothing is queued"
                # Everyone leaves, in waves, while normal requests come and go.
                leave.set()
                for number, scope in enumerate(reversed(scopes)):  # the queued first
                    if number % 20 == 0:
                        await trio.sleep(0.013)
                    scope.cancel()
                for _ in range(normal):
                    clients.start_soon(normal_one)
            counters = await settle_and_check(fleet.router, tally, client=fleet.client)
        assert counters["cancelled"] == total, counters
        assert counters["failed"] == 0, fleet.router.statistics().accounting.by_reason
        for sim in fleet.sims.values():
            assert sim.statistics().streams_open == 0


async def test_a_disconnect_racing_the_last_byte_is_counted_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Clients leaving around the end of their stream: completed or cancelled, never both,
    never failed; the books balance whichever it was."""
    async with open_fleet(chaos_config(admission=AdmissionConfig(mode="open"))) as fleet:
        tally = Tally()

        async def leave_after(lines: int) -> None:
            body = chat(stream=True, narwhal_sim={"output_tokens": 6, "itl_s": 0.01})
            with tally.request():
                async with fleet.client.stream("POST", CHAT, json=body) as response:
                    seen = 0
                    async for _ in response.aiter_lines():
                        seen += 1
                        if seen >= lines:
                            break

        with trio.fail_after(120):
            async with trio.open_nursery() as clients:
                for lines in range(1, 40):
                    clients.start_soon(leave_after, lines)
            counters = await settle_and_check(fleet.router, exact_classes=False)
        assert counters["offered"] == tally.sent
        assert counters["failed"] == 0, fleet.router.statistics().accounting.by_reason
        assert counters["completed"] + counters["cancelled"] == tally.sent, counters


async def test_slow_readers_do_not_hold_back_others(autojump_clock: trio.testing.MockClock) -> None:
    """Clients reading a stream one line a second hold only their own request."""
    config = chaos_config(admission=AdmissionConfig(mode="open", prefill_concurrency=2))
    async with open_fleet(config) as fleet:
        tally = Tally()

        async def timed_normal() -> float:
            began = trio.current_time()
            with tally.request():
                response = await fleet.client.post(
                    CHAT, json=chat(stream=True, narwhal_sim={"output_tokens": 20})
                )
            tally.end(check_answer(response.status_code, response.content, streamed=True).terminal)
            return trio.current_time() - began

        alone = await timed_normal()
        slow_done = 0

        async def slow_reader() -> None:
            nonlocal slow_done
            body = chat(stream=True, narwhal_sim={"output_tokens": 200, "itl_s": 0.001})
            text = ""
            with tally.request():
                async with fleet.client.stream("POST", CHAT, json=body) as response:
                    async for line in response.aiter_lines():
                        text += line + "\n"
                        await trio.sleep(1)
            # Reading slower than the request deadline allows ends in-band (expired): fine.
            answer = check_answer(200, text.replace("\n\n\n", "\n\n").encode(), streamed=True)
            tally.end(answer.terminal)
            slow_done += 1

        with trio.fail_after(3600):
            async with trio.open_nursery() as clients:
                for _ in range(30):
                    clients.start_soon(slow_reader)
                await trio.sleep(5)  # the slow readers' engines have long finished generating
                stats = fleet.router.statistics()
                assert all(engine.prefill == 0 for engine in stats.engines), stats.engines
                worst = 0.0
                for _ in range(20):
                    worst = max(worst, await timed_normal())
                assert slow_done == 0, "the slow readers were not slow"
                assert worst < alone * 3 + 0.5, (alone, worst)
                count_case("slow readers", "others served", latency_s=worst)
            await settle_and_check(fleet.router, tally, client=fleet.client)


@pytest.mark.realtime
async def test_mass_disconnects_over_real_sockets_are_cancelled(nursery: trio.Nursery) -> None:
    """The same through Hypercorn: sockets closed mid-stream (some reset) and before headers.

    A write to a connection the client closed fails in the serving layer, not in the relay's
    own code: that is where a disconnect could be miscounted ``failed/internal_error``.
    """
    config = chaos_config(
        admission=AdmissionConfig(mode="open", prefill_concurrency=2, admission_wait_s=600)
    )
    url, port = await serve_router(nursery, config, sim_transports(config.engines, time_scale=0.2))
    streaming, early = 100, 60
    tally = Tally()
    offered = trio.Event()

    def head(body: bytes) -> bytes:
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    long_stream = json.dumps(
        chat(stream=True, narwhal_sim={"output_tokens": 1000, "itl_s": 0.25})
    ).encode()
    stalled = json.dumps(chat(stream=True, narwhal_sim={"fault": "stall"})).encode()

    async def client(index: int, body: bytes, wait_for_bytes: int) -> None:
        with tally.request():
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                await stream.send_all(head(body))
                received = b""
                while len(received) < wait_for_bytes:
                    data = await stream.receive_some(65536)
                    assert data, f"the router closed a live stream: {received[:300]!r}"
                    received += data
                await offered.wait()  # every request reached the router: now leave
                if index % 3 == 0:  # an abortive close: the router's next write meets a reset
                    stream.socket.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
            finally:
                await stream.aclose()
        tally.end("cancelled")
        count_case("disconnect (socket)", "mid-stream" if wait_for_bytes else "before headers")

    with trio.fail_after(60):
        async with trio.open_nursery() as clients:
            for index in range(streaming):
                clients.start_soon(client, index, long_stream, 2000 + 97 * (index % 11))
            for index in range(early):
                clients.start_soon(client, index, stalled, 0)
            # 160 connections arrive at once: /ready may take a while, fail_after bounds it.
            async with httpx.AsyncClient(timeout=30) as http:
                while (await http.get(f"{url}/ready")).json()["counters"]["offered"] < (  # noqa: ASYNC110
                    streaming + early
                ):
                    await trio.sleep(0.02)
            offered.set()
        await served_books(url, tally)
        async with httpx.AsyncClient() as http:
            counters = (await http.get(f"{url}/ready")).json()["counters"]
        assert counters["cancelled"] == streaming + early, counters
        assert counters["failed"] == 0, counters
