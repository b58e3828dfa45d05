"""What an engine's own errors become through Narwhal.

vLLM checks some parameters only once a stream has begun (``top_logprobs`` over its maximum is
a 200 carrying ``data: {"error": {..., "code": 400}}``): an in-band error frame whose code is a
4xx is the client's error, answered with that status, never retried and never held against the
engine. Every 502 that a retry cannot cure says ``x-should-retry: false``, so that the openai
client does not multiply Narwhal's own retry. The frames are vLLM 0.32's own
(``reference/vllm-0.32-cpu-captures/error_stream_bad_logprobs.txt``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, cast

import httpx
import openai
import orjson
import pytest
import trio

from narwhal.admission.context import beyond_context, fits, placed_size, too_short
from narwhal.admission.predictor import check_budget, project
from narwhal.admission.queue import Waiter
from narwhal.config import AdmissionConfig, Config, EngineConfig, MonitoringConfig, ServingConfig
from narwhal.errors import PredictiveRefusal
from narwhal.router import Router
from narwhal.scheduling.engines import Engine
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.health import Failure
from narwhal.scheduling.lengths import OutputLengths
from narwhal.scheduling.profiles import PROFILES
from narwhal.server import serve as serve_router
from narwhal.upstream.client import ErrorFrameEvent, normalise_engine_error
from tests.conftest import MODEL, Fleet, StartFleet
from tests.support import sse_payloads, until, wait_ready
from tests.test_transport import read_request, serve
from tests.test_upstream_errors import answer, chunk

# The capture's frame, byte for byte (vLLM writes it with json.dumps: spaces included).
BAD_LOGPROBS = (
    b'data: {"error": {"message": "Requested sample logprobs of 50, which is greater than max '
    b'allowed: 20 (parameter=logprobs, value=50)", "type": "BadRequestError", "param": '
    b'"logprobs", "code": 400}}\n\ndata: [DONE]\n\n'
)
INTERNAL = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
)
SSE = {"content-type": "text/event-stream; charset=utf-8"}


def frame(error: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"


def role_then(body: bytes) -> bytes:
    """A role chunk and one output chunk, then ``body`` (an error after the first output)."""
    output = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "delta": {"content": "Hi"}, "finish_reason": None, "token_ids": [7]}
        ],
    }
    return chunk(role="assistant", content="") + b"data: " + orjson.dumps(output) + b"\n\n" + body


class _Body(httpx.AsyncByteStream):
    """The body one event per read, as an engine writes them."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.body.split(b"\n\n")[:-1]:
            await trio.sleep(0.001)
            yield event + b"\n\n"


class Scripted(httpx.AsyncBaseTransport):
    """A simulated engine whose completion requests are answered with ``body`` while it is set.

    With ``context`` set, it also has vLLM's context length: its ``/v1/models`` says
    ``max_model_len``, and a prompt longer than that (counted at ``chars_per_token``) gets
    vLLM's own 400. Everything else is the simulator's; ``posts`` counts the completion
    requests that reached it, ``refused`` those it refused as too long.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.body: bytes | None = None
        self.context: int | None = None
        self.chars_per_token = 4
        self.posts = 0
        self.refused = 0
        self.one_read = False  # the whole body in one network read, not one event per read

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models" and self.context is not None:
            entry = {"id": MODEL, "object": "model", "max_model_len": self.context}
            return httpx.Response(200, json={"object": "list", "data": [entry]})
        if request.method != "POST":
            return await self.inner.handle_async_request(request)
        self.posts += 1
        tokens = len(prompt_text(json.loads(await request.aread()))) // self.chars_per_token
        if self.context is not None and tokens > self.context:
            self.refused += 1
            return httpx.Response(400, json=too_long(self.context, tokens))
        if self.body is None:
            return await self.inner.handle_async_request(request)
        stream = httpx.ByteStream(self.body) if self.one_read else _Body(self.body)
        return httpx.Response(200, headers=SSE, stream=stream)


def prompt_text(body: dict[str, Any]) -> str:
    if "prompt" in body:
        return str(body["prompt"])
    return "".join(str(message.get("content") or "") for message in body["messages"])


def too_long(context: int, tokens: int) -> dict[str, Any]:
    """vLLM 0.32's answer to a prompt over its context (asked of the real engine)."""
    return {
        "error": {
            "message": f"This model's maximum context length is {context} tokens. However, your "
            f"prompt contains at least {tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={tokens})",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }


def script(
    fleet: Fleet, body: bytes | None, engines: tuple[str, ...] | None = None
) -> list[Scripted]:
    """Answer every completion request of ``engines`` (default: all) with ``body``."""
    scripted = []
    for name in engines or tuple(fleet.plugs):
        plug = fleet.plugs[name]
        inner = plug.inner.inner if isinstance(plug.inner, Scripted) else plug.inner
        plug.inner = Scripted(inner)
        plug.inner.body = body
        scripted.append(plug.inner)
    return scripted


def limit_context(fleet: Fleet, contexts: dict[str, int]) -> dict[str, Scripted]:
    """Give engines vLLM's context length, as their model object and their 400."""
    engines = {engine.name: engine for engine in fleet.router.pool.engines}
    limited = {}
    for name, context in contexts.items():
        (limited[name],) = script(fleet, None, (name,))
        limited[name].context = context
        engines[name].model_card = {"id": MODEL, "object": "model", "max_model_len": context}
    return limited


def posts(scripted: list[Scripted]) -> int:
    return sum(engine.posts for engine in scripted)


def engine_failures(fleet: Fleet) -> list[int]:
    return [engine.failed for engine in fleet.router.pool.engines]


# -- the frame itself (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status"),
    [(400, 400), ("400", 400), (422, 422), (404, 404), ("429", 429)],
)
def test_a_4xx_code_makes_the_frame_the_clients_error(code: object, status: int) -> None:
    event = ErrorFrameEvent(
        {"message": "bad", "type": "BadRequestError", "param": "body.logprobs", "code": code}
    )
    rejected = event.rejection()
    assert rejected is not None
    assert rejected.http_status == status
    assert rejected.envelope() == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "logprobs",
            "code": str(status),
        }
    }
    assert rejected.counted_as == "invalid_requests"


