"""Engine metrics: the Prometheus parser by plain calls, then the polls at exact virtual times."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import httpx
import pytest
import trio

from narwhal.config import EngineConfig, MonitoringConfig
from narwhal.scheduling.engines import Engine, EngineMetrics
from narwhal.sim.engine import SimEngine
from narwhal.upstream.engine_metrics import MetricsUnreadable, parse_engine_metrics
from narwhal.upstream.health import METRICS_LIMIT_BYTES
from tests.conftest import MODEL, StartFleet, engine_config

# An excerpt of a real vLLM 0.32 /metrics (its names, labels and layout).
VLLM_032 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12437.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
"""


# -- the parser ---------------------------------------------------------------------------------


def test_vllm_gauges_are_read_by_name() -> None:
    assert parse_engine_metrics(VLLM_032) == EngineMetrics(3.0, 2.0, 0.25)


def test_data_parallel_engines_add_up_and_the_fullest_cache_counts() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 3\n'
        'vllm:num_requests_running{engine="1"} 4\n'
        'vllm:num_requests_waiting{engine="0"} 1\n'
        'vllm:num_requests_waiting{engine="1"} 0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.75\n'
    )
    assert parse_engine_metrics(text) == EngineMetrics(7.0, 1.0, 0.75)


def test_sglang_names_are_read_too() -> None:
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m"} 5.0\n'
        'sglang:num_queue_reqs{model_name="m"} 1.0\n'
        'sglang:token_usage{model_name="m"} 0.5\n'
    )
    assert parse_engine_metrics(text) == EngineMetrics(5.0, 1.0, 0.5)


def test_missing_gauges_are_none_and_no_gauge_at_all_is_empty() -> None:
    partial = parse_engine_metrics("vllm:num_requests_running 1\n")
    assert partial == EngineMetrics(running=1.0)
    assert not partial.empty
    assert parse_engine_metrics("process_open_fds 12\n").empty
    assert parse_engine_metrics("").empty


def test_the_simulator_serves_what_the_parser_reads() -> None:
    engine = SimEngine(MODEL)
    assert parse_engine_metrics(engine.metrics_text()) == EngineMetrics(0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<html><body>Not here</body></html>", "unreadable Prometheus text"),
        ('vllm:num_requests_running{engine="0} 1\n', "unreadable Prometheus text"),
        ("vllm:num_requests_running one\n", "unreadable Prometheus text"),
        ("vllm:num_requests_running NaN\n", "vllm:num_requests_running has the value nan"),
        ("vllm:num_requests_waiting +Inf\n", "vllm:num_requests_waiting has the value inf"),
        ("vllm:kv_cache_usage_perc -0.5\n", "vllm:kv_cache_usage_perc has the value -0.5"),
        ("\x00\xff\n", "unreadable Prometheus text"),
    ],
)
def test_bad_text_is_unreadable_never_a_crash(text: str, message: str) -> None:
    with pytest.raises(MetricsUnreadable) as caught:
        parse_engine_metrics(text)
    assert str(caught.value) == message


# -- the polls, in virtual time -----------------------------------------------------------------


