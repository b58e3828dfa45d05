"""Profiling: the fit (pure), then engines measured on join at exact virtual times."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio

from narwhal.bench.inprocess import CoalescingSimEngine
from narwhal.config import Config, EngineConfig, MonitoringConfig, ServingConfig
from narwhal.router import Router
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.profiles import EngineProfile, get_profile
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.upstream.profiling import (
    coalesced_tokens,
    compute_s,
    decode_batches,
    fit_decode,
    fit_prefill,
    probe_sizes,
)
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


def test_one_batch_size_fits_the_median_gap_over_the_profile_step() -> None:
    steps = [H100.decode_step_ms(1, 65 + k) / 1000 for k in range(7)]
    gaps = [(3.0 * step, 1) for step in steps]
    gaps[2] = (50 * steps[2], 1)  # one stall does not move the median
    assert fit_decode(H100, 64, {1: [gaps]}) == pytest.approx((3.0, 1.0))


def steep(slope: float, scale: float = 1.0) -> EngineProfile:
    """The H100 profile with its decode batch terms ``slope`` times steeper, ``scale`` slower."""
    return attrs.evolve(
        H100,
        decode_base_ms=H100.decode_base_ms * scale,
        decode_per_seq_ms=H100.decode_per_seq_ms * slope * scale,
        decode_per_kv_token_ms=H100.decode_per_kv_token_ms * slope * scale,
    )


def batch_gaps(truth: EngineProfile, batch: int) -> list[list[tuple[float, int]]]:
    """Seven gaps of each of ``batch`` sequences of 64-token prompts decoding together."""
    steps = [truth.decode_step_ms(batch, batch * (65 + k)) / 1000 for k in range(7)]
    return [[(step, 1) for step in steps]] * batch


@pytest.mark.parametrize(("slope", "scale"), [(1.0, 1.0), (20.0, 1.0), (8.0, 2.0), (0.5, 0.5)])
def test_batch_sizes_fit_the_decode_scale_and_its_slope(slope: float, scale: float) -> None:
    truth = steep(slope, scale)
    batches = {b: batch_gaps(truth, b) for b in (1, 8, 32)}
    fitted_scale, fitted_slope = fit_decode(H100, 64, batches)
    assert fitted_scale == pytest.approx(scale, rel=0.01)
    assert fitted_slope == pytest.approx(slope, rel=0.02, abs=0.05)
    # The forecast so calibrated predicts the truth's step at a full batch too.
    forecast = PrefillForecast(H100)
    forecast.calibrate(
        scale=1.0, latency_s=0.0, decode_scale=fitted_scale, decode_slope=fitted_slope
    )
    full = truth.decode_step_ms(256, 256 * 1500) / 1000
    assert forecast.decode_step_s(256, 256 * 1500) == pytest.approx(full, rel=0.02)


def test_a_decode_fit_with_a_falling_step_keeps_the_profile_slope() -> None:
    batches = {1: batch_gaps(H100, 1), 8: batch_gaps(steep(1.0, 0.5), 8)}  # noise: faster at 8
    scale, slope = fit_decode(H100, 64, batches)
    assert slope == 1.0
    assert scale == pytest.approx(0.5, rel=0.01)  # the median over every counted gap


def test_a_noisy_flat_decode_step_keeps_the_profile_slope() -> None:
    # A loaded host: the step hardly grows with the batch, the gaps scatter by 10 %.
    def noisy(batch: int) -> list[list[tuple[float, int]]]:
        steps = [0.0124, 0.0112, 0.0126, 0.0113, 0.0125, 0.0111, 0.0119]
        return [[(step * (1.01 if batch == 32 else 1.0), 1) for step in steps]] * batch

    scale, slope = fit_decode(H100, 64, {b: noisy(b) for b in (1, 8, 32)})
    assert slope == 1.0
    assert 1.7 < scale < 1.95  # about 12 ms against the profile's 6.2 to 6.7 ms


def test_decode_batches_fit_the_batch() -> None:
    assert decode_batches(H100) == (1, 8, 32)
    assert decode_batches(attrs.evolve(H100, max_num_seqs=16)) == (1, 8, 16)
    assert decode_batches(attrs.evolve(H100, max_num_seqs=1)) == (1,)


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


def test_a_coalescing_engine_is_asked_for_enough_tokens_to_time_its_steps() -> None:
    # First token alone, then 7 in one chunk: one gap, too few; 16 a chunk needs 65 tokens.
    assert coalesced_tokens([[(0.1, 7)]], 8) == 1 + 7 * 4
    assert coalesced_tokens([[(0.1, 16), (0.1, 12)]], 29) == 1 + 16 * 4
    # Enough gaps already; one token a gap (the answer ended early: more will not help); a cap.
    assert coalesced_tokens([[(0.1, 2)] * 3], 8) is None
    assert coalesced_tokens([[(0.1, 1), (0.1, 1)]], 8) is None
    assert coalesced_tokens([[(0.1, 200)]], 8) == 256
    assert coalesced_tokens([[(0.1, 200)]], 256) is None


async def test_an_engine_streaming_16_tokens_a_chunk_still_has_its_decode_fitted(
    router_with: Any, autojump_clock: trio.testing.MockClock
) -> None:
    # A vLLM started with --stream-interval 16 ignores the probes' stream_interval: 1. Their
    # eight tokens came in two chunks, and the decode fit was silently skipped (the decode
    # model stayed the prior's: half the speed of an engine twice as slow was never seen).
    engine = CoalescingSimEngine(MODEL, timing=StepTiming(H100), tokens_per_chunk=16)
    engine.set_slowdown(2.0)
    router = await router_with({"a": SimTransport(engine)})
    await joined_at(router, "a")
    a = router.pool.engines[0]
    assert a.forecast.scale == pytest.approx(2.0, rel=0.02)
    assert a.forecast.decode_scale == pytest.approx(2.0, rel=0.05)
    assert a.profiled_decode_scale == a.forecast.decode_scale


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
    # On the profile: two probes of each prompt size, alone, then 1, 8 and 32 probes at once
    # of eight tokens each: the batch's 64-token prompts prefill in one step, then its seven
    # decode steps.
    prefill = sum(2 * H100.prefill_ms(n) for n in (64, 512, 2048)) / 1000
    decode = (
        sum(
            H100.prefill_base_ms
            + batch * H100.prefill_chunk_ms(0, 64)
            + sum(H100.decode_step_ms(batch, batch * (65 + k)) for k in range(7))
            for batch in (1, 8, 32)
        )
        / 1000
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
