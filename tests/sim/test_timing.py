"""The timing model: linear prefill, constant decode, scale and seeded jitter (pure)."""

from __future__ import annotations

import math

import pytest

from narwhal.sim import PROFILES, LinearTiming, TimingModel, profile


def test_linear_prefill_and_constant_decode() -> None:
    timing = LinearTiming(prefill_base_s=0.5, prefill_per_token_s=0.25, decode_step_s=0.125)
    assert timing.first_token_delay_s(0) == 0.5
    assert timing.first_token_delay_s(4) == 1.5
    assert [timing.inter_token_delay_s(p) for p in (1, 2, 100)] == [0.125] * 3


def test_time_scale_multiplies_every_duration() -> None:
    timing = LinearTiming(0.5, 0.25, 0.125, time_scale=4.0)
    assert timing.first_token_delay_s(4) == 6.0
    assert timing.inter_token_delay_s(1) == 0.5


@pytest.mark.parametrize(
    ("name", "base", "per_token", "step"),
    [
        ("h100-llama3-8b", 0.0035, 0.000022, 0.007),
        ("a100-llama3-8b", 0.0057, 0.000069, 0.012),
        ("zero", 0.0, 0.0, 0.0),
    ],
)
def test_named_profiles(name: str, base: float, per_token: float, step: float) -> None:
    timing = PROFILES[name]
    assert (timing.prefill_base_s, timing.prefill_per_token_s, timing.decode_step_s) == (
        base,
        per_token,
        step,
    )
    assert timing.first_token_delay_s(1000) == pytest.approx(base + per_token * 1000)
    assert isinstance(timing, TimingModel)


def test_zero_profile_never_delays() -> None:
    timing = profile("zero", time_scale=10.0, jitter=0.5)
    assert timing.first_token_delay_s(100_000) == 0.0
    assert timing.inter_token_delay_s(7) == 0.0


def test_profile_applies_scale_and_rejects_unknown_names() -> None:
    assert profile("a100-llama3-8b", time_scale=0.1).time_scale == 0.1
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
