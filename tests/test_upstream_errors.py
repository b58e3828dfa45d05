"""What clients are told when an engine breaks HTTP: the engine's name and the kind of failure,
never an exception's repr or an address; a broken engine never wedges the router's pool."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import orjson
import pytest
import trio

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import (
    Config,
    EngineConfig,
    MonitoringConfig,
    ServingConfig,
    UpstreamConfig,
)
from narwhal.errors import EngineError, EngineResponseError, EngineUnreachable
from narwhal.upstream.client import EngineClient
from narwhal.web.app import create_app, get_router
from tests.conftest import MODEL, Fleet
from tests.test_transport import read_request, serve

MALFORMED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: abc\r\n\r\n"


def chunk(**delta: Any) -> bytes:
    finish = delta.pop("finish", None)
    event = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(event) + b"\n\n"


STREAM = chunk(role="assistant", content="Hi") + chunk(finish="stop") + b"data: [DONE]\n\n"


def answer(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class RawEngine:
    """A raw-socket engine: healthy probes; completions answered with ``completion``."""

    def __init__(self, completion: bytes) -> None:
        self.completion = completion
        self.completions = 0

    async def __call__(self, stream: trio.SocketStream, number: int) -> None:
        while head := await read_request(stream):
            target = head.split(b" ")[1]
            if target == b"/health":
                await stream.send_all(answer(b""))
            elif target == b"/v1/models":
                await stream.send_all(answer(orjson.dumps({"data": [{"id": MODEL}]})))
            elif target == b"/metrics":  # no queue gauges: not asked again
                await stream.send_all(answer(b"", b"text/plain"))
            else:
                self.completions += 1
                await stream.send_all(self.completion)
                if self.completion is not GOOD:
                    await stream.aclose()
                    return


GOOD = answer(STREAM, b"text/event-stream")


def engine_client(url: str, *, read_s: float = 5.0) -> EngineClient:
    upstream = UpstreamConfig(connect_timeout_s=1.0, read_timeout_s=read_s, max_connections=1)
    return EngineClient(EngineConfig(name="gpu-7", url=url), upstream)


def assert_plain(message: str) -> None:
    assert "127.0.0.1" not in message and "Error(" not in message and "'" not in message


@pytest.mark.realtime
@pytest.mark.parametrize(
    ("completion", "error", "message"),
    [
        (MALFORMED, EngineResponseError, "engine gpu-7 sent a malformed response"),
        (b"HTTP/1.1 200 OK\r\n", EngineError, "engine gpu-7 closed the connection mid-response"),
        (b"", EngineError, "engine gpu-7 closed the connection mid-response"),
        (None, EngineError, "engine gpu-7 did not answer in time"),
    ],
)
async def test_failures_name_the_engine_and_the_kind(
    nursery: trio.Nursery,
    completion: bytes | None,
    error: type[Exception],
    message: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def engine(stream: trio.SocketStream, number: int) -> None:
        await read_request(stream)
        if completion is None:
            await trio.sleep_forever()
        await stream.send_all(completion)
        await stream.aclose()

    url, _ = await serve(nursery, engine)
    client = engine_client(url, read_s=0.3)
    with trio.fail_after(10):
        try:
            with pytest.raises(error) as raised:
                await client.open_stream(
                    "chat", b"{}", ids_required=False, headers={"x-request-id": "req-42"}
                )
        finally:
            await client.aclose()
    assert raised.value.message == message  # type: ignore[attr-defined]
    assert_plain(raised.value.message)  # type: ignore[attr-defined]
    assert "request req-42" in caplog.text and "gpu-7" in caplog.text


@pytest.mark.realtime
async def test_a_refused_connection_is_unreachable() -> None:
    client = engine_client("http://127.0.0.1:1")
    with trio.fail_after(10):
        try:
            with pytest.raises(EngineUnreachable) as raised:
                await client.open_stream("chat", b"{}", ids_required=False)
            with pytest.raises(EngineUnreachable) as probed:
                await client.get_json("/health")
        finally:
            await client.aclose()
    assert raised.value.message == "engine gpu-7 refused the connection"
    assert probed.value.message == "engine gpu-7 refused the connection"


@pytest.mark.realtime
async def test_a_broken_stream_names_the_kind(nursery: trio.Nursery) -> None:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    first = chunk(role="assistant", content="Hi")
    shapes = {
        b"/cut": (b"%x\r\n%s\r\n" % (len(first), first), EngineError, "closed the connection"),
        b"/bad": (b"%x\r\n%s\r\nzz\r\n" % (len(first), first), EngineResponseError, "malformed"),
        b"/long": (b"a00000\r\ndata: " + b"x" * 0xA00000, EngineResponseError, "over 4 MiB"),
    }

    async def engine(stream: trio.SocketStream, number: int) -> None:
        target = (await read_request(stream)).split(b" ")[1]  # /cut/v1/chat/completions
        await stream.send_all(head + shapes[b"/" + target.split(b"/")[1]][0])
        await stream.aclose()

    url, _ = await serve(nursery, engine)
    client = engine_client(url)
    with trio.fail_after(10):
        try:
            for target, (_, error, words) in shapes.items():
                client.http.base_url = httpx.URL(url + target.decode())
                stream = await client.open_stream("chat", b"{}", ids_required=False)
                async with stream:
                    with pytest.raises(error) as raised:
                        while True:
                            await stream.next_event()
                assert words in raised.value.message  # type: ignore[attr-defined]
                assert_plain(raised.value.message)  # type: ignore[attr-defined]
        finally:
            await client.aclose()


@pytest.mark.realtime
async def test_a_malformed_engine_never_wedges_the_router(nursery: trio.Nursery) -> None:
    engine = RawEngine(MALFORMED)
    url, _ = await serve(nursery, engine)
    config = Config(
        engines=(EngineConfig(name="raw", url=url, token_ids=False),),
        serving=ServingConfig(model=MODEL),
        upstream=UpstreamConfig(max_connections=4, read_timeout_s=5.0),
        monitoring=MonitoringConfig(failure_threshold=1000, profiling=False),
    )
    app = create_app(config)
    with trio.fail_after(60):
        await nursery.start(partial(run_lifespan, app))
        client = httpx.AsyncClient(
            transport=ASGIStreamTransport(app, nursery), base_url="http://narwhal.test"
        )
        fleet = Fleet(get_router(app), client, {}, {})
        await fleet.router.wait_ready()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "stream": True}
        for _ in range(40):  # ten times the pool
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert error["code"] == "malformed_engine_response"
            assert error["message"].endswith("engine raw sent a malformed response"), error
            assert_plain(error["message"])
        assert engine.completions == 40
        engine.completion = GOOD
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and "Hi" in response.text
        fleet.assert_quiescent()
        await client.aclose()
        # The fixture's nursery is cancelled before the app's shutdown could close the pools
        # (the lifespan task is cancelled with it); close them here.
        await fleet.router.aclose()
