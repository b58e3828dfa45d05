"""The in-process transport: frames arrive in virtual time, closes and drops are seen at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.sim import LinearTiming, SimEngine, SimTransport, profile
from tests.sim.helpers import MESSAGES, MODEL, events

EXACT = LinearTiming(prefill_base_s=0.5, prefill_per_token_s=0.0, decode_step_s=0.25)


@pytest.fixture
def transport() -> SimTransport:
    return SimTransport(SimEngine(MODEL, timing=EXACT))


@pytest.fixture
async def client(transport: SimTransport) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=transport, base_url="http://sim.test") as http:
        yield http


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, **fields}


async def timed_pieces(response: httpx.Response, start: float) -> list[tuple[float, bytes]]:
    return [(trio.current_time() - start, piece) async for piece in response.aiter_raw()]


async def test_frames_arrive_when_the_plan_says(
    client: httpx.AsyncClient, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        start = trio.current_time()
        request = body(stream=True, narwhal_sim={"output_tokens": 3})
        async with client.stream("POST", "/v1/chat/completions", json=request) as response:
            assert response.status_code == 200
            assert trio.current_time() == start  # the head goes at once
            assert response.headers["content-type"].startswith("text/event-stream")
            pieces = await timed_pieces(response, start)
    assert [at for at, _ in pieces] == [0.5, 0.5, 0.75, 1.0, 1.0]
    assert events(b"".join(piece for _, piece in pieces))[-1] == "[DONE]"


async def test_the_first_frame_is_read_at_ttft_not_at_the_end(
    client: httpx.AsyncClient, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        start = trio.current_time()
        request = body(stream=True, narwhal_sim={"output_tokens": 40})
        async with client.stream("POST", "/v1/chat/completions", json=request) as response:
            first = await response.aiter_raw().__anext__()
            assert trio.current_time() - start == 0.5
            assert b'"role":"assistant"' in first


async def test_non_streaming_answers_after_the_generation(
    client: httpx.AsyncClient, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        start = trio.current_time()
        response = await client.post(
            "/v1/chat/completions", json=body(narwhal_sim={"output_tokens": 3})
        )
    assert trio.current_time() - start == 1.0
    assert response.json()["usage"]["completion_tokens"] == 3


async def test_statistics_and_recorded_requests(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        sent = body(
            stream=True, return_token_ids=True, stream_interval=1, narwhal_sim={"output_tokens": 2}
        )
        response = await client.post(
            "/v1/chat/completions", json=sent, headers={"x-narwhal-fence": "7"}
        )
        assert events(response.content)[-1] == "[DONE]"
        await client.get("/health")
    assert transport.requests == [sent]
    assert transport.requests[0]["return_token_ids"] is True
    assert transport.requests[0]["stream_interval"] == 1
    assert transport.headers[0]["x-narwhal-fence"] == "7"
    stats = transport.statistics()
    assert (stats.requests_received, stats.completion_requests) == (2, 1)
    assert (stats.streams_open, stats.streams_completed, stats.streams_closed_early) == (0, 1, 0)


async def test_an_early_close_is_seen_at_once(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        request = body(stream=True, narwhal_sim={"output_tokens": 1000})
        async with client.stream("POST", "/v1/chat/completions", json=request) as response:
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
            assert transport.statistics().streams_open == 1
            assert transport.engine.statistics().running == 1
            closed_at = trio.current_time()
        stats = transport.statistics()
    assert trio.current_time() == closed_at
    assert (stats.streams_open, stats.streams_closed_early, stats.streams_completed) == (0, 1, 0)
    assert transport.engine.statistics().running == 0


async def test_a_cancelled_reader_is_counted_as_closing_early(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        with trio.move_on_after(2):
            await client.post("/v1/chat/completions", json=body(narwhal_sim={"fault": "stall"}))
        assert transport.statistics().streams_closed_early == 1
        request = body(stream=True, narwhal_sim={"fault": "stall", "fault_at": 1})
        async with client.stream("POST", "/v1/chat/completions", json=request) as response:
            with trio.move_on_after(2):
                await response.aread()
            assert transport.statistics().streams_closed_early == 2
    assert transport.statistics().streams_open == 0


async def test_wait_until_wakes_on_a_change(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                partial(
                    client.post, "/v1/chat/completions", json=body(narwhal_sim={"output_tokens": 5})
                )
            )
            await transport.wait_until(lambda s: s.streams_open == 1)
            await transport.wait_until(lambda s: s.streams_completed == 1)
            assert trio.current_time() == 1.5


async def test_a_drop_mid_stream_is_a_remote_protocol_error(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        start = trio.current_time()
        request = body(
            stream=True, narwhal_sim={"output_tokens": 5, "fault": "drop", "fault_at": 2}
        )
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", "/v1/chat/completions", json=request) as response:
                async for piece in response.aiter_raw():
                    received += piece
        assert trio.current_time() - start == 1.0
    assert len(events(received)) == 3
    assert transport.statistics().streams_dropped == 1


async def test_a_drop_before_the_head_fails_the_request(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10), pytest.raises(httpx.RemoteProtocolError):
        await client.post(
            "/v1/chat/completions", json=body(narwhal_sim={"fault": "drop", "output_tokens": 3})
        )
    stats = transport.statistics()
    assert (stats.streams_dropped, stats.streams_open) == (1, 0)


async def test_truncate_and_errors_end_cleanly(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        cut = await client.post(
            "/v1/chat/completions",
            json=body(stream=True, narwhal_sim={"fault": "truncate", "fault_at": 2}),
        )
        refused = await client.post("/v1/chat/completions", json=body(model="other"))
    assert len(events(cut.content)) == 3
    assert refused.status_code == 404
    assert transport.statistics().streams_completed == 2


async def test_info_routes_and_unknown_routes(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(10):
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL
        request = body(stream=True, narwhal_sim={"output_tokens": 100})
        async with client.stream("POST", "/v1/chat/completions", json=request):
            metrics = (await client.get("/metrics")).text
            assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 1.0' in metrics
        missing = await client.get("/v1/nothing")
        wrong = await client.get("/v1/completions")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert wrong.status_code == 405
    assert transport.statistics().completion_requests == 1


async def test_the_zero_profile_takes_no_time(autojump_clock: trio.testing.MockClock) -> None:
    transport = SimTransport(SimEngine(MODEL, timing=profile("zero")))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim.test") as client:
        with trio.fail_after(10):
            start = trio.current_time()
            response = await client.post("/v1/chat/completions", json=body(stream=True))
            assert trio.current_time() == start
    assert events(response.content)[-1] == "[DONE]"


async def test_the_time_scale_stretches_the_stream(autojump_clock: trio.testing.MockClock) -> None:
    timing = LinearTiming(0.5, 0.0, 0.25, time_scale=2.0)
    transport = SimTransport(SimEngine(MODEL, timing=timing))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim.test") as client:
        with trio.fail_after(10):
            start = trio.current_time()
            await client.post(
                "/v1/chat/completions", json=body(stream=True, narwhal_sim={"output_tokens": 3})
            )
            assert trio.current_time() - start == 2.0


async def test_a_slowdown_stretches_per_request_timing(
    client: httpx.AsyncClient, transport: SimTransport, autojump_clock: trio.testing.MockClock
) -> None:
    transport.engine.set_slowdown(2.0)
    with trio.fail_after(10):
        start = trio.current_time()
        request = body(stream=True, narwhal_sim={"output_tokens": 3})
        async with client.stream("POST", "/v1/chat/completions", json=request) as response:
            pieces = await timed_pieces(response, start)
    assert [at for at, _ in pieces] == [1.0, 1.0, 1.5, 2.0, 2.0]


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
async def test_ids_are_unique_and_created_is_the_real_time(
    dialect: str, autojump_clock: trio.testing.MockClock
) -> None:
    engine = SimEngine(MODEL, dialect=dialect, timing=EXACT)  # type: ignore[arg-type]
    with trio.fail_after(10):
        async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as http:
            two = body(narwhal_sim={"output_tokens": 2})
            before = int(time.time())
            answers = [(await http.post("/v1/chat/completions", json=two)).json() for _ in range(2)]
            models = (await http.get("/v1/models")).json()
            after = int(time.time())
    assert answers[0]["id"] != answers[1]["id"]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    for created in (answers[0]["created"], answers[1]["created"], models["data"][0]["created"]):
        assert before <= created <= after