@pytest.mark.parametrize("code", [500, "503", None, "invalid_value", True, 4000, "4e2", -400])
def test_any_other_code_is_an_engine_failure(code: object) -> None:
    assert ErrorFrameEvent({"message": "bad", "code": code}).rejection() is None
    assert ErrorFrameEvent({"message": "no code at all"}).rejection() is None


def test_an_engine_4xx_answer_keeps_its_integer_code_as_a_string() -> None:
    body = (
        b'{"error":{"message":"temperature must be non-negative, got -1.0.",'
        b'"type":"BadRequestError","param":"temperature","code":400}}'
    )
    rejected = normalise_engine_error("gpu-1", 400, body)
    assert rejected.http_status == 400
    assert rejected.envelope()["error"] == {
        "message": "temperature must be non-negative, got -1.0.",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": "400",
    }
    flat = normalise_engine_error("gpu-1", 400, b'{"message": "no", "code": ""}')
    assert flat.code == "invalid_request"


# -- before response headers ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_a_4xx_frame_before_headers_is_answered_with_its_status(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    fleet = await start_fleet()
    scripted = script(fleet, BAD_LOGPROBS)
    with trio.fail_after(30):
        response = await fleet.chat(stream=stream, logprobs=True, top_logprobs=50)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "error": {
            "message": "Requested sample logprobs of 50, which is greater than max allowed: 20 "
            "(parameter=logprobs, value=50)",
            "type": "invalid_request_error",
            "param": "logprobs",
            "code": "400",
        }
    }
    assert posts(scripted) == 1, "never retried on another engine"
    counters = fleet.counters()
    assert (counters["invalid_requests"], counters["failed"]) == (1, 0)
    assert engine_failures(fleet) == [0, 0]
    assert all(engine.eligible for engine in fleet.router.pool.engines)
    fleet.assert_quiescent()


