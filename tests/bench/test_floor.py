"""The floor relay (``narwhal.bench.floor``): its chunked end-finder, the relay over real sockets
in front of an in-process simulated engine, the process's clean exit, and ``--floor`` in
``narwhal bench overhead``'s command line and report."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import attrs
import h11
import httpx
import orjson
import pytest
import trio

from narwhal.bench import cli
from narwhal.bench.floor import ChunkedEnd, FramingError, serve_floor, upstream_address
from narwhal.bench.overhead import OverheadSettings
from narwhal.bench.report import LevelReport, OverheadReport
from narwhal.bench.services import free_port
from narwhal.sim import SimEngine, profile, serve_sim
from tests.bench.test_report import result
from tests.sim.helpers import events

MODEL = "llama-3.1-8b-instruct"
DEADLINE_S = 20

BODY = b"5\r\nhello\r\n1A;name=value\r\n" + b"x" * 26 + b"\r\n0\r\nTrailer-Field: 1\r\n\r\n"


# -- the chunked end-finder (pure) ----------------------------------------------------------------


def test_the_end_of_a_chunked_body_at_once_and_byte_by_byte() -> None:
    whole = ChunkedEnd()
    assert whole.feed(BODY) == len(BODY) and whole.done
    finder = ChunkedEnd()
    ends = [finder.feed(BODY[index : index + 1]) for index in range(len(BODY))]
    assert ends == [-1] * (len(BODY) - 1) + [1]
    assert finder.done


def test_the_end_of_a_chunked_body_at_every_split_and_with_bytes_after_it() -> None:
    for split in range(1, len(BODY)):
        finder = ChunkedEnd()
        assert finder.feed(BODY[:split]) == -1, split
        assert finder.feed(BODY[split:] + b"extra") == len(BODY) - split, split
    bare = ChunkedEnd()
    assert bare.feed(b"0\r\n\r\n") == 5
    with pytest.raises(FramingError):
        bare.feed(b"more")


@pytest.mark.parametrize(
    "body",
    [
        b"5\r\nhelloXY",  # no CRLF after the payload
        b"zz\r\n",  # not hex
        b"5\nhello\r\n",  # a bare LF
        b"1" * 17 + b"\r\n",  # too many digits
        b"0\r\nbroken\n",  # a trailer line without CR
    ],
)
def test_malformed_chunked_framing_is_refused(body: bytes) -> None:
    with pytest.raises(FramingError):
        ChunkedEnd().feed(body)


def test_a_size_line_too_long_is_refused() -> None:
    finder = ChunkedEnd()
    with pytest.raises(FramingError):
        for _ in range(100):
            finder.feed(b"0;" + b"e" * 1000)


def test_the_upstream_must_be_plain_http_at_the_root() -> None:
    assert upstream_address("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert upstream_address("http://localhost/") == ("localhost", 80)
    for url in ("https://127.0.0.1:8000", "http://127.0.0.1:8000/v1", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            upstream_address(url)


# -- the relay, in front of an in-process engine --------------------------------------------------


@attrs.frozen
class Relay:
    engine: str  # the engine's base URL
    floor: str  # the floor's
    port: int  # the floor's port


@pytest.fixture
async def relay(nursery: trio.Nursery) -> AsyncIterator[Relay]:
    engine = SimEngine(MODEL, timing=profile("zero"), seed=1)
    with trio.fail_after(DEADLINE_S):
        engine_url: str = await nursery.start(serve_sim, engine, "127.0.0.1:0")
        port: int = await nursery.start(serve_floor, 0, engine_url)
    yield Relay(engine_url, f"http://127.0.0.1:{port}", port)
    nursery.cancel_scope.cancel()


def chat(output_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about narwhals."}],
        "max_tokens": output_tokens,
        "stream": stream,
        "narwhal_sim": {"output_tokens": output_tokens},
    }


async def streamed(*urls: str) -> list[list[Any]]:
    """The same 32-token streamed chat completion from each of ``urls``, as its
    :func:`payloads` (each answer a 200 event stream)."""
    bodies = []
    with trio.fail_after(DEADLINE_S):
        for url in urls:
            async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
                async with client.stream("POST", "/v1/chat/completions", json=chat(32)) as answer:
                    assert answer.status_code == 200, url
                    assert answer.headers["content-type"].startswith("text/event-stream")
                    bodies.append(await answer.aread())
    return [payloads(body) for body in bodies]


def payloads(body: bytes) -> list[Any]:
    """The SSE events, with what may differ per request (``id``, ``created``) left out."""
    found = events(body)
    for event in found:
        if isinstance(event, dict):
            event.pop("id", None)
            event.pop("created", None)
    return found


@pytest.mark.realtime
async def test_a_stream_through_the_floor_is_the_engines_own(relay: Relay) -> None:
    direct, floor = await streamed(relay.engine, relay.floor)
    assert floor == direct
    assert direct[-1] == "[DONE]" and len(direct) > 32


@pytest.mark.realtime
async def test_health_models_and_a_plain_completion_are_relayed(relay: Relay) -> None:
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(base_url=relay.floor, trust_env=False) as client:
            assert (await client.get("/health")).status_code == 200
            models = (await client.get("/v1/models")).json()
            answer = await client.post("/v1/chat/completions", json=chat(8, stream=False))
    assert models["data"][0]["id"] == MODEL
    assert answer.status_code == 200
    assert answer.headers["content-length"] == str(len(answer.content))
    assert answer.json()["usage"]["completion_tokens"] == 8


async def h11_exchange(
    stream: trio.SocketStream, connection: h11.Connection, body: dict[str, Any]
) -> tuple[h11.Response, bytes]:
    """One request and its whole response on ``connection``, read with h11 (independent of
    the floor's own framing)."""
    content = orjson.dumps(body)
    request = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[
            ("Host", "floor"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(content))),
        ],
    )
    await stream.send_all(connection.send(request) + connection.send(h11.Data(data=content)))
    await stream.send_all(connection.send(h11.EndOfMessage()))
    response: h11.Response | None = None
    data = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            data += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return response, bytes(data)
        else:
            raise AssertionError(f"unexpected {event!r}")


