"""Generated hostile bodies on both completion routes: never a 500, never a leak, books balance.

Each Hypothesis example is a batch of bodies sent through one fresh fleet (virtual time), then
the books are checked against the client's own tally and every gauge must read zero: a body
that makes the router fail after taking a slot (issue item 2: 300 nested arrays) leaves a gauge
up, and enough of them wedge the fleet, which the batch's last, plain request would show.
"""

from __future__ import annotations

import json

import pytest
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from narwhal.config import AdmissionConfig, Config
from tests.chaos.strategies import (
    chat_bodies,
    completion_bodies,
    deep_bodies,
    hostile_bodies,
    raw_bodies,
)
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

# Deterministic and bounded: the same examples on every run, no per-example deadline (the fleet
# starts inside each example), and the clock fixture shared by the examples on purpose.
CHAOS = settings(
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a failure names its body anyway
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PLAIN = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "plain"}], "max_tokens": 3}
).encode()
SIM = {"sim-a": {"output_tokens": 3}, "sim-b": {"output_tokens": 3}}


def small_fleet_config() -> Config:
    # Few slots, so that a handful of leaked ones wedges the fleet within one batch.
    return chaos_config(admission=AdmissionConfig(prefill_concurrency=2, admission_wait_s=5))


async def send(fleet: Fleet, tally: Tally, path: str, raw: bytes, kind: str = "bodies") -> None:
    start = trio.current_time()
    with tally.request(), trio.fail_after(400):
        response = await fleet.client.post(
            path, content=raw, headers={"content-type": "application/json"}
        )
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    answer = check_answer(
        response.status_code, response.content, streamed=streamed, where=f"{path} {raw[:200]!r}"
    )
    tally.end(answer.terminal)
    count_case(kind, answer.code or answer.status, latency_s=trio.current_time() - start)


async def run_batch(route: str, bodies: list[bytes]) -> None:
    async with open_fleet(small_fleet_config(), directives=SIM) as fleet:
        tally = Tally()
        for raw in bodies:
            await send(fleet, tally, ROUTES[route], raw)
        # A plain request after the batch: a fleet whose slots leaked cannot serve it.
        await send(fleet, tally, ROUTES["chat"], PLAIN)
        assert tally.ended["completed"] >= 1, "the plain request after the batch failed"
        await settle_and_check(fleet.router, tally, client=fleet.client)


@settings(CHAOS, max_examples=60)
@given(bodies=st.lists(chat_bodies(), min_size=4, max_size=8))
async def test_generated_chat_bodies(
    autojump_clock: trio.testing.MockClock, bodies: list[bytes]
) -> None:
    await run_batch("chat", bodies)


@settings(CHAOS, max_examples=40)
@given(bodies=st.lists(completion_bodies(), min_size=4, max_size=8))
async def test_generated_completion_bodies(
    autojump_clock: trio.testing.MockClock, bodies: list[bytes]
) -> None:
    await run_batch("completions", bodies)


@settings(CHAOS, max_examples=40)
@given(bodies=st.lists(raw_bodies(), min_size=4, max_size=8))
async def test_generated_raw_bodies(
    autojump_clock: trio.testing.MockClock, bodies: list[bytes]
) -> None:
    await run_batch("chat", bodies)


@settings(CHAOS, max_examples=25)
@given(
    chat=st.lists(deep_bodies(True), min_size=4, max_size=6),
    completion=st.lists(deep_bodies(False), min_size=2, max_size=3),
)
async def test_deeply_nested_bodies_never_leak_a_slot(
    autojump_clock: trio.testing.MockClock, chat: list[bytes], completion: list[bytes]
) -> None:
    async with open_fleet(small_fleet_config(), directives=SIM) as fleet:
        tally = Tally()
        for raw in chat:
            await send(fleet, tally, ROUTES["chat"], raw)
        for raw in completion:
            await send(fleet, tally, ROUTES["completions"], raw)
        await send(fleet, tally, ROUTES["chat"], PLAIN)
        await settle_and_check(fleet.router, tally, client=fleet.client)


async def test_three_hundred_nested_arrays_ten_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue item 2 exactly: a 400 (or relayed), never a 500, and no slot leaks."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "extra": "__N__"}
    ).encode()
    raw = body.replace(b'"__N__"', b"[" * 300 + b"]" * 300)
    async with open_fleet(small_fleet_config(), directives=SIM) as fleet:
        tally = Tally()
        for _ in range(10):
            await send(fleet, tally, ROUTES["chat"], raw)
        start = trio.current_time()
        await send(fleet, tally, ROUTES["chat"], PLAIN)
        assert trio.current_time() - start < 1, "the plain request waited for a leaked slot"
        await settle_and_check(fleet.router, tally, client=fleet.client)


@pytest.mark.realtime
@settings(CHAOS, max_examples=2)
@given(
    chat=st.lists(hostile_bodies(True), min_size=25, max_size=25),
    completion=st.lists(hostile_bodies(False), min_size=10, max_size=10),
)
async def test_generated_bodies_over_a_real_socket(
    chat: list[bytes], completion: list[bytes]
) -> None:
    """The same bodies through Hypercorn: what the socket layer adds must not change a verdict."""
    import httpx

    config = small_fleet_config()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            transports = sim_transports(config.engines, SIM, time_scale=0.05)
            url, _ = await serve_router(nursery, config, transports)
            tally = Tally()
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for route, raw in (
                    [("chat", b) for b in chat]
                    + [("completions", b) for b in completion]
                    + [("chat", PLAIN)]
                ):
                    with tally.request():
                        response = await client.post(
                            ROUTES[route], content=raw, headers={"content-type": "application/json"}
                        )
                    streamed = response.headers.get("content-type", "").startswith(
                        "text/event-stream"
                    )
                    answer = check_answer(
                        response.status_code,
                        response.content,
                        streamed=streamed,
                        where=f"{route} {raw[:200]!r}",
                    )
                    tally.end(answer.terminal)
            await served_books(url, tally)
            nursery.cancel_scope.cancel()