async def test_many_4xx_frames_never_open_a_circuit(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    scripted = script(fleet, BAD_LOGPROBS)
    threshold = fleet.router.config.monitoring.failure_threshold
    with trio.fail_after(30):
        for _ in range(threshold * 3):
            assert (await fleet.chat(stream=True)).status_code == 400
    assert posts(scripted) == threshold * 3
    engine = fleet.router.pool.engines[0]
    assert engine.eligible and engine.failed == 0
    assert engine.statistics().health.state == "ready"
    fleet.assert_quiescent()


@pytest.mark.parametrize(
    "body",
    [INTERNAL, frame({"message": "no code"}), b'data: {"error": "text only"}\n\ndata: [DONE]\n\n'],
    ids=["code-500", "no-code", "bare-string"],
)
async def test_a_5xx_or_code_less_frame_is_retried_on_the_other_engine(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, body: bytes
) -> None:
    fleet = await start_fleet()
    scripted = script(fleet, body, ("sim-a",))
    with trio.fail_after(30):
        for _ in range(4):  # whichever engine is chosen first, the answer is whole
            response = await fleet.chat(stream=True, narwhal_sim={"output_tokens": 3})
            assert response.status_code == 200, response.text
            assert sse_payloads(response.text)[-1] == "[DONE]"
    assert fleet.counters()["completed"] == 4
    assert posts(scripted) >= 1
    fleet.assert_quiescent()


# -- after response headers ---------------------------------------------------------------------


async def test_a_4xx_frame_after_headers_is_relayed_in_band_normalised(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    scripted = script(fleet, role_then(BAD_LOGPROBS))
    with trio.fail_after(30):
        response = await fleet.chat(stream=True)
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2]) == {
        "error": {
            "message": "Requested sample logprobs of 50, which is greater than max allowed: 20 "
            "(parameter=logprobs, value=50)",
            "type": "invalid_request_error",
            "param": "logprobs",
            "code": "400",
        }
    }
    assert any('"Hi"' in payload for payload in payloads[:-2]), "the output went out first"
    assert posts(scripted) == 1
    counters = fleet.counters()
    assert (counters["invalid_requests"], counters["failed"]) == (1, 0)
    assert engine_failures(fleet) == [0, 0]
    fleet.assert_quiescent()