class MetricsAnswer(httpx.AsyncBaseTransport):
    """Wraps an engine's transport; ``/metrics`` answers what ``answer`` makes of the request."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.answer: Callable[[httpx.Request], httpx.Response] | None = None
        self.stall = False
        self.metrics_polls: list[float] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/metrics":
            return await self.inner.handle_async_request(request)
        self.metrics_polls.append(trio.current_time())
        if self.stall:
            await trio.sleep_forever()
        if self.answer is not None:
            return self.answer(request)
        return await self.inner.handle_async_request(request)


def engine_of(fleet: object, name: str) -> Engine:
    return next(e for e in fleet.router.pool if e.name == name)  # type: ignore[attr-defined]


async def test_each_good_poll_reads_the_metrics_and_records_when(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    sim_a = engine_of(fleet, "sim-a")
    wrapper = MetricsAnswer(fleet.plugs["sim-a"].inner)
    fleet.plugs["sim-a"].inner = wrapper
    await trio.sleep_until(10.5)
    assert wrapper.metrics_polls == [1.0 * n for n in range(1, 11)]
    assert sim_a.metrics == EngineMetrics(0.0, 0.0, 0.0)
    assert sim_a.metrics_at == 10.0
    stats = sim_a.statistics()
    assert stats.metrics_age_s == pytest.approx(0.5)
    assert stats.health_age_s == pytest.approx(0.5)
    assert stats.metrics_expected

    # The simulator's gauges follow its load: a request decoding shows as running.
    async with trio.open_nursery() as nursery:
        sim = {"output_tokens": 400}  # batched by the step loop: some 3 s of decoding
        nursery.start_soon(partial(fleet.chat, narwhal_sim=sim))
        await trio.sleep_until(11.5)
        busy = [e.metrics for e in fleet.router.pool]
        assert sum(m.running for m in busy if m and m.running) == 1.0
    fleet.assert_quiescent()


async def test_a_bad_metrics_body_is_a_failed_poll_that_leaves_health_alone(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    sim_a = engine_of(fleet, "sim-a")
    wrapper = MetricsAnswer(fleet.plugs["sim-a"].inner)
    fleet.plugs["sim-a"].inner = wrapper
    await trio.sleep_until(5.5)
    assert sim_a.metrics_at == 5.0
    bodies = [
        httpx.Response(200, content=b"<html>oops</html>"),
        httpx.Response(200, content=b"vllm:num_requests_running NaN\n"),
        httpx.Response(200, content=b"\xff\xfe not text"),
        httpx.Response(500, content=b"boom"),
        httpx.Response(200, content=b"#" * (METRICS_LIMIT_BYTES + 1)),
    ]
    wrapper.answer = lambda request: bodies.pop(0)
    await trio.sleep_until(10.5)
    assert not bodies
    assert sim_a.metrics_at == 5.0  # the readings age
    assert sim_a.eligible and sim_a.health.statistics(10.5).last_good_poll_at == 10.0
    assert sim_a.metrics_expected
    wrapper.answer = None
    await trio.sleep_until(11.5)
    assert sim_a.metrics_at == 11.0


async def test_a_stalled_metrics_poll_is_cut_at_the_poll_timeout(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(monitoring=MonitoringConfig(poll_interval_s=2.0, poll_timeout_s=0.5))
    sim_a = engine_of(fleet, "sim-a")
    wrapper = MetricsAnswer(fleet.plugs["sim-a"].inner)
    fleet.plugs["sim-a"].inner = wrapper
    first = sim_a.metrics_at  # the first poll's, after its token probe
    assert first is not None and 0.0 < first < 0.1
    wrapper.stall = True
    with trio.fail_after(30):
        await trio.sleep_until(6.9)
    # Polls keep their pace: each metrics poll is cut after 0.5 s, health is untouched.
    assert wrapper.metrics_polls == [2.0, 4.0, 6.0]
    assert sim_a.metrics_at == first
    assert sim_a.health.statistics(6.9).last_good_poll_at == 6.0
    assert sim_a.eligible


async def test_an_engine_without_metrics_is_not_asked_again(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(
        [engine_config("sim-a"), engine_config("sim-b"), engine_config("sim-c", "openai")]
    )
    sim_a, sim_b, sim_c = (engine_of(fleet, name) for name in ("sim-a", "sim-b", "sim-c"))
    wrapper_a = MetricsAnswer(fleet.plugs["sim-a"].inner)
    wrapper_a.answer = lambda request: httpx.Response(404, content=b'{"detail":"Not Found"}')
    fleet.plugs["sim-a"].inner = wrapper_a
    wrapper_b = MetricsAnswer(fleet.plugs["sim-b"].inner)
    wrapper_b.answer = lambda request: httpx.Response(200, content=b"process_open_fds 3\n")
    fleet.plugs["sim-b"].inner = wrapper_b
    wrapper_c = MetricsAnswer(fleet.plugs["sim-c"].inner)
    fleet.plugs["sim-c"].inner = wrapper_c
    start = trio.current_time()
    with trio.fail_after(30):
        await trio.sleep_until(start + 5.0)
    assert len(wrapper_a.metrics_polls) == 1 and len(wrapper_b.metrics_polls) == 1
    assert wrapper_c.metrics_polls == []  # the openai dialect has no such gauges
    assert not sim_a.metrics_expected and not sim_b.metrics_expected
    assert not sim_c.metrics_expected and sim_c.metrics is None
    assert sim_a.eligible and sim_b.eligible and sim_c.eligible


def test_engines_expect_metrics_by_dialect() -> None:
    from narwhal.scheduling.forecast import PrefillForecast
    from narwhal.scheduling.profiles import get_profile

    def engine(dialect: str) -> Engine:
        config = EngineConfig(name="e", url="http://e.test", dialect=dialect)  # type: ignore[arg-type]
        forecast = PrefillForecast(get_profile("h100-llama3-8b"), prefill_limit=4)
        return Engine(config, client=None, prefill_limit=4, decode_limit=8, forecast=forecast)  # type: ignore[arg-type]

    assert engine("vllm").metrics_expected
    assert engine("sglang").metrics_expected
    assert not engine("openai").metrics_expected


async def test_the_joining_poll_reads_the_metrics_before_the_profiling(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    for engine in fleet.router.pool:
        joined_at = engine.health.statistics(0.0).last_good_poll_at
        assert engine.metrics_at is not None and joined_at is not None
        assert 0.0 < engine.metrics_at < joined_at  # after the token probe, before profiling
