"""The load generator: SSE timing (pure), percentiles, and the closed and open loops."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from narwhal.bench.load import (
    KEEPALIVE_S,
    ClientPool,
    LatencySummary,
    StreamTimer,
    chat_body,
    percentile,
    run_closed_loop,
    run_open_loop,
)

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"token_ids":[7]}]}\n\n'
DONE = b"data: [DONE]\n\n"


def timer_over(reads: list[tuple[bytes, float]]) -> StreamTimer:
    timer = StreamTimer(3, 10.0)
    for data, now in reads:
        timer.feed(data, now)
    return timer


# -- StreamTimer --------------------------------------------------------------------------------


def test_ttft_is_the_first_output_event_not_the_role_chunk() -> None:
    timer = timer_over([(ROLE, 10.5), (TOKEN, 11.0), (TOKEN, 11.5), (DONE, 12.0)])
    record = timer.finish(12.1)
    assert record.ok
    assert (record.index, record.sent_s) == (3, 10.0)
    assert record.ttft_s == pytest.approx(1.0)
    assert record.e2e_s == pytest.approx(2.0)  # at [DONE], not at the end of the body
    assert record.output_events == 2


def test_events_split_across_reads_are_dated_by_the_read_that_completes_them() -> None:
    stream = ROLE + TOKEN + DONE
    cut = len(ROLE) + 20
    timer = timer_over([(stream[:cut], 10.2), (stream[cut:-3], 10.4), (stream[-3:], 10.9)])
    record = timer.finish(11.0)
    assert record.ttft_s == pytest.approx(0.4)
    assert record.e2e_s == pytest.approx(0.9)


def test_crlf_framing_comments_and_multiline_data() -> None:
    crlf = (ROLE + TOKEN + DONE).replace(b"\n", b"\r\n")
    cut = crlf.index(b"\r\n\r\n", len(ROLE)) + 1  # a read ending between CR and LF
    timer = timer_over([(b": keep-alive\r\n\r\n", 10.1), (crlf[:cut], 10.2), (crlf[cut:], 10.3)])
    record = timer.finish(10.3)
    assert record.ok and record.output_events == 1
    assert record.ttft_s == pytest.approx(0.3)  # the event's blank line came in the second read

    multiline = b'data: {"choices":[{"delta":\ndata: {"content":"x"}}]}\n\n' + DONE
    record = timer_over([(multiline, 10.5)]).finish(10.5)
    assert record.ok and record.output_events == 1


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"choices":[{"text":"x"}]}\n\n',
        b'data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}\n\n',
        b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}\n\n',
        b'data: {"choices":[{"delta":{"refusal":"no"}}]}\n\n',
    ],
)
def test_other_output_kinds_count(event: bytes) -> None:
    record = timer_over([(event + DONE, 10.25)]).finish(10.25)
    assert record.ok and record.ttft_s == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("stream", "error"),
    [
        (ROLE + TOKEN, "no_done"),
        (ROLE + DONE, "no_output"),
        (TOKEN + b'data: {"error":{"code":"engine_error"}}\n\n' + DONE, "in_band:engine_error"),
        (b"data: {not json\n\n" + DONE, "malformed_event"),
        (b"data: [1, 2]\n\n" + DONE, "malformed_event"),
    ],
)
def test_incomplete_or_failed_streams_are_errors(stream: bytes, error: str) -> None:
    assert timer_over([(stream, 10.5)]).finish(10.5).error == error


def test_an_event_without_its_blank_line_is_still_read_at_the_end() -> None:
    record = timer_over([(TOKEN + b"data: [DONE]", 10.5)]).finish(10.75)
    assert record.ok and record.e2e_s == pytest.approx(0.75)


def test_fail_keeps_what_was_measured_and_the_first_error() -> None:
    timer = timer_over([(TOKEN, 10.5)])
    record = timer.fail("ReadTimeout")
    assert (record.error, record.ttft_s, record.e2e_s) == ("ReadTimeout", 0.5, None)
    timer.feed(b'data: {"error":{"type":"x"}}\n\n', 11.0)
    assert timer.fail("RemoteProtocolError").error == "in_band:x"


# -- percentiles --------------------------------------------------------------------------------


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(map(float, range(1, 101))), 99) == pytest.approx(99.01)


@pytest.mark.parametrize(("values", "q"), [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_refuses_nonsense(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, q)


def test_latency_summary() -> None:
    summary = LatencySummary.of([0.1 * i for i in range(1, 11)])
    assert summary.count == 10
    assert summary.mean_s == pytest.approx(0.55)
    assert summary.p50_s == pytest.approx(0.55)
    assert summary.p90_s == pytest.approx(0.91)
    assert summary.max_s == pytest.approx(1.0)
    assert LatencySummary.of([]) == LatencySummary(0, None, None, None, None, None)
    assert set(summary.as_json()) == {"count", "mean_s", "p50_s", "p90_s", "p99_s", "max_s"}


def test_chat_body_asks_the_simulator_for_an_exact_length() -> None:
    body = httpx.Response(200, content=chat_body("m", output_tokens=64, index=5)).json()
    assert body["max_tokens"] == 64 and body["stream"] is True
    assert body["narwhal_sim"] == {"output_tokens": 64}
    assert body["model"] == "m" and "request 5" in body["messages"][0]["content"]


# -- the Trio shell, over a mock transport ------------------------------------------------------


class Engine:
    """A mock engine that streams a fixed answer after ``delay_s`` and counts concurrency."""

    def __init__(self, delay_s: float = 0.0, status: int = 200) -> None:
        self.delay_s = delay_s
        self.status = status
        self.in_flight = 0
        self.most_in_flight = 0
        self.seen: list[int] = []
        self.request_ids: list[tuple[int, str | None]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(int(request.content.split(b"(request ")[1].split(b")")[0]))
        self.request_ids.append((self.seen[-1], request.headers.get("x-request-id")))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await trio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if self.status != 200:
            return httpx.Response(
                self.status, content=chunks(b'{"error":{"code":"admission_queue_full"}}')
            )
        return httpx.Response(200, content=chunks(ROLE, TOKEN, TOKEN, DONE))


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    """A streamed body (a body given as bytes is read at once and cannot be streamed)."""
    for part in parts:
        yield part


def clients_for(engine: Engine) -> ClientPool:
    return ClientPool(
        lambda: httpx.AsyncClient(transport=httpx.MockTransport(engine), base_url="http://engine")
    )


def body(index: int) -> bytes:
    return chat_body("m", output_tokens=2, index=index)


async def test_closed_loop_sends_each_request_once_with_bounded_concurrency(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine(delay_s=1.0)
    async with clients_for(engine) as clients:
        with trio.fail_after(60):
            records = await run_closed_loop(
                clients, "/v1/chat/completions", body, concurrency=4, requests=10, first_index=100
            )
        assert trio.current_time() == pytest.approx(3.0)  # ceil(10 / 4) waves of 1 s
        assert clients.size == 4  # one connection per worker, reused
    assert clients.size == 0  # closed
    assert sorted(record.index for record in records) == list(range(100, 110))
    assert sorted(engine.seen) == list(range(100, 110))
    assert engine.most_in_flight == 4
    assert all(record.ok and record.output_events == 2 for record in records)


async def test_the_pool_drops_clients_left_idle_past_reuse(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine(delay_s=1.0)
    async with clients_for(engine) as clients:
        await run_closed_loop(clients, "/x", body, concurrency=3, requests=3)
        await trio.sleep(KEEPALIVE_S - 1.0)
        await run_closed_loop(clients, "/x", body, concurrency=1, requests=1)
        assert clients.size == 3
        await trio.sleep(1.5)  # two clients idle for KEEPALIVE_S + 1.5 s, one for 1.5 s
        assert await clients.drop_stale() == 2
        assert clients.size == 1
        assert await clients.drop_stale() == 0
        records = await run_closed_loop(clients, "/x", body, concurrency=3, requests=3)
        assert clients.size == 3 and all(record.ok for record in records)


async def test_closed_loop_records_http_errors() -> None:
    async with clients_for(Engine(status=429)) as clients:
        records = await run_closed_loop(clients, "/x", body, concurrency=2, requests=3)
    assert [record.error for record in records] == ["http_429:admission_queue_full"] * 3


async def test_closed_loop_records_transport_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with ClientPool(
        lambda: httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    ) as clients:
        records = await run_closed_loop(clients, "http://x/", body, concurrency=1, requests=1)
    assert records[0].error == "ConnectError"


async def test_closed_loop_refuses_zero_concurrency() -> None:
    async with clients_for(Engine()) as clients:
        with pytest.raises(ValueError):
            await run_closed_loop(clients, "/x", body, concurrency=0, requests=1)


async def test_open_loop_keeps_its_schedule_when_the_server_is_slow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine(delay_s=5.0)
    async with clients_for(engine) as clients:
        with trio.fail_after(60):
            records = await run_open_loop(
                clients, "/x", body, arrivals_s=[0.0, 1.0, 2.0, 6.0], max_in_flight=2
            )
        assert trio.current_time() == pytest.approx(11.0)  # the last one sent at 6 s, on time
    by_index = {record.index: record for record in records}
    assert by_index[2].error == "loadgen_saturated"  # due while two were running: not delayed
    assert [by_index[i].ok for i in (0, 1, 3)] == [True, True, True]
    assert sorted(engine.seen) == [0, 1, 3]


async def test_open_loop_tags_each_request_with_its_own_request_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine(delay_s=1.0)
    async with clients_for(engine) as clients:
        with trio.fail_after(60):
            await run_open_loop(
                clients, "/x", body, arrivals_s=[0.0, 0.5], max_in_flight=2, request_ids="lvl-1-"
            )
            await run_open_loop(clients, "/x", body, arrivals_s=[0.0], max_in_flight=1)
    assert engine.request_ids == [(0, "lvl-1-0"), (1, "lvl-1-1"), (0, None)]
