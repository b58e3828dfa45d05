"""What Narwhal says of the engines behind it, and how it identifies itself to them: the engines'
own model object on ``/v1/models``, the request id end to end, and per-engine API keys."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import Config, ConfigError, EngineConfig, MonitoringConfig, ServingConfig
from narwhal.logs import NO_REQUEST, RequestIdFilter, current_request_id, request_context
from narwhal.router import Router
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.web.app import create_app, get_router

MODEL = "tiny"

# vLLM 0.32's own answer to GET /v1/models (reference/vllm-0.32-cpu-captures/models.txt).
VLLM_CARD: dict[str, Any] = {
    "id": "tiny",
    "object": "model",
    "created": 1796114271,
    "owned_by": "vllm",
    "root": "/tmp/realvllm-tiny",
    "parent": None,
    "max_model_len": 2048,
    "permission": [
        {
            "id": "modelperm-9e3367ad1f4997ca",
            "object": "model_permission",
            "created": 1796114271,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
    ],
}


class StandIn(httpx.AsyncBaseTransport):
    """An engine in front of the simulator: its own ``/v1/models`` card, an optional API key
    (vLLM's ``--api-key``: ``/v1/...`` answers 401 without ``Authorization: Bearer <key>``),
    the headers of every request it received, and a switch to refuse connections."""

    def __init__(
        self,
        name: str,
        *,
        card: Mapping[str, Any] | None = None,
        api_key: str | None = None,
        model: str = MODEL,
    ) -> None:
        self.inner = SimTransport(
            SimEngine(model, timing=StepTiming(get_profile("h100-llama3-8b")), name=name)
        )
        self.card = card
        self.api_key = api_key
        self.seen: list[tuple[str, str, httpx.Headers]] = []
        self.down = False

    def completion_headers(self) -> list[httpx.Headers]:
        return [headers for method, _, headers in self.seen if method == "POST"]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        self.seen.append((request.method, path, request.headers))
        if self.api_key is not None and path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {self.api_key}":
                return httpx.Response(401, json={"error": "Unauthorized"})
        if path == "/v1/models" and self.card is not None:
            return httpx.Response(200, json={"object": "list", "data": [self.card]})
        return await self.inner.handle_async_request(request)


@attrs.define
class Front:
    """A router before stand-in engines, and a client to it."""

    router: Router
    client: httpx.AsyncClient
    engines: dict[str, StandIn]

    async def models(self, path: str = "/v1/models") -> httpx.Response:
        return await self.client.get(path)


StartFront = Callable[..., Awaitable[Front]]


def engine(name: str, **kwargs: Any) -> EngineConfig:
    return EngineConfig(name=name, url=f"http://{name}.test", **kwargs)


@pytest.fixture
async def start_front(nursery: trio.Nursery) -> AsyncIterator[StartFront]:
    clients: list[httpx.AsyncClient] = []

    async def start(
        engines: Mapping[EngineConfig, StandIn], *, wait_ready: bool = True, **config: Any
    ) -> Front:
        config.setdefault("serving", ServingConfig(model=MODEL))
        settings = Config(engines=tuple(engines), **config)
        transports = {settings.name: transport for settings, transport in engines.items()}
        app = create_app(settings, transports=transports)
        await nursery.start(partial(run_lifespan, app))
        client = httpx.AsyncClient(
            transport=ASGIStreamTransport(app, nursery), base_url="http://narwhal.test"
        )
        clients.append(client)
        front = Front(get_router(app), client, transports)
        if wait_ready:
            with trio.fail_after(60):
                await front.router.wait_ready()
        return front

    yield start
    for client in clients:
        await client.aclose()


# -- item 6: /v1/models is the engines' own model object ---------------------------------------


async def test_models_serves_the_engines_own_object_value_for_value(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    front = await start_front({engine("vllm-a"): StandIn("vllm-a", card=VLLM_CARD)})
    listing = await front.models()
    assert listing.status_code == 200
    assert listing.json() == {"object": "list", "data": [VLLM_CARD]}
    assert front.router.pool.engines[0].max_model_len == 2048
    single = await front.models("/v1/models/tiny")
    assert single.status_code == 200
    assert single.json() == VLLM_CARD


async def test_another_model_id_is_a_404_model_not_found(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    front = await start_front({engine("vllm-a"): StandIn("vllm-a", card=VLLM_CARD)})
    for path in ("/v1/models/other", "/v1/models/org/tiny", "/v1/models/tiny/extra"):
        response = await front.models(path)
        assert response.status_code == 404, path
        assert response.json()["error"] == {
            "message": f"The model `{path.removeprefix('/v1/models/')}` does not exist here; "
            "this router serves `tiny`.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }


async def test_a_model_id_with_a_slash_is_one_id(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    card = VLLM_CARD | {"id": "org/tiny-1b"}
    front = await start_front(
        {engine("vllm-a"): StandIn("vllm-a", card=card, model="org/tiny-1b")},
        serving=ServingConfig(model="org/tiny-1b"),
    )
    for path in ("/v1/models/org/tiny-1b", "/v1/models/org%2Ftiny-1b"):
        response = await front.models(path)
        assert response.status_code == 200, path
        assert response.json() == card


async def test_before_any_engine_reports_the_object_is_minimal(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    down = StandIn("vllm-a", card=VLLM_CARD)
    down.down = True
    front = await start_front({engine("vllm-a"): down}, wait_ready=False)
    await trio.sleep(1)
    minimal = {"id": "tiny", "object": "model", "created": 0, "owned_by": "narwhal"}
    assert (await front.models()).json() == {"object": "list", "data": [minimal]}
    assert (await front.models("/v1/models/tiny")).json() == minimal


async def test_an_eligible_engines_object_is_served_first(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    first = StandIn("vllm-a", card=VLLM_CARD)
    second = StandIn("vllm-b", card=VLLM_CARD | {"max_model_len": 4096})
    front = await start_front(
        {engine("vllm-a"): first, engine("vllm-b"): second},
        monitoring=MonitoringConfig(poll_interval_s=1.0),
    )
    with trio.fail_after(10):
        while not all(engine.eligible for engine in front.router.pool):  # noqa: ASYNC110
            await trio.sleep(0.1)
    assert (await front.models("/v1/models/tiny")).json()["max_model_len"] == 2048
    first.down = True  # a refused connection opens its circuit at the next poll
    with trio.fail_after(10):
        while front.router.pool.engines[0].eligible:  # noqa: ASYNC110
            await trio.sleep(0.1)
    assert (await front.models("/v1/models/tiny")).json()["max_model_len"] == 4096
    second.down = True
    with trio.fail_after(10):
        while front.router.pool.engines[1].eligible:  # noqa: ASYNC110
            await trio.sleep(0.1)
    # None is eligible: the last object the first engine reported.
    assert (await front.models("/v1/models/tiny")).json() == VLLM_CARD


async def test_the_object_follows_the_engine(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    stand_in = StandIn("vllm-a", card=VLLM_CARD)
    front = await start_front({engine("vllm-a"): stand_in})
    stand_in.card = VLLM_CARD | {"max_model_len": 1024, "created": 1796114300}
    await trio.sleep(1.5)  # the next poll
    assert front.router.pool.engines[0].max_model_len == 1024
    assert (await front.models()).json()["data"][0]["created"] == 1796114300


# -- item 7: the request id --------------------------------------------------------------------


def failing(name: str) -> dict[str, Any]:
    return {"output_tokens": 6, "fault": name, "fault_at": 0}


async def chat(front: Front, request_id: str | None = None, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "Hello there"}])
    headers = {} if request_id is None else {"x-request-id": request_id}
    return await front.client.post("/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize("stream", [True, False])
async def test_the_clients_id_reaches_every_engine_tried_and_comes_back(
    start_front: StartFront, autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    first, second = StandIn("vllm-a"), StandIn("vllm-b")
    front = await start_front({engine("vllm-a"): first, engine("vllm-b"): second})
    first.inner.engine.set_directives(failing("http_500"))  # the first choice: retried
    response = await chat(front, "bench-0017", stream=stream)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "bench-0017"
    tried = [headers["x-request-id"] for headers in first.completion_headers()[-1:]]
    answered = [headers["x-request-id"] for headers in second.completion_headers()[-1:]]
    assert tried == answered == ["bench-0017"]


async def test_without_a_usable_id_one_is_made_and_sent_everywhere(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    stand_in = StandIn("vllm-a")
    front = await start_front({engine("vllm-a"): stand_in})
    for given in (None, "", "x" * 129, "caf\u00e9"):
        headers = {} if given is None else {"x-request-id": given}
        response = await front.client.post(
            "/v1/completions",
            content=orjson.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
            headers={"content-type": "application/json"}
            | {name: value.encode() for name, value in headers.items()},  # type: ignore[misc]
        )
        made = response.headers["x-request-id"]
        assert len(made) == 32 and made != given
        assert stand_in.completion_headers()[-1]["x-request-id"] == made


async def test_every_route_answers_with_a_request_id(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    front = await start_front({engine("vllm-a"): StandIn("vllm-a")})
    for path in ("/v1/models", "/v1/models/tiny", "/v1/models/other", "/health", "/nowhere"):
        given = await front.client.get(path, headers={"x-request-id": "probe-1"})
        assert given.headers.get_list("x-request-id") == ["probe-1"], path
        made = await front.client.get(path)
        assert len(made.headers["x-request-id"]) == 32, path


async def test_every_log_line_about_a_request_carries_its_id(
    start_front: StartFront,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.INFO, logger="narwhal")
    first, second = StandIn("vllm-a"), StandIn("vllm-b")
    front = await start_front(
        {engine("vllm-a"): first, engine("vllm-b"): second},
        monitoring=MonitoringConfig(failure_threshold=1),
    )
    joins = [record for record in caplog.records if "joined" in record.getMessage()]
    assert joins and {record.request_id for record in joins} == {NO_REQUEST}  # type: ignore[attr-defined]
    caplog.clear()
    # A broken connection on the first engine: the upstream client, the engine's health (its
    # circuit opens) and the exchange (the retry) each log a line, on the request's behalf.
    first.inner.engine.set_directives(failing("drop"))
    response = await chat(front, "trace-me")
    assert response.status_code == 200
    about = [record for record in caplog.records if record.name.startswith("narwhal.")]
    assert {record.name for record in about} >= {
        "narwhal.upstream.client",
        "narwhal.upstream.health",
        "narwhal.upstream.exchange",
    }
    assert {record.request_id for record in about} == {"trace-me"}  # type: ignore[attr-defined]
    assert current_request_id() == NO_REQUEST


def test_a_record_logged_outside_a_request_says_so() -> None:
    record = logging.LogRecord("narwhal.x", logging.INFO, __file__, 1, "m", None, None)
    assert RequestIdFilter().filter(record) and record.request_id == NO_REQUEST  # type: ignore[attr-defined]
    with request_context("abc"):
        inside = logging.LogRecord("narwhal.x", logging.INFO, __file__, 1, "m", None, None)
        RequestIdFilter().filter(inside)
        assert current_request_id() == "abc"
    assert inside.request_id == "abc"  # type: ignore[attr-defined]
    assert current_request_id() == NO_REQUEST


@pytest.mark.realtime
def test_the_command_lines_log_format_shows_the_request_id() -> None:
    program = (
        "import logging\n"
        "from narwhal.logs import configure_logging, request_context\n"
        "configure_logging(logging.INFO)\n"
        "log = logging.getLogger('narwhal.upstream.exchange')\n"
        "log.info('polled')\n"
        "with request_context('req-9'):\n"
        "    log.warning('attempt failed')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stderr.splitlines()
    assert lines[0].endswith(" INFO narwhal.upstream.exchange [-]: polled")
    assert lines[1].endswith(" WARNING narwhal.upstream.exchange [req-9]: attempt failed")


# -- item 8: per-engine API keys ---------------------------------------------------------------

KEY = "sk-test-0123456789abcdef"


async def test_the_key_goes_with_every_call_to_its_engine_and_nowhere_else(
    start_front: StartFront,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("ENGINE_A_KEY", KEY)
    guarded = StandIn("vllm-a", api_key=KEY)
    open_ = StandIn("vllm-b")
    front = await start_front(
        {engine("vllm-a", api_key_env="ENGINE_A_KEY"): guarded, engine("vllm-b"): open_}
    )
    for stream in (True, False):
        for _ in range(2):  # whichever engine is chosen
            assert (await chat(front, stream=stream)).status_code == 200
    calls = {(method, path) for method, path, _ in guarded.seen}
    assert calls >= {
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),  # the token-ID probe
        ("POST", "/v1/chat/completions"),
    }
    assert {headers.get("authorization") for _, _, headers in guarded.seen} == {f"Bearer {KEY}"}
    assert {headers.get("authorization") for _, _, headers in open_.seen} == {None}
    shown = [
        caplog.text,
        (await front.client.get("/ready")).text,
        (await front.client.get("/metrics")).text,
        repr(front.router.config),
        repr(front.router.pool.engines[0].client.http.headers),  # type: ignore[attr-defined]
    ]
    assert not [text for text in shown if KEY in text]


@pytest.mark.parametrize(
    ("api_key_env", "reason"),
    [
        ("", "the engine wants an API key: set engines[].api_key_env"),
        ("ENGINE_A_KEY", "the engine refused the API key in ENGINE_A_KEY"),
    ],
)
async def test_an_engine_that_refuses_says_why_it_has_not_joined(
    start_front: StartFront,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    api_key_env: str,
    reason: str,
) -> None:
    monkeypatch.setenv("ENGINE_A_KEY", "not-the-key")
    front = await start_front(
        {engine("vllm-a", api_key_env=api_key_env): StandIn("vllm-a", api_key=KEY)},
        wait_ready=False,
    )
    await trio.sleep(3)
    ready = await front.client.get("/ready")
    assert ready.status_code == 503
    assert ready.json()["engines"][0]["reason"] == f"joining: /v1/models answered 401 ({reason})"
    assert "not-the-key" not in ready.text


def test_a_key_gone_from_the_environment_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_A_KEY", KEY)
    config = Config(engines=(engine("vllm-a", api_key_env="ENGINE_A_KEY"),))
    monkeypatch.delenv("ENGINE_A_KEY")
    with pytest.raises(
        ConfigError,
        match="engine vllm-a: api_key_env: the environment variable ENGINE_A_KEY is not set",
    ):
        Router(config)


# -- the token-ID probe ---------------------------------------------------------------------------


class ProbeAnswer(StandIn):
    """Answers the token probe with ``events`` (an SSE body); everything else as the simulator."""

    def __init__(self, name: str, events: list[dict[str, Any]], **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        frames = b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)
        self.answer = frames + b"data: [DONE]\n\n"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            content = await request.aread()
            if orjson.loads(content).get("prompt") == "Narwhal token probe":
                self.seen.append((request.method, request.url.path, request.headers))
                return httpx.Response(
                    200,
                    stream=httpx.ByteStream(self.answer),
                    headers={"content-type": "text/event-stream"},
                )
            request = httpx.Request(
                request.method, request.url, headers=request.headers, content=content
            )
        return await super().handle_async_request(request)


# vLLM 0.32's answer when the sampled tokens are parts of one character: chunks with IDs and no
# text yet (reference/vllm-0.32-cpu-captures).
HELD_BACK = [
    {"object": "text_completion", "choices": [{"index": 0, "text": "", "token_ids": [161]}]},
    {
        "object": "text_completion",
        "choices": [{"index": 0, "text": "", "token_ids": [162], "finish_reason": "length"}],
    },
]
# vLLM's refusal of a parameter it checks once streaming: an HTTP 200 whose only event is an
# error frame with a 4xx code.
REFUSED = [{"error": {"message": "no IDs here", "type": "BadRequestError", "code": 400}}]


async def test_ids_without_text_still_show_the_engine_provides_them(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    """The probe once read only output events: two held-back tokens made a real vLLM
    ``token_accounting: unavailable``, and every ``return_token_ids`` request a 400."""
    front = await start_front({engine("vllm-a"): ProbeAnswer("vllm-a", HELD_BACK, card=VLLM_CARD)})
    assert front.router.pool.engines[0].token_accounting == "token_ids"


async def test_an_in_band_refusal_of_the_probe_joins_without_token_accounting(
    start_front: StartFront, autojump_clock: trio.testing.MockClock
) -> None:
    """As an HTTP 4xx does: the engine joins, ``token_accounting: unavailable``."""
    front = await start_front(
        {engine("vllm-a"): ProbeAnswer("vllm-a", REFUSED, card=VLLM_CARD)},
        monitoring=MonitoringConfig(profiling=False),  # the stand-in refuses every completion
    )
    assert front.router.pool.engines[0].token_accounting == "unavailable"
    assert front.router.pool.engines[0].eligible
