"""A router in front of simulated engines, all in one Trio run: the virtual-time benchmarks' fleet.

Nothing here touches a socket. The engines are :class:`~narwhal.sim.engine.SimEngine` objects
served to the router's upstream clients by :class:`~narwhal.sim.transport.SimTransport`; the
router's ASGI app is served to the benchmark's client by :class:`ASGIStreamTransport`, which
(unlike httpx's ``ASGITransport``, which buffers the whole body) returns the response as soon as
its headers go out and yields body chunks as the app sends them. Under
``trio.testing.MockClock(autojump_threshold=0)`` the whole fleet runs in virtual time: an hour
of traffic takes the CPU time its requests cost, and no more.

Relaying every token through the whole stack is what costs CPU, so the engines can send
several tokens a chunk (:class:`CoalescingSimEngine`): the first token still goes alone, at the
end of the prefill (the TTFT is exact), and each later chunk carries ``tokens_per_chunk`` tokens
with all their IDs, as vLLM does with ``stream_interval``. The router counts IDs, not chunks.

What the engines really do is theirs, not the router's (:class:`EngineTruth`): by default each
runs the simulator's calibrated engine type named by its configured profile
(:mod:`narwhal.sim.calibration`), varied by its seed, while the router predicts from its own
prior (:mod:`narwhal.scheduling.profiles`). The truth can be made wronger still: other engine
types than the router is told, every engine some factor slower, an engine that turns slower at
a point of the run (:class:`Slowdown`); or, for comparison with the old benchmark, exactly the
router's prior (``prior=True``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import httpx
import orjson
import trio
import trio.testing

from narwhal.config import Config
from narwhal.router import Router
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.calibration import ALIASES, VARIATION
from narwhal.sim.engine import SimEngine, SimPlan
from narwhal.sim.timing import StepTiming, TimingModel
from narwhal.sim.timing import profile as timing_profile
from narwhal.sim.transport import SimTransport
from narwhal.upstream.transport import read_once
from narwhal.web.app import create_app, get_router
from narwhal.workers.worker import WorkerRouter

__all__ = [
    "ASGIStreamTransport",
    "CoalescingSimEngine",
    "EngineTruth",
    "InProcessFleet",
    "Slowdown",
    "engine_cap_supported",
    "open_fleet",
    "run_lifespan",
]

_BODY_PIECE = 1 << 16
_COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value!r}")


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


@attrs.frozen
class Slowdown:
    """One engine turns ``factor`` times slower at a point of a replay.

    Attributes:
        engine: the engine's name.
        at: when, as a fraction of the replay's span (0.5: half way through the arrivals).
        factor: the engine's slowdown from then on (:meth:`SimEngine.schedule_slowdown`).
    """

    engine: str
    at: float = attrs.field(validator=_fraction)
    factor: float = attrs.field(validator=_positive)

    @classmethod
    def parse(cls, text: str) -> Slowdown:
        """``ENGINE@AT:FACTOR``, e.g. ``engine-b@0.5:2.0``.

        Raises:
            ValueError: not of that form, or a value out of range.
        """
        engine, at_sign, rest = text.partition("@")
        at, colon, factor = rest.partition(":")
        if not (engine and at_sign and colon):
            raise ValueError(f"expected ENGINE@AT:FACTOR (e.g. engine-b@0.5:2.0), got {text!r}")
        try:
            return cls(engine.strip(), float(at), float(factor))
        except ValueError as exc:
            raise ValueError(f"{text!r}: {exc}") from None

    def __str__(self) -> str:
        return f"{self.engine}@{self.at:g}:{self.factor:g}"


@attrs.frozen
class EngineTruth:
    """How the simulated engines really behave, whatever the router is told.

    Attributes:
        types: each engine's simulated engine type, by position (cycled); empty: the type of
            the engine's configured profile's name (so the truth is the same hardware as the
            prior says, on the simulator's own calibrated constants).
        scale: every engine's step costs times this (2: twice as slow as its type).
        variation: the per-engine spread (:meth:`~narwhal.sim.calibration.EngineType.varied`,
            seeded by the engine's seed).
        prior: run the engines on the router's own profile instead (truth equals the prior,
            up to ``scale``; no variation): the old benchmark, for comparison.
        slowdowns: engines that turn slower during a replay.
    """

    types: tuple[str, ...] = ()
    scale: float = attrs.field(default=1.0, validator=_positive)
    variation: float = VARIATION
    prior: bool = False
    slowdowns: tuple[Slowdown, ...] = ()

    def engine_type(self, configured: str, index: int) -> str:
        """The engine type of engine ``index`` whose configured profile is ``configured``."""
        name = self.types[index % len(self.types)] if self.types else configured
        return ALIASES.get(name, name)

    def timing(self, name: str, *, seed: int, time_scale: float = 1.0) -> TimingModel:
        """The timing model of an engine of type ``name`` built with ``seed``."""
        if self.prior:
            return StepTiming(get_profile(name), time_scale=time_scale * self.scale)
        return timing_profile(
            name,
            time_scale=time_scale,
            seed=seed,
            variation=self.variation,
            truth_scale=self.scale,
        )

    def as_json(self) -> dict[str, object]:
        """Plain values for the JSON report."""
        return {
            "types": list(self.types),
            "scale": self.scale,
            "variation": 0.0 if self.prior else self.variation,
            "prior": self.prior,
            "slowdowns": [str(slowdown) for slowdown in self.slowdowns],
        }


@attrs.define(eq=False)
class CoalescingSimEngine(SimEngine):
    """A :class:`SimEngine` that streams ``tokens_per_chunk`` tokens a chunk, the first alone.

    Narwhal asks vLLM engines for ``stream_interval: 1``; this engine answers streams as if the
    request (or the server's own setting) said ``tokens_per_chunk``: vLLM's rule, the first
    token alone, then that many a chunk, each chunk carrying all its token IDs.

    Attributes:
        tokens_per_chunk: tokens per chunk after the first (1: one per token).
    """

    tokens_per_chunk: int = 1

    def respond(
        self,
        method: str,
        path: str,
        raw: bytes = b"",
        *,
        created: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> SimPlan:
        """See :meth:`SimEngine.respond`; streamed completions come in larger chunks."""
        if self.tokens_per_chunk > 1 and method == "POST" and path in _COMPLETION_PATHS:
            raw = _with_stream_interval(raw, self.tokens_per_chunk)
        return super().respond(method, path, raw, created=created, headers=headers)


def _with_stream_interval(raw: bytes, interval: int) -> bytes:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw  # the engine's own 400
    if not isinstance(body, dict) or not body.get("stream"):
        return raw
    body["stream_interval"] = interval
    return orjson.dumps(body)


class _Body(httpx.AsyncByteStream):
    """The response body as the app sends it; closing it early tells the app the client left."""

    def __init__(self, chunks: trio.MemoryReceiveChannel[bytes]) -> None:
        self._chunks = chunks
        self.on_close: Any = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        if self.on_close is not None:
            await self.on_close()


def _body_messages(body: bytes) -> list[dict[str, Any]]:
    """``body`` as the ASGI ``http.request`` messages an app receives, in pieces."""
    pieces = [body[i : i + _BODY_PIECE] for i in range(0, len(body), _BODY_PIECE)] or [b""]
    last = len(pieces) - 1
    return [
        {"type": "http.request", "body": piece, "more_body": index < last}
        for index, piece in enumerate(pieces)
    ]


class ASGIStreamTransport(httpx.AsyncBaseTransport):
    """An httpx transport serving requests from an ASGI app, streaming, in ``nursery``.

    Each request runs the app in a new task of ``nursery``; the response returns once the app
    sent its headers, and its body yields chunks as the app sends them. Closing the response
    before the end sends the app ``http.disconnect``, as a client that goes away does.
    """

    def __init__(self, app: Any, nursery: trio.Nursery) -> None:
        self.app = app
        self.nursery = nursery

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Serve ``request`` from the app."""
        # Not kept on the request: the client's prompt would count as the router's memory.
        body = await read_once(request)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path,
            "query_string": request.url.query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 80),
            "extensions": {},
        }
        messages = _body_messages(body)
        del body  # the channel holds the messages until the app has read them
        to_app, from_client = trio.open_memory_channel[dict[str, Any]](len(messages))
        chunks_in, chunks_out = trio.open_memory_channel[bytes](64)
        started: dict[str, Any] = {}
        headers_ready = trio.Event()
        done = trio.Event()
        disconnected = trio.Event()
        while messages:
            to_app.send_nowait(messages.pop(0))
        to_app.close()

        async def receive() -> dict[str, Any]:
            try:
                return await from_client.receive()
            except trio.EndOfChannel:
                await disconnected.wait()
                return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
                headers_ready.set()
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    with contextlib.suppress(trio.BrokenResourceError):
                        await chunks_in.send(message["body"])
                if not message.get("more_body", False):
                    await chunks_in.aclose()

        async def run_app() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                done.set()
                headers_ready.set()
                await chunks_in.aclose()

        self.nursery.start_soon(run_app)
        try:
            await headers_ready.wait()
        except BaseException:
            disconnected.set()  # the client gave up before the headers: it went away
            raise
        if not started:
            raise httpx.RemoteProtocolError("the app ended without a response")
        stream = _Body(chunks_out)

        async def close() -> None:
            if not done.is_set():
                disconnected.set()
                with trio.move_on_after(5):
                    await done.wait()
            await chunks_out.aclose()

        stream.on_close = close
        return httpx.Response(
            status_code=started["status"],
            headers=[(bytes(k), bytes(v)) for k, v in started.get("headers", [])],
            stream=stream,
            request=request,
        )


