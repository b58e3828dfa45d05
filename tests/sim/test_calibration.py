"""The simulator's own physics: calibrated types, per-engine variation, truth scale, slowdowns."""

from __future__ import annotations

import attrs
import httpx
import orjson
import pytest
import trio
import trio.testing

from narwhal.scheduling.profiles import get_profile
from narwhal.sim import SimEngine, SimTransport, StepTiming, profile
from narwhal.sim.calibration import (
    ENGINE_TYPES,
    STEP_OVERHEAD_MS,
    VARIATION,
    EngineType,
    engine_type,
)
from tests.sim.helpers import CHAT, MESSAGES, MODEL

H100 = engine_type("h100-llama3-8b")
A100 = engine_type("a100-llama3-8b")
_TIMES = (
    "prefill_base_ms",
    "prefill_per_token_ms",
    "prefill_quadratic_ms",
    "decode_base_ms",
    "decode_per_seq_ms",
    "decode_per_kv_token_ms",
)


def test_the_calibrated_types_are_the_reference_constants_plus_the_step_overhead() -> None:
    assert STEP_OVERHEAD_MS == pytest.approx(1.1532)
    assert H100.prefill_base_ms == pytest.approx(3.5 + 1.1532)
    assert H100.decode_base_ms == pytest.approx(6.2 + 1.1532)
    assert H100.prefill_per_token_ms == 0.0198  # BLIS's measured H100 slope
    assert A100.prefill_per_token_ms == 0.069
    assert H100.kv_capacity_tokens == A100.kv_capacity_tokens == 467_000
    # Not the router's prior: the H100 prefills a little faster, every engine decodes slower.
    prior = get_profile("h100-llama3-8b")
    assert H100.prefill_ms(1024) == pytest.approx(26.82, abs=0.01)
    assert prior.prefill_ms(1024) == pytest.approx(27.92, abs=0.01)
    for batch, context in ((1, 1000), (32, 48_000), (128, 128_000)):
        ratio = H100.decode_step_ms(batch, context) / prior.decode_step_ms(batch, context)
        assert 1.08 <= ratio <= 1.19
    # The A100 is the slower engine on every kind of step.
    assert A100.prefill_ms(2048) > 2 * H100.prefill_ms(2048)
    assert A100.decode_step_ms(32, 48_000) > 1.5 * H100.decode_step_ms(32, 48_000)


def test_names_and_aliases() -> None:
    assert engine_type("h100") is ENGINE_TYPES["h100-llama3-8b"]
    assert engine_type("a100") is ENGINE_TYPES["a100-llama3-8b"]
    with pytest.raises(ValueError, match=r"unknown engine type 'tpu'.*a100"):
        engine_type("tpu")
    assert profile("a100").profile is A100
    with pytest.raises(ValueError):
        EngineType("bad", 0.0, 1, 1, 1, 1, 1)


def test_an_engine_varies_by_its_seed_deterministically_by_a_few_percent() -> None:
    engines = [H100.varied(seed) for seed in range(50)]
    assert engines == [H100.varied(seed) for seed in range(50)]
    assert len(set(engines)) == 50
    for engine in engines:
        for name in _TIMES:
            ratio = getattr(engine, name) / getattr(H100, name)
            assert 1 - VARIATION <= ratio < 1 + VARIATION
        assert attrs.evolve(engine, **{n: getattr(H100, n) for n in _TIMES}) == H100
    spread = [engine.prefill_per_token_ms / H100.prefill_per_token_ms for engine in engines]
    assert min(spread) < 0.98 and max(spread) > 1.02  # the variation is used
    assert H100.varied(3, 0.0) is H100
    with pytest.raises(ValueError):
        H100.varied(3, 1.0)


def test_truth_scale_and_variation_through_profile() -> None:
    nominal = profile("h100-llama3-8b")
    assert nominal.profile is H100
    varied = profile("h100-llama3-8b", seed=7, variation=0.05)
    assert isinstance(varied, StepTiming) and varied.profile == H100.varied(7, 0.05)
    slow = profile("h100-llama3-8b", truth_scale=2.0)
    assert isinstance(slow, StepTiming)
    assert slow.first_token_delay_s(1024) == pytest.approx(2 * nominal.first_token_delay_s(1024))
    assert slow.time_scale == 1.0  # the per-request overrides stay as they are
    assert H100.scaled(2.0).decode_step_ms(4, 400) == pytest.approx(2 * H100.decode_step_ms(4, 400))
    with pytest.raises(ValueError):
        H100.scaled(0.0)
    # The zero profile has no engine type to vary or scale.
    assert profile("zero", seed=3, variation=0.05, truth_scale=2.0).first_token_delay_s(99) == 0


def test_the_router_prior_stays_available_as_the_engines_truth() -> None:
    prior = get_profile("h100-llama3-8b")
    timing = StepTiming(prior)
    assert timing.first_token_delay_s(1024) == pytest.approx(prior.prefill_ms(1024) / 1000)
    assert SimEngine(MODEL, timing=timing).statistics().kv_capacity_tokens == 467_000


def _body(**directives: int) -> dict[str, object]:
    return {"model": MODEL, "messages": MESSAGES, "stream": True, "narwhal_sim": directives}


async def _token_times(client: httpx.AsyncClient, **directives: int) -> list[float]:
    times = []
    async with client.stream("POST", CHAT, json=_body(**directives)) as response:
        async for _ in response.aiter_raw():
            times.append(trio.current_time())
    return times


async def test_a_scheduled_slowdown_takes_effect_at_its_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimEngine(MODEL, timing=profile("h100-llama3-8b"))
    step_s = H100.decode_step_ms(1, 101) / 1000
    async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://sim") as client:
        with trio.fail_after(60):
            start = trio.current_time()
            engine.schedule_slowdown(start + 10.0, 2.0)
            assert engine.slowdown == 1.0
            before = await _token_times(client, prompt_tokens=100, output_tokens=3)
            assert before[2] - before[1] == pytest.approx(step_s, rel=1e-9)
            await trio.sleep_until(start + 10.0)
            assert engine.slowdown == 2.0 and engine.statistics().slowdown == 2.0
            after = await _token_times(client, prompt_tokens=100, output_tokens=3)
            assert after[2] - after[1] == pytest.approx(2 * step_s, rel=1e-9)
            # set_slowdown wins over the changes still to come.
            engine.schedule_slowdown(trio.current_time() + 5.0, 4.0)
            engine.set_slowdown(1.0)
            await trio.sleep(6.0)
            assert engine.slowdown == 1.0
    with pytest.raises(ValueError):
        engine.schedule_slowdown(float("nan"), 2.0)
    with pytest.raises(ValueError):
        engine.schedule_slowdown(1.0, 0.0)


async def test_the_admin_route_schedules_a_slowdown_after_some_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimEngine(MODEL, timing=profile("zero"))
    with trio.fail_after(60):
        plan = engine.respond("POST", "/sim/slowdown", orjson.dumps({"factor": 3, "after_s": 5}))
        assert plan.status == 200 and orjson.loads(plan.body)["slowdown"] == 1.0
        await trio.sleep(5.0)
        assert engine.slowdown == 3.0
        bad = engine.respond("POST", "/sim/slowdown", orjson.dumps({"factor": 3, "after_s": -1}))
        assert bad.status == 400
        assert orjson.loads(bad.body)["error"]["param"] == "after_s"
