"""What Narwhal says of the engines behind it, and how it identifies itself to them: the engines'
own model object on ``/v1/models``, the request id end to end, and per-engine API keys."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import Config, EngineConfig, MonitoringConfig, ServingConfig
from narwhal.router import Router
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import profile
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
        self.inner = SimTransport(SimEngine(model, timing=profile("h100-llama3-8b"), name=name))
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
