"""A request's life, whatever ends it: resources given back, the right terminal class, in time.

In virtual time, against in-process simulated engines. Each test here would have caught one of
the defects of the hardening issue: a body that leaked its engine slot, a freed prefill slot
that woke nobody, a disconnect counted as a failure, a finished stream counted as failed, the
shutdown's cut.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.config import AdmissionConfig, MonitoringConfig, ServingConfig
from narwhal.upstream.exchange import AFTER_COMPLETE_S
from tests.conftest import MODEL, Fleet, StartFleet, engine_config
from tests.support import sse_payloads, until

OPEN = AdmissionConfig(mode="open")


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


async def first_output_times(fleet: Fleet, count: int, **body: Any) -> list[float]:
    """Send ``count`` streams at once; the virtual time each one's first content arrived."""
    times: list[float] = [0.0] * count

    async def one(index: int) -> None:
        payload = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            **body,
        }
        async with fleet.client.stream("POST", "/v1/chat/completions", json=payload) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not times[index] and '"content":"' in line.replace(" ", ""):
                    if '"content":""' not in line.replace(" ", ""):
                        times[index] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(one, index)
    return times


async def test_a_body_too_deep_to_forward_is_a_400_and_leaks_no_slot(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(admission=AdmissionConfig(prefill_concurrency=1))
    for _ in range(10):  # more than the pool's prefill slots
        response = await fleet.chat(extra=nested(300))
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request", "extra")
    with trio.fail_after(5):
        assert (await fleet.chat()).status_code == 200
    fleet.assert_quiescent()
    assert fleet.counters()["invalid_requests"] == 10


async def test_a_first_token_frees_the_prefill_slot_for_the_queue_at_once(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(
        [engine_config("sim-a")],
        admission=AdmissionConfig(mode="open", prefill_concurrency=1),
    )
    start = trio.current_time()
    with trio.fail_after(60):
        times = await first_output_times(
            fleet, 2, narwhal_sim={"ttft_s": 0.5, "itl_s": 0.05, "output_tokens": 100}
        )
    # The second waits for the first's prefill (0.5 s), not for its 5 s of decoding.
    assert sorted(t - start for t in times) == pytest.approx([0.5, 1.0], abs=1e-9)
    fleet.assert_quiescent()


async def test_forty_long_streams_on_two_engines_are_all_placed_while_they_decode(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    # The directives' 0.1 s first tokens are ten times what the engines' forecast predicts:
    # drift would take an engine out of placement (severe), so profiling (and with it the
    # drift hold) is off.
    fleet = await start_fleet(
        admission=AdmissionConfig(mode="open", prefill_concurrency=4),
        monitoring=MonitoringConfig(profiling=False),
    )
    start = trio.current_time()
    with trio.fail_after(120):
        times = await first_output_times(
            fleet, 40, narwhal_sim={"ttft_s": 0.1, "itl_s": 0.05, "output_tokens": 400}
        )
    # Eight prompts at a time, 0.1 s each: five rounds, all before the first stream ends (20 s).
    assert max(times) - start == pytest.approx(0.5, abs=1e-9)
    fleet.assert_quiescent()
    assert fleet.counters()["completed"] == 40


async def test_a_client_gone_mid_stream_is_cancelled_and_the_engine_stops(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "narwhal_sim": {"output_tokens": 1000, "itl_s": 0.01},
    }
    for _ in range(20):
        async with fleet.client.stream("POST", "/v1/chat/completions", json=payload) as response:
            lines = response.aiter_lines()
            for _ in range(5):
                await lines.__anext__()
    with trio.fail_after(10):
        await until(lambda: fleet.router.in_flight() == 0)
    counters = fleet.counters()
    assert (counters["cancelled"], counters["failed"]) == (20, 0)
    fleet.assert_quiescent()
    closed = sum(sim.statistics().streams_closed_early for sim in fleet.sims.values())
    assert closed == 20


async def test_a_client_gone_while_queued_is_cancelled_and_leaves_the_queue(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(
        [engine_config("sim-a")],
        admission=AdmissionConfig(mode="open", prefill_concurrency=1),
    )
    slow = {"narwhal_sim": {"ttft_s": 10.0, "output_tokens": 1}}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: fleet.chat(**slow))
        await until(lambda: fleet.router.statistics().engines[0].prefill == 1)
        with trio.move_on_after(1):
            await fleet.chat()  # queued behind the 10 s prefill; the client gives up
        await until(lambda: fleet.router.statistics().queue.depth == 0)
        assert fleet.counters()["cancelled"] == 1
    fleet.assert_quiescent()
    assert fleet.counters()["completed"] == 1


class IdleAfterAnswer(httpx.AsyncBaseTransport):
    """An engine that sends its whole answer but, instead of ``data: [DONE]``, idles."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.closed = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("completions"):
            return response
        transport = self

        class Idle(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for part in response.aiter_raw():
                    kept = part.replace(b"data: [DONE]\n\n", b"")
                    if kept:
                        yield kept
                await trio.sleep_forever()

            async def aclose(self) -> None:
                transport.closed += 1
                await response.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Idle())


async def test_an_engine_that_idles_after_a_complete_answer_has_still_answered(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([engine_config("sim-a")])
    idle = IdleAfterAnswer(fleet.plugs["sim-a"].inner)
    fleet.plugs["sim-a"].inner = idle
    start = trio.current_time()
    with trio.fail_after(30):
        response = await fleet.chat(
            stream=True,
            stream_options={"include_usage": True},
            narwhal_sim={"output_tokens": 3, "ttft_s": 0.1, "itl_s": 0.1},
        )
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 3
    assert not any('"error"' in payload for payload in payloads)
    # Its last event came at 0.3 s; it is waited for no longer than AFTER_COMPLETE_S.
    assert trio.current_time() - start == pytest.approx(0.3 + AFTER_COMPLETE_S, abs=1e-9)
    with trio.fail_after(30):
        assembled = await fleet.chat(narwhal_sim={"output_tokens": 3})
    assert assembled.status_code == 200
    assert assembled.json()["usage"]["completion_tokens"] == 3
    assert fleet.counters()["completed"] == 2
    assert idle.closed == 2
    fleet.assert_quiescent()


async def test_a_502_after_both_engines_failed_names_both(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(narwhal_sim={"fault": "http_500"})
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "sim-a" in message and "sim-b" in message
    assert "Error(" not in message
    fleet.assert_quiescent()


async def test_a_shutdown_ends_running_streams_in_band_and_refuses_new_requests(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    router = fleet.router
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "narwhal_sim": {"output_tokens": 10_000, "itl_s": 0.01},
    }
    texts: list[str] = []

    async def stream() -> None:
        async with fleet.client.stream("POST", "/v1/chat/completions", json=payload) as response:
            texts.append("".join([line + "\n" async for line in response.aiter_lines()]))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(stream)
        await until(lambda: sum(e.decode for e in router.statistics().engines) == 3)
        router.begin_drain()
        ready = await fleet.client.get("/ready")
        assert ready.status_code == 503
        assert (ready.json()["state"], ready.json()["reason"]) == ("draining", "router_draining")
        refused = await fleet.chat()
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "router_draining"
        assert refused.headers["retry-after"] == "1"
        assert router.in_flight() == 3
        router.cut_streams()
        with trio.fail_after(5):
            await router.wait_idle()
    for text in texts:
        payloads = sse_payloads(text)
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["code"] == "shutdown"
    books = router.statistics().accounting
    assert books.by_reason[("unavailable", "shutdown")] == 3
    assert books.by_reason[("unavailable", "router_draining")] == 1
    fleet.assert_quiescent()


async def test_a_body_that_does_not_arrive_in_time_is_a_408(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(serving=ServingConfig(model=MODEL, body_timeout_s=3))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not sent:
            sent.append({})
            return {"type": "http.request", "body": b'{"model": ', "more_body": True}
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    app = fleet.client._transport.app  # type: ignore[attr-defined]
    start = trio.current_time()
    with trio.fail_after(10):
        await app(scope, receive, send)
    assert trio.current_time() - start == 3
    assert messages[0]["status"] == 408
    assert json.loads(messages[1]["body"])["error"]["code"] == "request_body_timeout"
    assert (
        fleet.router.statistics().accounting.by_reason[("invalid_requests", "request_body_timeout")]
        == 1
    )
    metrics = fleet.router.metrics.render().decode()
    assert 'narwhal_client_timeouts_total{phase="body"} 1.0' in metrics
    assert (b"content-length", b"%d" % len(messages[1]["body"])) in messages[0]["headers"]
    fleet.assert_quiescent()


async def test_the_request_id_is_the_clients_or_a_new_one_and_reaches_the_engine(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([engine_config("sim-a")])
    seen: list[str | None] = []
    inner = fleet.plugs["sim-a"].inner

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(request.headers.get("x-request-id"))
            return await inner.handle_async_request(request)

    fleet.plugs["sim-a"].inner = Recording()
    given = await fleet.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"x-request-id": "client-42"},
    )
    assert given.headers["x-request-id"] == "client-42"
    made = await fleet.chat()
    assert len(made.headers["x-request-id"]) == 32
    refused = await fleet.chat(model="other")
    assert refused.status_code == 404 and "x-request-id" in refused.headers
    assert seen == ["client-42", made.headers["x-request-id"]]


async def test_every_stream_gets_its_own_headers_once(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    for _ in range(3):
        response = await fleet.chat(stream=True, narwhal_sim={"output_tokens": 1})
        assert len(response.headers.get_list("x-request-id")) == 1
        assert len(response.headers.get_list("content-type")) == 1
