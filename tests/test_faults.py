"""Broken engines and departing clients: never a hang, never a bare 500, always counted once."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.conftest import MODEL, Fleet, StartFleet
from tests.support import sse_payloads

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def fault(name: str, at: int = 0, **extra: Any) -> dict[str, Any]:
    return {"output_tokens": 6, "fault": name, "fault_at": at, **extra}


def received(fleet: Fleet) -> int:
    return fleet.completions_received()


@pytest.mark.parametrize("name", ["http_500", "http_503", "error_frame", "drop", "non_json"])
async def test_a_failure_before_headers_is_retried_on_the_other_engine(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, name: str
) -> None:
    fleet = await start_fleet()
    fleet.set_directives("sim-a", fault(name))
    for _ in range(4):  # whichever engine is chosen first, the answer is whole
        response = await fleet.chat(stream=True, narwhal_sim={"output_tokens": 3})
        assert response.status_code == 200
        assert sse_payloads(response.text)[-1] == "[DONE]"
    assert fleet.counters()["completed"] == 4
    assert fleet.counters()["offered"] == 4
    fleet.assert_quiescent()


@pytest.mark.parametrize(
    ("name", "code", "param"),
    [
        ("http_500", "engine_error", None),
        ("error_frame", "engine_error", None),
        ("truncate", "engine_error", None),
        ("malformed_token_ids", "malformed_engine_response", "choices[0].token_ids"),
        ("missing_token_ids", "malformed_engine_response", "choices[0].token_ids"),
        ("negative_token_id", "malformed_engine_response", "choices[0].token_ids"),
    ],
)
@pytest.mark.parametrize("stream", [True, False])
async def test_both_attempts_failing_is_a_502(
    start_fleet: StartFleet,
    autojump_clock: trio.testing.MockClock,
    name: str,
    code: str,
    param: str | None,
    stream: bool,
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(stream=stream, narwhal_sim=fault(name))
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["type"] == "upstream_error"
    assert (error["code"], error["param"]) == (code, param)
    assert received(fleet) == 2, "one retry, on the other engine"
    assert fleet.counters()["failed"] == 1
    fleet.assert_quiescent()


async def test_an_engine_4xx_keeps_its_status_and_is_not_retried(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(narwhal_sim=fault("http_400"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and isinstance(error["code"], str)
    assert not (error["param"] or "").startswith("body.")
    assert received(fleet) == 1
    assert fleet.counters()["invalid_requests"] == 1


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("error_frame", "engine_error"),
        ("drop", "engine_error"),
        ("truncate", "engine_error"),
        ("non_json", "malformed_engine_response"),
        ("malformed_token_ids", "malformed_engine_response"),
    ],
)
async def test_a_failure_after_headers_is_reported_in_band(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, name: str, code: str
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(stream=True, narwhal_sim=fault(name, at=3))
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    assert received(fleet) == 1, "no retry once headers went out"
    assert fleet.counters()["failed"] == 1
    fleet.assert_quiescent()


async def test_a_missing_done_after_the_finish_still_completes(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(stream=True, narwhal_sim=fault("no_done"))
    assert sse_payloads(response.text)[-1] == "[DONE]"
    assert fleet.counters()["completed"] == 1
    assembled = await fleet.chat(narwhal_sim=fault("no_done"))
    assert assembled.status_code == 200


async def test_non_streaming_is_not_retried_after_output(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(narwhal_sim=fault("error_frame", at=3))
    assert response.status_code == 502
    assert received(fleet) == 1


@pytest.mark.parametrize(
    ("name", "param"),
    [
        ("unsupported_field", "choices[0].delta.audio"),
        ("annotations", "choices[0].delta.annotations"),
    ],
)
async def test_assembly_refuses_unsupported_engine_fields(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, name: str, param: str
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(narwhal_sim=fault(name, at=2))
    assert response.status_code == 502
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_engine_field", param)
    fleet.assert_quiescent()


async def test_deadline_before_headers_is_a_504_at_exactly_the_deadline(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    start = trio.current_time()
    response = await fleet.client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "narwhal_sim": fault("stall")},
        headers={"x-narwhal-deadline-ms": "500"},
    )
    assert trio.current_time() - start == pytest.approx(0.5)
    assert response.status_code == 504
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["code"] == "request_deadline_expired"
    assert fleet.counters()["expired"] == 1
    await trio.sleep(0.01)
    assert sum(sim.statistics().streams_open for sim in fleet.sims.values()) == 0
    fleet.assert_quiescent()


async def test_the_smaller_deadline_header_wins(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    start = trio.current_time()
    await fleet.client.post(
        "/v1/chat/completions",
        json={**CHAT, "narwhal_sim": fault("stall")},
        headers={"x-narwhal-deadline-ms": "900", "x-envoy-expected-rq-timeout-ms": "300"},
    )
    assert trio.current_time() - start == pytest.approx(0.3)


async def test_deadline_after_headers_ends_the_stream_in_band(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    start = trio.current_time()
    response = await fleet.client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "narwhal_sim": fault("stall", at=2)},
        headers={"x-narwhal-deadline-ms": "2000"},
    )
    assert trio.current_time() - start == pytest.approx(2.0)
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "request_deadline_expired"
    assert fleet.counters()["expired"] == 1
    fleet.assert_quiescent()


async def test_client_disconnect_mid_stream_closes_the_upstream_at_once(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    sim = fleet.sims["sim-a"]
    async with fleet.client.stream(
        "POST",
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "narwhal_sim": {"output_tokens": 1000, "itl_s": 0.1}},
    ) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break
        assert sim.statistics().streams_open == 1
        closed_at = trio.current_time()
    with trio.fail_after(1):
        await sim.wait_until(lambda stats: stats.streams_open == 0)
    assert trio.current_time() - closed_at < 0.01
    assert sim.statistics().streams_closed_early == 1
    assert fleet.counters()["cancelled"] == 1
    fleet.assert_quiescent()


async def test_client_disconnect_before_headers_is_cancelled(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    with trio.move_on_after(1):
        await fleet.chat(stream=True, narwhal_sim=fault("stall"))
    with trio.fail_after(1):
        await fleet.sims["sim-a"].wait_until(lambda stats: stats.streams_open == 0)
    await trio.sleep(0.001)  # let the handler finish its bookkeeping after the close
    assert fleet.counters()["cancelled"] == 1
    assert fleet.sims["sim-a"].statistics().streams_open == 0
    fleet.assert_quiescent()


async def test_an_engine_ignoring_return_token_ids_is_reported_unavailable(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(
        [("sim-old", "vllm")], directives={"sim-old": {"ignore_token_ids": True}}
    )
    ready = fleet.router.statistics().as_json()
    assert ready["engines"][0]["token_accounting"] == "unavailable"
    response = await fleet.chat(stream=True, narwhal_sim={"output_tokens": 3})
    assert response.status_code == 200
    assert "return_token_ids" not in fleet.sims["sim-old"].requests[-1]


async def test_an_unreachable_engine_leaves_placement_and_rejoins(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    fleet.plugs["sim-a"].down = True
    for _ in range(3):  # whichever engine is tried first, the answer comes from sim-b
        assert (await fleet.chat(narwhal_sim={"output_tokens": 2})).status_code == 200
    engines = {engine["name"]: engine for engine in fleet.router.statistics().as_json()["engines"]}
    assert engines["sim-a"]["eligible"] is False
    assert "unreachable" in engines["sim-a"]["reason"]
    fleet.plugs["sim-a"].down = False
    monitoring = fleet.router.config.monitoring
    await trio.sleep(monitoring.breaker_open_s + monitoring.poll_interval_s)  # the half-open probe
    assert fleet.router.pool.engines[0].eligible


async def test_when_every_engine_is_unreachable_queued_requests_get_503(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    fleet.plugs["sim-a"].down = True
    first = await fleet.chat()
    assert first.status_code == 502  # the attempt that found it dead
    second = await fleet.chat()
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "backend_unavailable"
    assert (await fleet.client.get("/ready")).status_code == 503
    fleet.assert_quiescent()