async def run_lifespan(app: Any, *, task_status: trio.TaskStatus[None]) -> None:
    """Run the app's ASGI lifespan: startup, then (even when cancelled) a clean shutdown."""
    to_app, from_runner = trio.open_memory_channel[dict[str, Any]](4)
    to_runner, from_app = trio.open_memory_channel[dict[str, Any]](4)

    async def expect(kind: str) -> None:
        message = await from_app.receive()
        if message["type"] != kind:
            raise RuntimeError(f"lifespan: expected {kind}, got {message}")

    # The app runs shielded from the caller's cancellation, so that a cancelled caller still
    # gets its clean shutdown (the router closes its engine connections); it is cancelled here,
    # after the shutdown or the bounded wait for it.
    app_scope = trio.CancelScope(shield=True)

    async def run_app() -> None:
        with app_scope:
            await app(
                {"type": "lifespan", "asgi": {"version": "3.0"}},
                from_runner.receive,
                to_runner.send,
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_app)
        try:
            await to_app.send({"type": "lifespan.startup"})
            await expect("lifespan.startup.complete")
            task_status.started()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await to_app.send({"type": "lifespan.shutdown"})
                await expect("lifespan.shutdown.complete")
            app_scope.cancel()


@attrs.define(eq=False)
class InProcessFleet:
    """A running router, the client that reaches it, and the simulated engines behind it.

    Attributes:
        router: the router's state (statistics, pool, metrics).
        client: an ``httpx.AsyncClient`` whose requests go to the router's app.
        engines: the simulated engines by name.
        nursery: where request tasks run; cancel its scope to stop everything.
    """

    router: Router
    client: httpx.AsyncClient
    engines: Mapping[str, SimEngine]
    nursery: trio.Nursery