async def test_a_5xx_frame_after_headers_stays_an_engine_error_in_band(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    scripted = script(fleet, role_then(INTERNAL))
    with trio.fail_after(30):
        response = await fleet.chat(stream=True)
    error = json.loads(sse_payloads(response.text)[-2])["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "engine_error")
    assert "Internal server error" in error["message"]
    assert posts(scripted) == 1
    assert fleet.counters()["failed"] == 1
    fleet.assert_quiescent()


@pytest.mark.parametrize("error", [BAD_LOGPROBS, INTERNAL], ids=["4xx", "5xx"])
async def test_output_read_with_the_error_reaches_the_client_before_it(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, error: bytes
) -> None:
    """Output and an error frame in one network read: the output gathered for the client's
    next write once went nowhere, and the client saw only the error."""
    fleet = await start_fleet()
    for scripted in script(fleet, role_then(error)):
        scripted.one_read = True
    with trio.fail_after(30):
        response = await fleet.chat(stream=True)
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert [json.loads(p)["choices"][0]["delta"] for p in payloads[:2]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]
    assert "error" in json.loads(payloads[2]) and payloads[3:] == ["[DONE]"]
    fleet.assert_quiescent()


async def test_a_4xx_frame_after_output_of_a_non_streaming_request_keeps_its_status(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    script(fleet, role_then(BAD_LOGPROBS))
    with trio.fail_after(30):
        response = await fleet.chat()
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logprobs"
    assert fleet.counters()["invalid_requests"] == 1
    fleet.assert_quiescent()


# -- every 502 a retry cannot cure says so ------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("fault", "code"),
    [
        ("http_500", "engine_error"),
        ("http_503", "engine_error"),
        ("error_frame", "engine_error"),
        ("truncate", "engine_error"),
        ("drop", "engine_error"),
        ("non_json", "malformed_engine_response"),
        ("malformed_token_ids", "malformed_engine_response"),
        ("unsupported_field", "unsupported_engine_field"),
    ],
)
async def test_both_attempts_failing_says_do_not_retry(
    start_fleet: StartFleet,
    autojump_clock: trio.testing.MockClock,
    fault: str,
    code: str,
    stream: bool,
) -> None:
    fleet = await start_fleet()
    with trio.fail_after(30):
        response = await fleet.chat(stream=stream, narwhal_sim={"fault": fault})
    if fault == "unsupported_field" and stream:
        assert response.status_code == 200  # forwarded as is: streams keep the engine's shape
        return
    assert response.status_code == 502, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["code"] == code
    fleet.assert_quiescent()


async def test_no_other_engine_for_the_retry_says_do_not_retry(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    with trio.fail_after(30):
        failed = await fleet.chat(stream=True, narwhal_sim={"fault": "http_500"})
        fleet.plugs["sim-a"].down = True
        unreachable = await fleet.chat()
    for response in (failed, unreachable):
        assert response.status_code == 502, response.text
        assert response.headers["x-should-retry"] == "false"
        assert response.json()["error"]["message"].startswith("The engine failed to answer:")
    assert fleet.completions_received() == 1
    fleet.assert_quiescent()


async def test_a_non_streaming_answer_broken_after_its_output_may_be_retried(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    # Narwhal does not retry it (output had begun): the client may.
    fleet = await start_fleet()
    with trio.fail_after(30):
        response = await fleet.chat(narwhal_sim={"fault": "error_frame", "fault_at": 3})
    assert response.status_code == 502
    assert "x-should-retry" not in response.headers
    assert fleet.completions_received() == 1


# -- through the official openai client, on real sockets -----------------------------------------


class FrameEngine:
    """A raw-socket engine: healthy probes; each completion request answered with ``body``."""

    def __init__(self) -> None:
        self.body = BAD_LOGPROBS
        self.posts = 0

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
                self.posts += 1
                await stream.send_all(answer(self.body, b"text/event-stream"))


@pytest.fixture
async def frame_engines(nursery: trio.Nursery) -> AsyncIterator[tuple[str, list[FrameEngine]]]:
    engines = [FrameEngine(), FrameEngine()]
    configs = []
    for index, engine in enumerate(engines):
        url, _ = await serve(nursery, engine)
        configs.append(EngineConfig(name=f"raw-{index}", url=url, token_ids=False))
    # Stand-ins that answer every completion with one body cannot be profiled.
    config = Config(
        serving=ServingConfig(model=MODEL),
        engines=tuple(configs),
        monitoring=MonitoringConfig(profiling=False),
    )
    urls = await nursery.start(partial(serve_router, config, bind="127.0.0.1:0"))
    await wait_ready(urls[0])
    yield urls[0], engines


def sdk_call(url: str, stream: bool) -> Callable[[], object]:
    def call() -> object:
        # The client's default retries (two), as users run it.
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=20) as client:
            return client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello"}],
                logprobs=True,
                top_logprobs=50,
                stream=stream,
            )

    return call


@pytest.mark.realtime
@pytest.mark.parametrize("stream", [True, False])
async def test_openai_gets_a_bad_request_from_one_post(
    frame_engines: tuple[str, list[FrameEngine]], stream: bool
) -> None:
    url, engines = frame_engines
    with trio.fail_after(30), pytest.raises(openai.BadRequestError) as raised:
        await trio.to_thread.run_sync(sdk_call(url, stream))
    assert raised.value.status_code == 400
    assert raised.value.param == "logprobs"
    assert raised.value.code == "400"
    assert sum(engine.posts for engine in engines) == 1


@pytest.mark.realtime
@pytest.mark.parametrize("stream", [True, False])
async def test_openai_does_not_retry_narwhals_502(
    frame_engines: tuple[str, list[FrameEngine]], stream: bool
) -> None:
    url, engines = frame_engines
    for engine in engines:
        engine.body = INTERNAL
    with trio.fail_after(30), pytest.raises(openai.InternalServerError) as raised:
        await trio.to_thread.run_sync(sdk_call(url, stream))
    assert raised.value.status_code == 502
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert [engine.posts for engine in engines] == [1, 1], "Narwhal's one retry, nothing more"


# -- a prompt longer than the engine's context: the engine's own 400 -------------------------------

LONG = "word " * 48_000  # 240,000 characters: about 60,000 tokens to the router's sizing
TOO_LONG_MESSAGE = "This model's maximum context length is 32768 tokens."


def pure_engine(name: str, context: int | None, *, token_ids: bool = True) -> Engine:
    engine = Engine(
        EngineConfig(name=name, url=f"http://{name}.test"),
        client=cast(Any, None),
        prefill_limit=4,
        decode_limit=8,
        forecast=PrefillForecast(PROFILES["h100-llama3-8b"], prefill_limit=4),
        token_accounting="token_ids" if token_ids else "unavailable",
    )
    engine.poll_succeeded(0.0)
    if context is not None:
        engine.model_card = {"id": MODEL, "max_model_len": context}
    return engine


def test_a_prompt_fits_an_engine_of_unknown_or_longer_context() -> None:
    unknown, short, long = pure_engine("u", None), pure_engine("s", 1024), pure_engine("l", 8192)
    assert fits(unknown, 10**9) and fits(short, 1024) and not fits(short, 1025)
    assert too_short([unknown, short, long], 2000) == [short]
    assert beyond_context([unknown, short], 2000, False) is None  # it may fit the unknown one
    assert beyond_context([short, long], 2000, False) is None
    assert beyond_context([short, long], 9000, False) is long  # the longest context
    assert beyond_context([], 9000, False) is None  # no engine: the caller's 503
    assert placed_size(long, 9000) == 8192 and placed_size(unknown, 9000) == 9000


def test_only_candidates_decide_beyond_context() -> None:
    without_ids = pure_engine("n", None, token_ids=False)
    short = pure_engine("s", 1024)
    # The engine of unknown context cannot serve a request that needs token IDs.
    assert beyond_context([without_ids, short], 2000, True) is short
    assert beyond_context([without_ids, short], 2000, False) is None
    gone = pure_engine("g", 65536)
    gone.poll_failed(1.0, Failure("connect", "unreachable"))
    assert not gone.eligible
    assert beyond_context([gone, short], 2000, False) is short


def test_the_projection_never_refuses_a_prompt_beyond_every_context() -> None:
    engine = pure_engine("a", 32768)
    waiter = Waiter(60_000, False, "chat", None, enqueued_at=0.0)
    projection = project(
        [engine], [], waiter, OutputLengths(), now=0.0, elapsed_s=0.0, overhead_s=0.005
    )
    assert projection is not None and projection.beyond_context
    # Sized at the context, the most the engine can prefill, and placed now.
    assert projection.prompt_alone_s == pytest.approx(engine.forecast.standalone_s(32768) + 0.005)
    assert projection.prompt_alone_s > 2.0
    check_budget(projection, 2.0)  # no refusal: the engine answers
    within = Waiter(30_000, False, "chat", None, enqueued_at=0.0)
    fitting = project([engine], [], within, OutputLengths(), now=0.0, elapsed_s=0.0, overhead_s=0)
    assert fitting is not None and not fitting.beyond_context
    with pytest.raises(PredictiveRefusal):
        check_budget(fitting, 2.0)


def test_the_projection_skips_engines_too_short_for_the_prompt() -> None:
    short, long = pure_engine("short", 1024), pure_engine("long", 65536)
    long.forecast.scale = 3.0  # slower: it would not be chosen on speed
    waiter = Waiter(4000, False, "chat", None, enqueued_at=0.0)
    projection = project(
        [short, long], [], waiter, OutputLengths(), now=0.0, elapsed_s=0.0, overhead_s=0.0
    )
    assert projection is not None
    assert (projection.engine, projection.beyond_context) == ("long", False)
    assert projection.prompt_alone_s == pytest.approx(long.forecast.standalone_s(4000))


@pytest.mark.parametrize("mode", ["predictive", "open"])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_prompt_over_the_context_gets_the_engines_own_400(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, mode: str, stream: bool
) -> None:
    fleet = await start_fleet(admission=AdmissionConfig(mode=mode))  # type: ignore[arg-type]
    limited = limit_context(fleet, {"sim-a": 32768, "sim-b": 32768})
    start = trio.current_time()
    with trio.fail_after(30):
        response = await fleet.chat(stream=stream, messages=[{"role": "user", "content": LONG}])
    assert trio.current_time() - start < 0.05, "answered at once"
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(TOO_LONG_MESSAGE)
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "input_tokens",
        "400",
    )
    assert sum(engine.posts for engine in limited.values()) == 1, "not retried"
    counters = fleet.counters()
    assert (counters["invalid_requests"], counters["refused"], counters["failed"]) == (1, 0, 0)
    assert fleet.router.queue.statistics().placed_over_context == 1
    assert engine_failures(fleet) == [0, 0]
    fleet.assert_quiescent()


async def test_without_a_known_context_the_long_prompt_is_still_refused_by_budget(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()  # the simulator's context (131072) holds the prompt
    with trio.fail_after(30):
        response = await fleet.chat(messages=[{"role": "user", "content": LONG}])
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "prompt_exceeds_ttft_budget"


@pytest.mark.parametrize("mode", ["predictive", "open"])
async def test_a_prompt_over_the_context_does_not_wait_behind_the_queue(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, mode: str
) -> None:
    admission = AdmissionConfig(
        mode=mode,  # type: ignore[arg-type]
        prefill_concurrency=1,
        decode_concurrency=1,
    )
    fleet = await start_fleet([("sim-a", "vllm")], admission=admission)
    limit_context(fleet, {"sim-a": 32768})
    answers: dict[str, tuple[int, float]] = {}

    async def send(name: str, **body: Any) -> None:
        response = await fleet.chat(**body)
        answers[name] = (response.status_code, trio.current_time())

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            busy = {"output_tokens": 50, "itl_s": 0.1}  # five seconds on the only seat
            nursery.start_soon(partial(send, "running", narwhal_sim=busy))
            await until(lambda: fleet.router.pool.engines[0].decode == 1)
            if mode == "open":
                nursery.start_soon(partial(send, "queued", narwhal_sim={"output_tokens": 2}))
                await until(lambda: fleet.router.queue.statistics().depth == 1)
            start = trio.current_time()
            await send("long", messages=[{"role": "user", "content": LONG}])
            assert answers["long"] == (400, start), "at once, whatever waits"
            if mode == "open":
                assert fleet.router.queue.statistics().depth == 1, "the queue goes on waiting"
    assert answers["running"][0] == 200
    if mode == "open":
        assert answers["queued"][0] == 200  # placed when the seat freed: nothing blocked
        assert answers["queued"][1] >= answers["running"][1]
    fleet.assert_quiescent()


def learned(router: Router) -> tuple[object, ...]:
    """What the router has learned: each engine's speed, the safety margin, the sizing."""
    speeds = [
        (e.forecast.scale, e.forecast.latency_s, e.forecast.decode_scale) for e in router.pool
    ]
    return (speeds, router.margin.factor, router.sizer.statistics())


async def test_refused_long_prompts_teach_the_predictor_nothing(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    limit_context(fleet, {"sim-a": 32768, "sim-b": 32768})
    with trio.fail_after(60):
        for _ in range(3):  # something learned first
            assert (await fleet.chat(narwhal_sim={"output_tokens": 4})).status_code == 200
        router = fleet.router
        before = learned(router)
        for _ in range(20):
            response = await fleet.chat(messages=[{"role": "user", "content": LONG}])
            assert response.status_code == 400
        assert learned(router) == before
        for engine in router.pool:
            assert engine.forecast.pending == {} and engine.forecast.in_prefill == 0
        assert (await fleet.chat(narwhal_sim={"output_tokens": 4})).status_code == 200
    fleet.assert_quiescent()


async def test_a_prompt_sized_over_the_context_that_fits_after_all_is_served(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    # The router's estimate (4 characters a token) is twice the engine's count: the engine
    # serves it, and its place was sized at the context, the most it could prefill.
    fleet = await start_fleet([("sim-a", "vllm")])
    (engine,) = limit_context(fleet, {"sim-a": 32768}).values()
    engine.chars_per_token = 8
    sizes: list[int] = []
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONG}],
        "stream": True,
        "narwhal_sim": {"output_tokens": 3, "prompt_tokens": 30_000},
    }
    with trio.fail_after(60):
        async with fleet.client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            sizes = [slot.prompt_tokens for slot in fleet.router.pool.engines[0].slots]
            text = (await response.aread()).decode()
    assert sizes == [32768]
    assert sse_payloads(text)[-1] == "[DONE]"
    assert fleet.counters()["completed"] == 1
    fleet.assert_quiescent()


async def test_placement_avoids_an_engine_too_short_for_the_prompt(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    limited = limit_context(fleet, {"sim-a": 1024, "sim-b": 65536})
    fleet.router.pool.engines[1].forecast.scale = 3.0  # slower: not chosen on speed
    prompt = "word " * 2400  # about 3,000 tokens
    with trio.fail_after(60):
        for _ in range(4):
            response = await fleet.chat(
                messages=[{"role": "user", "content": prompt}],
                narwhal_sim={"output_tokens": 2},
            )
            assert response.status_code == 200, response.text
        short = await fleet.chat(narwhal_sim={"output_tokens": 2})
        assert short.status_code == 200
    assert (limited["sim-a"].posts, limited["sim-b"].posts) == (1, 4)
    assert limited["sim-a"].refused == 0
    fleet.assert_quiescent()


async def test_the_retry_never_goes_to_an_engine_too_short_for_the_prompt(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    limited = limit_context(fleet, {"sim-a": 1024, "sim-b": 65536})
    fleet.set_directives("sim-b", {"fault": "http_500"})
    with trio.fail_after(30):
        response = await fleet.chat(messages=[{"role": "user", "content": "word " * 2400}])
    assert response.status_code == 502, response.text
    assert response.headers["x-should-retry"] == "false"
    assert (limited["sim-a"].posts, limited["sim-b"].posts) == (0, 1)
    fleet.assert_quiescent()
