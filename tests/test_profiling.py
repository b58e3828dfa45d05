"""Profiling: the fit (pure), then engines measured on join at exact virtual times."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest
import trio

from narwhal.config import Config, EngineConfig, MonitoringConfig, ServingConfig
from narwhal.router import Router
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.upstream.profiling import compute_s, fit_decode, fit_prefill, probe_sizes
from tests.conftest import MODEL
from tests.support import until

H100 = get_profile("h100-llama3-8b")

# -- the fit ------------------------------------------------------------------------------------


def test_the_prefill_fit_recovers_scale_and_latency() -> None:
    samples = [(n, 0.012 + 2.0 * compute_s(H100, n)) for n in (64, 512, 2048)]
    scale, latency = fit_prefill(H100, samples)
    assert scale == pytest.approx(2.0)
    assert latency == pytest.approx(0.012)


def test_a_negative_intercept_is_all_compute() -> None:
    samples = [(n, 1.5 * compute_s(H100, n) - 0.002) for n in (64, 512, 2048)]
    scale, latency = fit_prefill(H100, samples)
    assert latency == 0.0
    assert scale == pytest.approx(1.5, rel=0.05)


def test_the_decode_fit_is_the_median_gap_over_the_profile_step() -> None:
    steps = [H100.decode_step_ms(1, 65 + k) / 1000 for k in range(7)]
    gaps = [(3.0 * step, 1) for step in steps]
    gaps[2] = (50 * steps[2], 1)  # one stall does not move the median
    assert fit_decode(H100, 64, gaps) == pytest.approx(3.0)


def test_probe_sizes_fit_the_context_and_one_step() -> None:
    assert probe_sizes(H100, None) == (64, 512, 2048)
    assert probe_sizes(H100, 1024) == (64, 512, 1024 - 8 - 1)
    assert probe_sizes(H100, 300) == (64, 291)


# -- on join ------------------------------------------------------------------------------------


class Tampering(httpx.AsyncBaseTransport):
    """Adds simulator directives to the profiling probes (token-ID prompts) while ``fault``."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.fault: dict[str, Any] | None = None
        self.probes = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            body = orjson.loads(await request.aread())
            if isinstance(body.get("prompt"), list):
                self.probes += 1
                if self.fault is not None:
                    body["narwhal_sim"] = self.fault
                    request = httpx.Request(
                        request.method,
                        request.url,
                        headers={k: v for k, v in request.headers.items() if k != "content-length"},
                        content=orjson.dumps(body),
                    )
        return await self.inner.handle_async_request(request)


def sim(seed: int = 0) -> SimEngine:
    return SimEngine(MODEL, timing=StepTiming(H100), seed=seed)


@pytest.fixture
async def router_with(
    nursery: trio.Nursery,
) -> AsyncIterator[Callable[..., Any]]:
    routers: list[Router] = []

    async def start(transports: dict[str, httpx.AsyncBaseTransport], **config: Any) -> Router:
        engines = tuple(EngineConfig(name=name, url=f"http://{name}.test") for name in transports)
        router = Router(
            Config(serving=ServingConfig(model=MODEL), engines=engines, **config),
            transports=transports,
        )
        await router.start(nursery)
        routers.append(router)
        return router

    yield start
    for router in routers:
        await router.aclose()


async def joined_at(router: Router, name: str) -> float:
    engine = next(e for e in router.pool if e.name == name)
    with trio.fail_after(30):
        await until(lambda: engine.eligible)
    return trio.current_time()


async def test_engines_are_profiled_before_they_join_and_the_books_never_see_it(
    router_with: Any, autojump_clock: trio.testing.MockClock
) -> None:
    slow = sim(1)
    slow.set_slowdown(2.0)
    router = await router_with({"fast": SimTransport(sim(0)), "slow": SimTransport(slow)})
    fast, slower = router.pool.engines
    with trio.fail_after(1):
        await until(lambda: [e.reason for e in router.statistics().engines] == ["profiling"] * 2)
    fast_at = await joined_at(router, "fast")
    assert await joined_at(router, "slow") > fast_at
    assert fast.profiled and slower.profiled
    # The simulator runs on the profile: its fit is the profile, the slowed one twice it.
    assert fast.forecast.scale == pytest.approx(1.0, rel=0.02)
    assert fast.forecast.latency_s == pytest.approx(0.0, abs=0.001)
    assert fast.forecast.decode_scale == pytest.approx(1.0, rel=0.02)
    assert slower.forecast.scale == pytest.approx(2.0, rel=0.02)
    assert slower.forecast.decode_scale == pytest.approx(2.0, rel=0.02)
    stats = router.statistics()
    assert stats.accounting.offered == 0  # probes are not offered requests
    ready = stats.as_json()["engines"]
    assert [(e["profiled"], e["reason"]) for e in ready] == [(True, None), (True, None)]


