"""Shared fixtures: a router in front of in-process simulated engines, in virtual time."""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from functools import partial
from typing import Any

import attrs
import coverage
import httpx
import pytest
import trio

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import Config, EngineConfig, ServingConfig, UpstreamConfig
from narwhal.router import Router
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.web.app import create_app, get_router
from tests.support import Pluggable

MODEL = "llama-3.1-8b-instruct"

# A shell without job control starts a background command (`./scripts/test &`) with SIGINT
# ignored, and the processes the tests start inherit that: a Ctrl-C the tests send to a
# `narwhal` command before it opens its own signal receiver was then lost, and the command ran
# on (`narwhal top`, which relies on KeyboardInterrupt, never stopped). Ctrl-C reaches the
# foreground process a user types it at: the tests' processes get it as that one would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-cov's own wrapper
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """A test marked ``no_cover`` runs untraced in a pytest-xdist process too.

    pytest-cov pauses its coverage for such a test, but in an xdist process another coverage
    of its own, started earlier and stacked under the first, resumes tracing as the first
    pauses (the soak took 144 s there against 60 s untraced). That one is stopped here for the
    test, and started again after it.
    """
    current = coverage.Coverage.current() if item.get_closest_marker("no_cover") else None
    if current is None or sys.gettrace() is None:
        return (yield)
    current.stop()
    try:
        return (yield)
    finally:
        current.start()


@attrs.define
class Fleet:
    """A running router, its HTTP client and the simulated engines behind it."""

    router: Router
    client: httpx.AsyncClient
    sims: dict[str, SimTransport]
    plugs: dict[str, Pluggable]
    baseline: int = 0

    def completions_received(self) -> int:
        """Completion requests the engines received since the fleet became ready (no probes)."""
        total = sum(sim.statistics().completion_requests for sim in self.sims.values())
        return total - self.baseline

    def set_directives(self, engine: str, directives: dict[str, Any]) -> None:
        """Make one engine misbehave from now on (test directives as engine defaults)."""
        self.sims[engine].engine.set_directives(directives)

    async def chat(self, **body: Any) -> httpx.Response:
        body.setdefault("model", MODEL)
        body.setdefault("messages", [{"role": "user", "content": "Hello there"}])
        return await self.client.post("/v1/chat/completions", json=body)

    async def completion(self, **body: Any) -> httpx.Response:
        body.setdefault("model", MODEL)
        body.setdefault("prompt", "The capital of France is")
        return await self.client.post("/v1/completions", json=body)

    def counters(self) -> dict[str, int]:
        return self.router.statistics().accounting.as_json()

    def assert_quiescent(self) -> None:
        """No request in flight, no slot held, and the books balance."""
        stats = self.router.statistics()
        books = stats.accounting
        assert books.in_flight == 0, books
        assert books.offered == sum(books.terminal.values())
        self.router.accounting.check()
        assert self.router.in_flight() == 0
        assert stats.retention.in_use == 0
        assert stats.queue.depth == 0
        for engine in stats.engines:
            assert (engine.prefill, engine.decode) == (0, 0), engine


StartFleet = Callable[..., Awaitable[Fleet]]


def engine_config(name: str, dialect: str = "vllm", **kwargs: Any) -> EngineConfig:
    return EngineConfig(name=name, url=f"http://{name}.test", dialect=dialect, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
async def start_fleet(nursery: trio.Nursery) -> AsyncIterator[StartFleet]:
    """Start a router with simulated engines; returns once ``/ready`` would be 200.

    Each engine is given as ``(name, dialect)`` or an :class:`EngineConfig`; ``directives``
    maps engine names to simulator directives applied from the start (join probes included);
    ``timing`` gives each engine's timing model by name (default: the router's H100 profile).
    """
    fleets: list[Fleet] = []

    async def start(
        engines: Sequence[tuple[str, str] | EngineConfig] = (("sim-a", "vllm"), ("sim-b", "vllm")),
        *,
        directives: dict[str, dict[str, Any]] | None = None,
        wait_ready: bool = True,
        timing: Callable[[str], Any] | None = None,
        **config: Any,
    ) -> Fleet:
        configs = tuple(
            e if isinstance(e, EngineConfig) else engine_config(e[0], e[1]) for e in engines
        )
        config.setdefault("serving", ServingConfig(model=MODEL))
        config.setdefault("upstream", UpstreamConfig(read_timeout_s=600))
        settings = Config(engines=configs, **config)
        sims = {
            engine.name: SimTransport(
                SimEngine(
                    MODEL,
                    dialect=engine.dialect,
                    timing=(
                        StepTiming(get_profile("h100-llama3-8b"))
                        if timing is None
                        else timing(engine.name)
                    ),
                    seed=index,
                    name=engine.name,
                )
            )
            for index, engine in enumerate(configs)
        }
        for name, values in (directives or {}).items():
            sims[name].engine.set_directives(values)
        plugs = {name: Pluggable(sim) for name, sim in sims.items()}
        app = create_app(settings, transports=plugs)

        await nursery.start(partial(run_lifespan, app))
        client = httpx.AsyncClient(
            transport=ASGIStreamTransport(app, nursery), base_url="http://narwhal.test"
        )
        fleet = Fleet(get_router(app), client, sims, plugs)
        if wait_ready:
            with trio.fail_after(60):
                await fleet.router.wait_ready()
            fleet.baseline = fleet.completions_received()
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        await fleet.client.aclose()