@pytest.mark.realtime
async def test_requests_share_one_keep_alive_connection(relay: Relay) -> None:
    with trio.fail_after(DEADLINE_S):
        stream = await trio.open_tcp_stream("127.0.0.1", relay.port)
        async with stream:
            connection = h11.Connection(h11.CLIENT)
            first, streamed = await h11_exchange(stream, connection, chat(16))
            connection.start_next_cycle()
            second, plain = await h11_exchange(stream, connection, chat(4, stream=False))
            connection.start_next_cycle()
            third, again = await h11_exchange(stream, connection, chat(16))
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 200)
    assert (dict(first.headers)[b"transfer-encoding"], dict(second.headers)[b"content-length"]) == (
        b"chunked",
        str(len(plain)).encode(),
    )
    assert payloads(streamed) == payloads(again) and payloads(streamed)[-1] == "[DONE]"
    assert orjson.loads(plain)["usage"]["completion_tokens"] == 4


@pytest.mark.realtime
async def test_a_client_leaving_mid_stream_does_not_end_the_floor(relay: Relay) -> None:
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(base_url=relay.floor, trust_env=False) as client:
            async with client.stream("POST", "/v1/chat/completions", json=chat(4000)) as answer:
                async for _ in answer.aiter_raw():
                    break  # and close the connection mid-stream
            raw = await trio.open_tcp_stream("127.0.0.1", relay.port)
            async with raw:
                await raw.send_all(b"GET /health HTTP/1.1\r\nHost: floor\r\n\r\n" + b"x" * 10)
            after = await client.post("/v1/chat/completions", json=chat(8, stream=False))
            bad = await trio.open_tcp_stream("127.0.0.1", relay.port)
            async with bad:
                await bad.send_all(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
                assert await bad.receive_some() == b""  # refused: the connection is closed
            health = await client.get("/health")
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
    assert health.status_code == 200


@pytest.mark.realtime
async def test_the_floor_process_exits_0_on_sigterm(relay: Relay) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "narwhal.bench.floor", "--bind", f"127.0.0.1:{port}"]
    await exits_0_on_sigterm([*argv, "--upstream", relay.engine], port)


async def exits_0_on_sigterm(argv: list[str], port: int) -> None:
    """The relay process of ``argv`` answers ``/health`` on ``port``, then exits 0 on SIGTERM."""
    with trio.fail_after(DEADLINE_S):
        process = await trio.lowlevel.open_process(argv)
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                while True:
                    try:
                        health = await client.get(f"http://127.0.0.1:{port}/health")
                        break
                    except httpx.TransportError:
                        await trio.sleep(0.05)  # polling until it listens, under fail_after
            assert health.status_code == 200
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


