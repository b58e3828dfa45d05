"""How long the simulated engine takes (pure, no I/O).

Two kinds of timing model:

* :class:`StepTiming`, the continuous-batching model of the GPU engine types: the engine runs a
  step loop (:mod:`narwhal.sim.batching`) whose step costs come from one
  :class:`~narwhal.sim.batching.StepCosts`: normally a calibrated
  :class:`~narwhal.sim.calibration.EngineType`, the simulator's own physics, independent of the
  router's prior (:mod:`narwhal.scheduling.profiles`); a test that wants the engines to behave
  exactly as the router predicts passes the router's profile itself
  (``StepTiming(get_profile(name))``). A request's tokens come out when the steps that make them
  end, so its timing depends on everything else the engine is doing: queued prefills delay its
  first token, a big batch slows its decode, a full KV cache makes it wait.
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
``h100-llama3-8b``  :class:`StepTiming` over the calibrated ``h100-llama3-8b`` type
``a100-llama3-8b``  :class:`StepTiming` over the calibrated ``a100-llama3-8b`` type
``zero``            :class:`LinearTiming` with every constant 0
==================  ===============================================================

:func:`profile` builds one, optionally as the engine of a given seed (``variation``: the
per-engine spread of :meth:`~narwhal.sim.calibration.EngineType.varied`) and ``truth_scale``
times slower than its type.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import attrs

from narwhal.sim.batching import StepCosts
from narwhal.sim.calibration import ALIASES, ENGINE_TYPES, EngineType, unit_noise

__all__ = ["PROFILES", "LinearTiming", "StepTiming", "TimingModel", "profile"]


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
        return delay * (1.0 + self.jitter * unit_noise(self.seed, key))


@attrs.frozen
class StepTiming:
    """Continuous batching over an engine's step costs: the engine runs a step loop.

    :mod:`narwhal.sim.batching` says what a step holds and costs in GPU milliseconds;
    :meth:`step_s` turns that into the seconds the loop sleeps. The :class:`TimingModel` answers
    are those of a request alone on an idle engine (prefill in chunks of at most
    ``max_num_batched_tokens``, each a pure prefill step; then one decode step per token).

    Attributes:
        profile: the step costs and limits (a calibrated
            :class:`~narwhal.sim.calibration.EngineType`, or any
            :class:`~narwhal.sim.batching.StepCosts`, e.g. the router's own profile).
        time_scale: multiplies every duration.
        jitter: relative amplitude of the seeded noise on each step (0 disables it; at most 1).
        seed: seeds the noise.
    """

    profile: StepCosts
    time_scale: float = attrs.field(default=1.0, validator=_non_negative)
    jitter: float = attrs.field(default=0.0, validator=[_non_negative, attrs.validators.le(1.0)])
    seed: int = 0

    def step_s(self, cost_ms: float, index: int) -> float:
        """Seconds for step number ``index`` of GPU cost ``cost_ms`` (scaled, jittered)."""
        delay = cost_ms * self.time_scale / 1000.0
        if self.jitter == 0.0 or delay == 0.0:
            return delay
        return delay * (1.0 + self.jitter * unit_noise(self.seed, index))

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
        **{name: StepTiming(engine) for name, engine in ENGINE_TYPES.items()},
        "zero": LinearTiming(prefill_base_s=0.0, prefill_per_token_s=0.0, decode_step_s=0.0),
    }
)
"""The named timing profiles, unscaled (``time_scale`` 1, no jitter, the nominal engine types)."""


def profile(
    name: str,
    *,
    time_scale: float = 1.0,
    jitter: float = 0.0,
    seed: int = 0,
    variation: float = 0.0,
    truth_scale: float = 1.0,
) -> StepTiming | LinearTiming:
    """The named profile with a time scale, and optionally seeded jitter and variation.

    Args:
        name: a name in :data:`PROFILES` (or an engine type's alias, ``h100`` or ``a100``).
        time_scale: multiplies every duration (also the per-request overrides).
        jitter: relative amplitude of the seeded noise on each step.
        seed: seeds the jitter and the variation.
        variation: for an engine type, the spread of the engine built with ``seed``
            (:meth:`~narwhal.sim.calibration.EngineType.varied`; 0: the nominal type).
        truth_scale: for an engine type, its step costs times this (an engine that is really
            that much slower than its type; unlike ``time_scale`` it leaves the per-request
            overrides alone).

    Raises:
        ValueError: ``name`` is not a known profile, or a value is out of range.
    """
    base = PROFILES.get(ALIASES.get(name, name))
    if base is None:
        known = ", ".join(sorted({*PROFILES, *ALIASES}))
        raise ValueError(f"unknown timing profile {name!r} (known: {known})")
    assert isinstance(base, StepTiming | LinearTiming)
    if isinstance(base, StepTiming) and isinstance(base.profile, EngineType):
        engine = base.profile.varied(seed, variation)
        if truth_scale != 1.0:
            engine = engine.scaled(truth_scale)
        base = attrs.evolve(base, profile=engine)
    return attrs.evolve(base, time_scale=time_scale, jitter=jitter, seed=seed)
