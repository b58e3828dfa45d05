"""The timing models: step costs from the profiles, linear per-request timing, scale, jitter."""

from __future__ import annotations

import math

import pytest

from narwhal.scheduling.profiles import get_profile
from narwhal.sim import PROFILES, LinearTiming, StepTiming, TimingModel, profile
from narwhal.sim.calibration import ENGINE_TYPES


def test_linear_prefill_and_constant_decode() -> None:
    timing = LinearTiming(prefill_base_s=0.5, prefill_per_token_s=0.25, decode_step_s=0.125)
    assert timing.first_token_delay_s(0) == 0.5
    assert timing.first_token_delay_s(4) == 1.5
    assert [timing.inter_token_delay_s(p) for p in (1, 2, 100)] == [0.125] * 3


def test_time_scale_multiplies_every_duration() -> None:
    timing = LinearTiming(0.5, 0.25, 0.125, time_scale=4.0)
    assert timing.first_token_delay_s(4) == 6.0
    assert timing.inter_token_delay_s(1) == 0.5


def test_named_gpu_profiles_are_step_models_over_the_calibrated_types() -> None:
    for name in ("h100-llama3-8b", "a100-llama3-8b"):
        timing = PROFILES[name]
        assert isinstance(timing, StepTiming) and isinstance(timing, TimingModel)
        assert timing.profile is ENGINE_TYPES[name]  # the simulator's own, not the router's
        assert timing.profile != get_profile(name)
    zero = PROFILES["zero"]
    assert isinstance(zero, LinearTiming)
    assert (zero.prefill_base_s, zero.prefill_per_token_s, zero.decode_step_s) == (0, 0, 0)


def test_step_timing_answers_for_a_lone_request() -> None:
    h100 = get_profile("h100-llama3-8b")
    timing = StepTiming(h100)
    assert timing.first_token_delay_s(1024) == pytest.approx(h100.prefill_ms(1024) / 1000)
    assert timing.first_token_delay_s(1024) == pytest.approx(0.0279, rel=0.01)
    assert timing.first_token_delay_s(8192) == pytest.approx(0.3045, rel=0.01)
    # Past max_num_batched_tokens the prompt is prefilled in chunks, each a prefill step.
    chunked = h100.prefill_ms(8192) + h100.prefill_base_ms + h100.prefill_chunk_ms(8192, 10000)
    assert timing.first_token_delay_s(10000) == pytest.approx(chunked / 1000)
    assert timing.inter_token_delay_s(5, prompt_tokens=100) == pytest.approx(
        h100.decode_step_ms(1, 105) / 1000
    )


def test_step_timing_scales_and_jitters_steps() -> None:
    h100 = get_profile("h100-llama3-8b")
    assert StepTiming(h100, time_scale=4.0).step_s(10.0, 3) == 0.04
    assert StepTiming(h100, time_scale=0.0).step_s(10.0, 3) == 0.0
    jittery = StepTiming(h100, jitter=0.2, seed=5)
    steps = [jittery.step_s(10.0, index) for index in range(200)]
    assert steps == [jittery.step_s(10.0, index) for index in range(200)]
    assert all(0.008 <= step <= 0.012 for step in steps) and len(set(steps)) > 100
    other = StepTiming(h100, jitter=0.2, seed=6)
    assert steps != [other.step_s(10.0, index) for index in range(200)]
    with pytest.raises(ValueError):
        StepTiming(h100, jitter=2.0)


def test_zero_profile_never_delays() -> None:
    timing = profile("zero", time_scale=10.0, jitter=0.5)
    assert timing.first_token_delay_s(100_000) == 0.0
    assert timing.inter_token_delay_s(7) == 0.0


def test_profile_applies_scale_and_rejects_unknown_names() -> None:
    a100 = profile("a100-llama3-8b", time_scale=0.1, jitter=0.1, seed=3)
    assert (a100.time_scale, a100.jitter, a100.seed) == (0.1, 0.1, 3)
    with pytest.raises(ValueError, match="h100-llama3-8b"):
        profile("tpu-v9")


def test_jitter_is_seeded_bounded_and_repeatable() -> None:
    base = LinearTiming(0.5, 0.0, 0.25)
    jittery = LinearTiming(0.5, 0.0, 0.25, jitter=0.2, seed=7)
    gaps = [jittery.inter_token_delay_s(p) for p in range(1, 200)]
    assert gaps == [jittery.inter_token_delay_s(p) for p in range(1, 200)]
    assert all(0.2 <= gap <= 0.3 for gap in gaps)
    assert len(set(gaps)) > 100
    other = LinearTiming(0.5, 0.0, 0.25, jitter=0.2, seed=8)
    assert gaps != [other.inter_token_delay_s(p) for p in range(1, 200)]
    assert base.inter_token_delay_s(3) == 0.25


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decode_step_s": -1.0},
        {"decode_step_s": math.nan},
        {"time_scale": -0.5},
        {"jitter": 1.5},
    ],
)
def test_invalid_parameters_are_refused(kwargs: dict[str, float]) -> None:
    values = {"prefill_base_s": 0.0, "prefill_per_token_s": 0.0, "decode_step_s": 0.0, **kwargs}
    with pytest.raises(ValueError):
        LinearTiming(**values)  # type: ignore[arg-type]