async def test_an_engine_joins_once_its_profiling_is_done_at_an_exact_time(
    router_with: Any, autojump_clock: trio.testing.MockClock
) -> None:
    router = await router_with({"a": SimTransport(sim(0)), "b": SimTransport(sim(0))})
    a = router.pool.engines[0]
    with trio.fail_after(1):
        await until(lambda: a.health.held == "profiling")
    started = trio.current_time()  # after /health, /v1/models and the token probe
    a_at = await joined_at(router, "a")
    assert await joined_at(router, "b") == a_at  # the same probes on the same engine
    # Seven probes on the profile: two of each prompt size, alone, then eight tokens of decode.
    prefill = sum(2 * H100.prefill_ms(n) for n in (64, 512, 2048)) / 1000
    decode = (
        H100.prefill_ms(64) / 1000 + sum(H100.decode_step_ms(1, 65 + k) for k in range(7)) / 1000
    )
    assert a_at - started == pytest.approx(prefill + decode, abs=0.002)  # seen by 1 ms polls


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (
            {"fault": "malformed_token_ids"},
            "profiling_failed: the 64-token probe: invalid token IDs",
        ),
        ({"fault": "http_500"}, "profiling_failed: the 64-token probe: failed"),
        ({"fault": "error_frame"}, "profiling_failed: the 64-token probe got an error"),
        (
            {"fault": "stall", "stall_s": 1000},
            "profiling_failed: no answer to a 64-token probe within 120 s",
        ),
    ],
)
async def test_a_failed_profiling_keeps_the_engine_out_visibly_and_is_retried(
    router_with: Any, autojump_clock: trio.testing.MockClock, fault: dict[str, Any], reason: str
) -> None:
    tampering = Tampering(SimTransport(sim(0)))
    tampering.fault = fault
    router = await router_with({"a": tampering, "b": SimTransport(sim(0))})
    b_at = await joined_at(router, "b")
    a = router.pool.engines[0]
    with trio.fail_after(700):
        await until(lambda: a.health.reason(trio.current_time()) == reason)
    failed_at = trio.current_time()
    assert not a.eligible and not a.profiled
    assert router.statistics().as_json()["engines"][0]["reason"] == reason
    tampering.fault = None
    # The next poll (one a second from the first, at 0; at once after a poll that took longer)
    # profiles it again from its start, as b was at 0.
    retry_at = max(1.0, failed_at)
    assert await joined_at(router, "a") == pytest.approx(retry_at + b_at, abs=0.002)
    assert a.profiled and a.forecast.scale == pytest.approx(1.0, rel=0.02)
    assert router.statistics().accounting.offered == 0


async def test_profiling_can_be_turned_off(
    router_with: Any, autojump_clock: trio.testing.MockClock
) -> None:
    tampering = Tampering(SimTransport(sim(0)))
    router = await router_with({"a": tampering}, monitoring=MonitoringConfig(profiling=False))
    await joined_at(router, "a")
    a = router.pool.engines[0]
    assert tampering.probes == 0 and not a.profiled
    assert router.statistics().as_json()["engines"][0]["profiled"] is False


async def test_metrics_show_which_engines_are_profiled(
    router_with: Any, autojump_clock: trio.testing.MockClock
) -> None:
    router = await router_with({"a": SimTransport(sim(0))})
    text = router.metrics.render().decode()
    assert 'narwhal_engine_profiled{engine="a"} 0.0' in text
    await joined_at(router, "a")
    text = router.metrics.render().decode()
    assert 'narwhal_engine_profiled{engine="a"} 1.0' in text
    assert 'narwhal_engine_drift_ratio{engine="a",phase="ttft"} 1.0' in text
    assert 'narwhal_engine_drift_ratio{engine="a",phase="tpot"} 1.0' in text
