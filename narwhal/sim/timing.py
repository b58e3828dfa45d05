"""How long the simulated engine takes (pure, no I/O).

Two kinds of timing model:

* :class:`StepTiming`, the continuous-batching model of the named GPU profiles: the engine runs
  a step loop (:mod:`narwhal.sim.batching`) whose step costs come from one
  :class:`~narwhal.scheduling.profiles.EngineProfile`, the same table the router's predictor
  starts from. A request's tokens come out when the steps that make them end, so its timing
  depends on everything else the engine is doing: queued prefills delay its first token, a big
  batch slows its decode, a full KV cache makes it wait.
* :class:`LinearTiming`, a per-request model: each request's timing is fixed when it is planned
  (prefill linear in the prompt, a constant decode step), whatever else runs. The ``zero``
  profile is one (the router-overhead benchmark's engine: no delay, no step loop).

Both answer the :class:`TimingModel` questions for a request alone on the engine (a step model
answers for an otherwise idle engine); the engine uses these answers for requests that carry the
``ttft_s`` / ``itl_s`` overrides, which bypass the step loop.

Every duration is multiplied by the model's ``time_scale``: 0.1 runs ten times faster, 4 four times
slower. Request-level overrides (the ``ttft_s`` / ``itl_s`` directives) are scaled the same way,
which is why the scale is part of the protocol. Seeded ``jitter`` (default 0) multiplies each
duration by ``1 + jitter * u``, ``u`` in [-1, 1) drawn from the seed and the step (or token).

The named :data:`PROFILES` (``reference/slo-and-engine-models.md``, section 2):

==================  ===============================================================
profile             model
==================  ===============================================================
``h100-llama3-8b``  :class:`StepTiming` over ``scheduling.profiles`` ``h100-llama3-8b``
``a100-llama3-8b``  :class:`StepTiming` over ``scheduling.profiles`` ``a100-llama3-8b``
``zero``            :class:`LinearTiming` with every constant 0
==================  ===============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import attrs

from narwhal.scheduling import profiles
from narwhal.scheduling.profiles import EngineProfile

__all__ = ["PROFILES", "LinearTiming", "StepTiming", "TimingModel", "profile"]

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

    def inter_token_delay_s(self, position: int, *, prompt_tokens: int = 0) -> float:
        """Time between output token ``position - 1`` and output token ``position`` (>= 1).

        ``prompt_tokens`` is the request's prompt size (a decode step reads its KV).
        """
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

    def inter_token_delay_s(self, position: int, *, prompt_tokens: int = 0) -> float:
        """See :meth:`TimingModel.inter_token_delay_s` (the prompt does not matter here)."""
        return self._jittered(self.decode_step_s * self.time_scale, position)

    def _jittered(self, delay: float, key: int) -> float:
        if self.jitter == 0.0 or delay == 0.0:
            return delay
        return delay * (1.0 + self.jitter * _unit_noise(self.seed, key))


@attrs.frozen
class StepTiming:
    """Continuous batching over an :class:`EngineProfile`: the engine runs a step loop.

    :mod:`narwhal.sim.batching` says what a step holds and costs in GPU milliseconds;
    :meth:`step_s` turns that into the seconds the loop sleeps. The :class:`TimingModel` answers
    are those of a request alone on an idle engine (prefill in chunks of at most
    ``max_num_batched_tokens``, each a pure prefill step; then one decode step per token).

    Attributes:
        profile: the step costs and limits.
        time_scale: multiplies every duration.
        jitter: relative amplitude of the seeded noise on each step (0 disables it; at most 1).
        seed: seeds the noise.
    """

    profile: EngineProfile
    time_scale: float = attrs.field(default=1.0, validator=_non_negative)
    jitter: float = attrs.field(default=0.0, validator=[_non_negative, attrs.validators.le(1.0)])
    seed: int = 0

    def step_s(self, cost_ms: float, index: int) -> float:
        """Seconds for step number ``index`` of GPU cost ``cost_ms`` (scaled, jittered)."""
        delay = cost_ms * self.time_scale / 1000.0
        if self.jitter == 0.0 or delay == 0.0:
            return delay
        return delay * (1.0 + self.jitter * _unit_noise(self.seed, index))

    def first_token_delay_s(self, prompt_tokens: int) -> float:
        """See :meth:`TimingModel.first_token_delay_s` (a lone request's chunked prefill)."""
        profile = self.profile
        cost_ms, start = 0.0, 0
        while True:
            end = min(prompt_tokens, start + profile.max_num_batched_tokens)
            cost_ms += profile.prefill_base_ms + profile.prefill_chunk_ms(start, end)
            if end >= prompt_tokens:
                break
            start = end
        return self.step_s(cost_ms, -1 - prompt_tokens)

    def inter_token_delay_s(self, position: int, *, prompt_tokens: int = 0) -> float:
        """See :meth:`TimingModel.inter_token_delay_s` (a decode step of a batch of one)."""
        cost_ms = self.profile.decode_step_ms(1, prompt_tokens + position)
        return self.step_s(cost_ms, position)


PROFILES: Mapping[str, TimingModel] = MappingProxyType(
    {
        **{name: StepTiming(engine) for name, engine in profiles.PROFILES.items()},
        "zero": LinearTiming(prefill_base_s=0.0, prefill_per_token_s=0.0, decode_step_s=0.0),
    }
)
"""The named timing profiles, unscaled (``time_scale`` 1, no jitter)."""


def profile(
    name: str, *, time_scale: float = 1.0, jitter: float = 0.0, seed: int = 0
) -> StepTiming | LinearTiming:
    """The named profile with a time scale, and optionally seeded jitter.

    Raises:
        ValueError: ``name`` is not in :data:`PROFILES`.
    """
    try:
        base = PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown timing profile {name!r} (known: {known})") from None
    assert isinstance(base, StepTiming | LinearTiming)
    return attrs.evolve(base, time_scale=time_scale, jitter=jitter, seed=seed)
