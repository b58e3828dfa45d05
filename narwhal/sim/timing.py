"""How long the simulated engine takes (pure, no I/O).

The engine asks a :class:`TimingModel` two questions: how long until the first output token of a
prompt of ``n`` tokens, and how long between output token ``position - 1`` and ``position``. Nothing
else in the simulator knows a constant, so a continuous-batching model can replace
:class:`LinearTiming` without touching the engine's shapes.

Every duration is multiplied by the model's ``time_scale``: 0.1 runs ten times faster, 4 four times
slower. Request-level overrides (the ``ttft_s`` / ``itl_s`` directives) are scaled the same way,
which is why the scale is part of the protocol.

The named :data:`PROFILES` are priors for Llama-3-8B (``reference/slo-and-engine-models.md``):

==================  ===================  ======================  ==============
profile             prefill base ``a``   prefill per token ``b``  decode step
==================  ===================  ======================  ==============
``h100-llama3-8b``  3.5 ms               0.022 ms                7 ms
``a100-llama3-8b``  5.7 ms               0.069 ms                12 ms
``zero``            0                    0                       0
==================  ===================  ======================  ==============
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import attrs

__all__ = ["PROFILES", "LinearTiming", "TimingModel", "profile"]

_MASK64 = (1 << 64) - 1


@runtime_checkable
class TimingModel(Protocol):
    """What the engine asks about time. Every answer is in seconds, already scaled."""

    @property
    def time_scale(self) -> float:
        """The factor applied to every simulated duration (also to per-request overrides)."""
        ...

    def first_token_delay_s(self, prompt_tokens: int) -> float:
        """Time from the request's arrival to its first output token (prefill)."""
        ...

    def inter_token_delay_s(self, position: int) -> float:
        """Time between output token ``position - 1`` and output token ``position`` (>= 1)."""
        ...


def _unit_noise(seed: int, key: int) -> float:
    """A deterministic value in [-1, 1) from ``(seed, key)`` (splitmix64; no global state)."""
    z = (seed * 0x9E3779B97F4A7C15 + key + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 52) - 1.0


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class LinearTiming:
    """Prefill linear in the prompt length, a constant decode step.

    ``first_token_delay_s(n) = (prefill_base_s + prefill_per_token_s * n) * time_scale`` and
    ``inter_token_delay_s(_) = decode_step_s * time_scale``, each times ``1 + jitter * u`` where
    ``u`` in [-1, 1) is derived from ``seed`` and the argument, so equal questions get equal
    answers.

    Attributes:
        prefill_base_s: fixed prefill cost ``a``.
        prefill_per_token_s: prefill cost per prompt token ``b``.
        decode_step_s: time per output token after the first.
        time_scale: multiplies every duration.
        jitter: relative amplitude of the seeded noise (0 disables it; at most 1).
        seed: seeds the noise.
    """

    prefill_base_s: float = attrs.field(validator=_non_negative)
    prefill_per_token_s: float = attrs.field(validator=_non_negative)
    decode_step_s: float = attrs.field(validator=_non_negative)
    time_scale: float = attrs.field(default=1.0, validator=_non_negative)
    jitter: float = attrs.field(default=0.0, validator=[_non_negative, attrs.validators.le(1.0)])
    seed: int = 0

    def first_token_delay_s(self, prompt_tokens: int) -> float:
        """See :meth:`TimingModel.first_token_delay_s`."""
        delay = (self.prefill_base_s + self.prefill_per_token_s * prompt_tokens) * self.time_scale
        return self._jittered(delay, -1 - prompt_tokens)

    def inter_token_delay_s(self, position: int) -> float:
        """See :meth:`TimingModel.inter_token_delay_s`."""
        return self._jittered(self.decode_step_s * self.time_scale, position)

    def _jittered(self, delay: float, key: int) -> float:
        if self.jitter == 0.0 or delay == 0.0:
            return delay
        return delay * (1.0 + self.jitter * _unit_noise(self.seed, key))


PROFILES: Mapping[str, LinearTiming] = MappingProxyType(
    {
        "h100-llama3-8b": LinearTiming(
            prefill_base_s=0.0035, prefill_per_token_s=0.000022, decode_step_s=0.007
        ),
        "a100-llama3-8b": LinearTiming(
            prefill_base_s=0.0057, prefill_per_token_s=0.000069, decode_step_s=0.012
        ),
        "zero": LinearTiming(prefill_base_s=0.0, prefill_per_token_s=0.0, decode_step_s=0.0),
    }
)
"""The named timing profiles, unscaled (``time_scale`` 1, no jitter)."""


def profile(
    name: str, *, time_scale: float = 1.0, jitter: float = 0.0, seed: int = 0
) -> LinearTiming:
    """The named profile with a time scale, and optionally seeded jitter.

    Raises:
        ValueError: ``name`` is not in :data:`PROFILES`.
    """
    try:
        base = PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown timing profile {name!r} (known: {known})") from None
    return attrs.evolve(base, time_scale=time_scale, jitter=jitter, seed=seed)