def engine_cap_supported() -> bool:
    """Whether the simulator does vLLM's engine-side admission (``max_num_queued_tokens``)."""
    return "max_num_queued_tokens" in attrs.fields_dict(SimEngine)


def _engine_cap(cap: int | None) -> dict[str, Any]:
    return {} if cap is None else {"max_num_queued_tokens": cap}


@contextlib.asynccontextmanager
async def open_fleet(
    config: Config,
    *,
    profile: str | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    tokens_per_chunk: int = 1,
    wait_ready: bool = True,
    truth: EngineTruth | None = None,
    span_s: float | None = None,
    max_num_queued_tokens: Sequence[int | None] = (),
    workers: int = 1,
) -> AsyncIterator[InProcessFleet]:
    """Start the router of ``config`` in front of one simulated engine per configured engine.

    Each engine runs its engine type (``truth``; default :class:`EngineTruth`: the calibrated
    type of its configured profile's name, or of ``profile`` when given) at ``time_scale`` in
    its configured dialect, seeded with ``seed`` plus its position. With ``span_s``, the truth's
    slowdowns are scheduled at their fraction of ``span_s`` from the moment this yields. With
    ``max_num_queued_tokens``, each engine (by position) does its own admission as vLLM's
    ``--max-num-queued-tokens`` (:attr:`SimEngine.max_num_queued_tokens`; ``None``: none).
    With ``workers`` > 1 the router is an admission controller with that many relay workers
    (:mod:`narwhal.workers`), each reaching it through a memory stream, and the client's
    requests go to the workers in turn; ``router`` is the controller's. Returns once
    ``/ready`` would be 200 (unless ``wait_ready`` is false); on exit every task of
    the fleet is cancelled and the app shut down.

    Raises:
        ValueError: a slowdown names an engine that is not configured, or an engine-side cap
            is asked of a simulator without one.
    """
    truth = EngineTruth() if truth is None else truth
    caps = list(max_num_queued_tokens)
    if any(cap is not None for cap in caps) and not engine_cap_supported():
        raise ValueError("this simulator has no engine-side admission (max_num_queued_tokens)")
    engines = {
        engine.name: CoalescingSimEngine(
            config.serving.model,
            dialect=engine.dialect,
            timing=truth.timing(
                truth.engine_type(profile or engine.profile, index),
                seed=seed + index,
                time_scale=time_scale,
            ),
            seed=seed + index,
            name=engine.name,
            tokens_per_chunk=tokens_per_chunk,
            **_engine_cap(caps[index] if index < len(caps) else None),
        )
        for index, engine in enumerate(config.engines)
    }
    for slowdown in truth.slowdowns:
        if slowdown.engine not in engines:
            known = ", ".join(engines)
            raise ValueError(f"slowdown {slowdown}: no engine {slowdown.engine!r} ({known})")
    transports = {name: SimTransport(engine, record=False) for name, engine in engines.items()}
    app = create_app(config, transports=transports)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_lifespan, app))
        transport: httpx.AsyncBaseTransport = ASGIStreamTransport(app, nursery)
        relays: list[WorkerRouter] = []
        if workers > 1:
            transport, relays = await _start_workers(nursery, config, app, transports, workers)
        client = httpx.AsyncClient(transport=transport, base_url="http://narwhal.bench")
        fleet = InProcessFleet(get_router(app), client, engines, nursery)
        try:
            if wait_ready:
                await fleet.router.wait_ready()
            if span_s is not None:
                now = trio.current_time()
                for slowdown in truth.slowdowns:
                    engine = engines[slowdown.engine]
                    engine.schedule_slowdown(now + slowdown.at * span_s, slowdown.factor)
            yield fleet
        finally:
            for relay in relays:
                relay.begin_drain()  # they stop with their controller
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await client.aclose()