def test_the_floor_refuses_a_bad_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from narwhal.bench.floor import main

    assert main(["--bind", "nowhere", "--upstream", "http://127.0.0.1:1"]) == 2
    assert main(["--bind", "127.0.0.1:0", "--upstream", "https://127.0.0.1:1"]) == 2
    assert "floor:" in capsys.readouterr().err


# -- --floor in narwhal bench overhead ------------------------------------------------------------


def test_floor_is_off_by_default_and_on_with_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[OverheadSettings] = []

    def run(settings: OverheadSettings, *, echo: Any) -> OverheadReport:
        seen.append(settings)
        return OverheadReport(settings={}, environment={}, levels=(), checks=())

    monkeypatch.setattr(cli, "run_overhead", run)
    cli.main(["overhead", "--quick", "--no-vllm-router"])
    cli.main(["overhead", "--quick", "--no-vllm-router", "--floor"])
    assert [settings.floor for settings in seen] == [False, True]
    assert OverheadSettings().floor is False
    assert OverheadSettings(floor=True).as_json()["floor"] is True


def test_the_report_shows_the_floor_and_the_narwhal_over_floor_ratios() -> None:
    level = LevelReport(
        16,
        2,
        (
            result("direct", [1.0, 1.0], concurrency=16),
            result("floor", [1.5, 1.5], concurrency=16, cpu_s=0.2),
            result("narwhal", [3.0, 3.0], concurrency=16, cpu_s=0.6),
        ),
    )
    ratios = level.floor_ratios
    assert ratios is not None
    assert ratios.added_ttft_p50 == pytest.approx(4.0)  # 2 ms over 0.5 ms
    assert ratios.cpu_per_request == pytest.approx(3.0)
    assert level.ratios is None  # no vllm-router
    text = OverheadReport(settings={}, environment={}, levels=(level,), checks=()).render()
    rows = [
        line.split()[0]
        for line in text.splitlines()
        if line.split()[:1] in (["direct"], ["floor"], ["narwhal"])
    ]
    assert rows == ["direct", "floor", "narwhal", "narwhal"]  # the rows, the ratios' line
    assert "narwhal / floor: added TTFT p50 4.00x; CPU per request 3.00x" in text
    data = level.as_json()
    assert data["ratios_narwhal_over_floor"]["added_ttft_p50"] == pytest.approx(4.0)
    assert "floor" in data["targets"] and "floor" in data["added_over_direct"]
    without = LevelReport(16, 2, level.results[::2])
    assert without.floor_ratios is None
    assert "ratios_narwhal_over_floor" not in without.as_json()


@pytest.mark.realtime
async def test_an_upstream_connection_the_engine_closed_while_idle_is_reopened(
    nursery: trio.Nursery,
) -> None:
    accepted: list[int] = []

    async def answer_once(stream: trio.SocketStream) -> None:
        """An engine that ends every connection after one response (as one does at its idle
        keep-alive timeout), without saying so in the response."""
        accepted.append(1)
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some()
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with trio.fail_after(DEADLINE_S):
        listeners = await nursery.start(partial(trio.serve_tcp, answer_once, 0, host="127.0.0.1"))
        engine_port = listeners[0].socket.getsockname()[1]
        port: int = await nursery.start(serve_floor, 0, f"http://127.0.0.1:{engine_port}")
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            trust_env=False,
            limits=httpx.Limits(max_connections=1),
        ) as client:
            answers = []
            for _ in range(3):  # the engine's close reaches the floor before or after the next
                answers.append((await client.get("/health")).text)
    nursery.cancel_scope.cancel()
    assert answers == ["ok", "ok", "ok"]
    assert len(accepted) == 3


@pytest.mark.realtime
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",  # a start line of one part
        b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: ten\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"\x00" * 70000,  # a head that never ends
    ],
)
async def test_a_request_the_floor_cannot_frame_closes_only_its_connection(
    relay: Relay, request_bytes: bytes
) -> None:
    with trio.fail_after(DEADLINE_S):
        stream = await trio.open_tcp_stream("127.0.0.1", relay.port)
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(request_bytes)
            with contextlib.suppress(trio.BrokenResourceError):
                assert await stream.receive_some() == b""
        async with httpx.AsyncClient(base_url=relay.floor, trust_env=False) as client:
            assert (await client.get("/health")).status_code == 200
