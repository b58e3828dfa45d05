"""An engine's 503 (vLLM's ``--max-num-queued-tokens`` refusing work) is not the engine failing.

It is retried once on another engine, like any 5xx before headers, but it opens no circuit and
does not count in the engine's ``failed``.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from narwhal.errors import EngineBusy
from narwhal.upstream.client import normalise_engine_error
from tests.conftest import StartFleet

REFUSAL = (
    b'{"error":{"message":"The engine has reached its prefill token backlog limit. Please try'
    b' again later or on a different instance.","type":"Service Unavailable","param":null,'
    b'"code":503}}'
)


def test_a_503_is_busy_and_other_5xx_are_not() -> None:
    busy = normalise_engine_error("sim-a", 503, REFUSAL)
    assert isinstance(busy, EngineBusy)
    assert busy.message == (
        "engine sim-a answered HTTP 503: The engine has reached its prefill token backlog "
        "limit. Please try again later or on a different instance."
    )
    assert not isinstance(normalise_engine_error("sim-a", 500, b""), EngineBusy)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_full_engine_is_retried_elsewhere_and_not_counted_as_failing(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    fleet = await start_fleet()
    full = fleet.sims["sim-a"].engine
    full.max_num_queued_tokens = 0  # vLLM: 0 >= 0 refuses everything
    planned = full.statistics().requests
    with trio.fail_after(30):
        for _ in range(4):  # whichever engine is chosen first, the answer is whole
            response = await fleet.chat(stream=stream, narwhal_sim={"output_tokens": 3})
            assert response.status_code == 200, response.text
    refused = full.statistics().rejected_queued_tokens
    # Every request sim-a received was refused and retried once, on sim-b.
    assert refused == full.statistics().requests - planned
    assert fleet.completions_received() == 4 + refused
    assert fleet.counters()["completed"] == 4
    engines = {engine.name: engine for engine in fleet.router.statistics().engines}
    assert engines["sim-a"].failed == 0
    assert engines["sim-a"].eligible and engines["sim-a"].state == engines["sim-b"].state
    fleet.assert_quiescent()


async def test_both_engines_full_is_the_502_after_the_retry(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    for sim in fleet.sims.values():
        sim.engine.max_num_queued_tokens = 0
    with trio.fail_after(30):
        response = await fleet.chat(stream=True)
    assert response.status_code == 502, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["code"] == "engine_error"
    assert fleet.completions_received() == 2, "one retry, on the other engine"
    engines = fleet.router.statistics().engines
    assert [engine.failed for engine in engines] == [0, 0]
    assert all(engine.eligible for engine in engines)
    fleet.assert_quiescent()