class _InTurn(httpx.AsyncBaseTransport):
    """Each request to the next of ``transports``, in turn."""

    def __init__(self, transports: Sequence[httpx.AsyncBaseTransport]) -> None:
        self._transports = transports
        self._next = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self._transports[self._next]
        self._next = (self._next + 1) % len(self._transports)
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in self._transports:
            await transport.aclose()


async def _start_workers(
    nursery: trio.Nursery,
    config: Config,
    app: Any,
    transports: Mapping[str, httpx.AsyncBaseTransport],
    workers: int,
) -> tuple[httpx.AsyncBaseTransport, list[WorkerRouter]]:
    """``workers`` relay workers under ``app``'s router as their controller, each over a
    memory stream: the transport that sends requests to them in turn, and their routers."""
    from narwhal.workers.controller import Controller

    controller = Controller(get_router(app), app)
    inner = []
    routers = []
    for _ in range(workers):
        ours, theirs = trio.testing.memory_stream_pair()
        nursery.start_soon(controller.serve_worker, theirs)

        async def connect(stream: trio.abc.Stream = ours) -> trio.abc.Stream:
            return stream

        router = WorkerRouter(config, connect, transports=transports)
        worker = create_app(config, router=router)
        await nursery.start(partial(run_lifespan, worker))
        inner.append(ASGIStreamTransport(worker, nursery))
        routers.append(router)
    return _InTurn(inner), routers
