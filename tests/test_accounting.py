"""The conservation law under random load and faults, in virtual time.

``offered = sum(terminal classes) + in_flight`` must hold at every instant, and once the load
stops every ``statistics()`` returns to zero: no slot, retention or queue entry leaks.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from narwhal.admission.accounting import Accounting
from narwhal.config import AdmissionConfig
from tests.conftest import MODEL, Fleet, StartFleet

FAULTS = [
    None,
    None,
    None,
    "http_500",
    "error_frame",
    "drop",
    "truncate",
    "malformed_token_ids",
    "stall",
    "non_json",
]


class Clients:
    """What the load itself knows: requests sent, and requests still waiting for their end."""

    sent = 0
    live = 0


def check_law(fleet: Fleet, clients: Clients | None = None) -> None:
    books = fleet.router.statistics().accounting
    # in_flight is the router's set of open tickets, counted apart from the counters.
    assert books.offered == sum(books.terminal.values()) + books.in_flight
    fleet.router.accounting.check()
    if clients is not None:
        # A request the router holds is one a client still waits on; none is invented.
        assert books.offered <= clients.sent
        assert books.in_flight <= clients.live


async def one_request(fleet: Fleet, rng: random.Random, clients: Clients) -> None:
    clients.sent += 1
    clients.live += 1
    try:
        await _one_request(fleet, rng, clients)
    finally:
        clients.live -= 1


async def _one_request(fleet: Fleet, rng: random.Random, clients: Clients) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "stream": rng.random() < 0.6,
        "narwhal_sim": {"output_tokens": rng.randint(1, 30)},
    }
    if rng.random() < 0.05:
        body["n"] = 2  # invalid
    if fleet.router.config.engines and rng.random() < 0.3:
        body["messages"] = [{"role": "user", "content": "word " * rng.randint(1, 3000)}]
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    fault = rng.choice(FAULTS)
    if fault is not None:
        body["narwhal_sim"].update(fault=fault, fault_at=rng.randint(0, 5), stall_s=5.0)
    headers = {}
    if rng.random() < 0.2:
        headers["x-narwhal-deadline-ms"] = str(rng.randint(50, 3000))
    patience = rng.uniform(0.0, 2.0) if rng.random() < 0.3 else 3600.0
    with trio.move_on_after(patience):
        async with fleet.client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as response:
            async for _ in response.aiter_raw():
                check_law(fleet, clients)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["open", "predictive"])
async def test_conservation_under_random_load_and_faults(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, seed: int, mode: str
) -> None:
    rng = random.Random(seed)
    fleet = await start_fleet(
        [("sim-a", "vllm"), ("sim-b", "vllm"), ("sim-c", "sglang")],
        admission=AdmissionConfig(
            mode=mode,  # type: ignore[arg-type]
            http_retention_limit=40,
            queue_limit=12,
            admission_wait_s=1.5,
            prefill_concurrency=2,
            decode_concurrency=6,
            ttft_budget_s=0.8,
        ),
    )
    clients = Clients()
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for _ in range(150):
                nursery.start_soon(one_request, fleet, random.Random(rng.random()), clients)
                check_law(fleet, clients)
                await trio.sleep(rng.expovariate(40))
                if rng.random() < 0.03:
                    engine = rng.choice(list(fleet.sims))
                    fault = rng.choice([{}, {}, {"fault": "http_503"}])
                    fleet.set_directives(engine, fault)
        for name in fleet.sims:
            fleet.set_directives(name, {})
    await trio.sleep(1)
    stats = fleet.router.statistics()
    fleet.assert_quiescent()
    assert stats.retention.in_use == 0
    assert stats.queue.depth == 0
    for engine in fleet.router.pool:
        assert engine.forecast.in_prefill == 0 and engine.forecast.decoding == 0
        assert engine.forecast.decode_context == 0
    terminal = stats.accounting.terminal
    assert sum(terminal.values()) == stats.accounting.offered == clients.sent == 150
    assert clients.live == 0
    # The mix really exercised the classes.
    assert terminal["completed"] > 0 and terminal["failed"] > 0
    assert terminal["invalid_requests"] > 0
    assert sum(1 for count in terminal.values() if count) >= 4, terminal


def test_a_ticket_cannot_be_counted_twice() -> None:
    books = Accounting()
    ticket = books.offer()
    ticket.finish("completed")
    with pytest.raises(RuntimeError):
        ticket.finish("failed")
    stats = books.statistics()
    assert stats.offered == 1 and stats.terminal["completed"] == 1 and stats.in_flight == 0


def test_in_flight_is_the_set_of_open_tickets_and_the_check_can_fail() -> None:
    books = Accounting()
    first, second = books.offer(), books.offer()
    assert books.statistics().in_flight == 2
    first.finish("completed")
    assert books.statistics().in_flight == 1
    books.check()
    books._terminal["completed"] += 1  # a request counted twice behind the ticket's back
    with pytest.raises(AssertionError, match="conservation law broken"):
        books.check()
    second.finish("failed")


def test_a_ticket_left_open_is_counted_by_how_its_request_ended() -> None:
    books = Accounting()
    with books.offer() as ticket:
        ticket.finish("completed")
    with pytest.raises(ValueError), books.offer():
        raise ValueError("a bug")
    with pytest.raises(KeyboardInterrupt), books.offer():
        raise KeyboardInterrupt
    stats = books.statistics()
    assert stats.by_reason[("failed", "internal_error")] == 1
    assert stats.terminal["cancelled"] == 1
    assert stats.in_flight == 0
