"""The router's running forecast of each engine's prefill pipeline (pure, no I/O).

An engine runs its prefills first come, first served, in steps of chunked prefill beside its
decoding sequences (the physics of :mod:`narwhal.scheduling.profiles`). The forecast keeps one
number per engine, ``free_at``: when every prefill placed there is predicted done. A request
placed at ``now`` starts at ``max(now, free_at)`` and costs its own prefill chunks plus the
decode steps they ride along with; when the engine is already prefilling, the new prompt joins
those steps and does not pay the step's fixed cost again.

Predictions are corrected as the truth arrives: when a first token comes, the pipeline shifts
by the error of that request, and ``scale`` (the running ratio of observed to predicted prefill
time, the engine's drift) multiplies every cost, which also absorbs a slower or faster engine
than its profile says.
"""

from __future__ import annotations

import attrs

from narwhal.scheduling.profiles import EngineProfile

__all__ = ["PrefillForecast"]

_SCALE_STEP = 0.2
_SCALE_BOUNDS = (0.05, 50.0)


@attrs.define
class PrefillForecast:
    """One engine's prefill pipeline as the router predicts it.

    Attributes:
        profile: the engine's step costs.
        scale: observed over predicted prefill time, learned (1.0: the profile is right).
        free_at: when the placed prefills are predicted done (Trio clock seconds).
        pending: predicted cost (seconds) of each placed request still waiting for its first
            token, by placement key, in placement order.
        decoding: requests past their first token.
        decode_context: context tokens (prompt and output so far) of the decoding requests.
    """

    profile: EngineProfile
    scale: float = 1.0
    free_at: float = 0.0
    pending: dict[int, float] = attrs.field(factory=dict)
    decoding: int = 0
    decode_context: int = 0
    _keys: int = 0

    @property
    def in_prefill(self) -> int:
        """Requests placed and still waiting for their first token."""
        return len(self.pending)

    def cost_s(self, tokens: int, *, joins_running_prefill: bool) -> float:
        """Predicted seconds to prefill ``tokens`` on this engine as it is now."""
        profile = self.profile
        budget = max(1, profile.max_num_batched_tokens - self.decoding)
        steps = max(1, -(-tokens // budget))
        work_ms = profile.prefill_chunk_ms(0, tokens)
        if not joins_running_prefill and self.decoding == 0:
            work_ms += profile.prefill_base_ms
        work_ms += steps * profile.decode_step_ms(self.decoding, self.decode_context)
        return work_ms / 1000 * self.scale

    def standalone_s(self, tokens: int) -> float:
        """The prompt's prefill on an idle engine: the least it can ever take here."""
        return self.profile.prefill_ms(tokens) / 1000 * self.scale

    def predict(self, tokens: int, now: float, free_at: float | None = None) -> float:
        """When a prompt placed now would get its first token (absolute time)."""
        free = self.free_at if free_at is None else free_at
        busy = free > now
        return max(now, free) + self.cost_s(tokens, joins_running_prefill=busy)

    def place(self, tokens: int, now: float) -> tuple[int, float]:
        """Record a placement; return its key and predicted first-token time."""
        idle = self.free_at <= now
        predicted = self.predict(tokens, now)
        self._keys += 1
        # A request placed on an idle pipeline teaches the scale (its wait is nobody else's).
        key = self._keys if idle else -self._keys
        self.pending[key] = predicted - max(now, self.free_at)
        self.free_at = predicted
        return key, predicted

    def first_token(
        self, key: int, *, placed_at: float, predicted: float, now: float, tokens: int
    ) -> None:
        """A placed request got its first token: replan the pipeline and learn the scale.

        The engine serves prefills first come, first served, so what is still pending starts
        now at the latest: the pipeline is free once their predicted costs have run.
        """
        self.pending.pop(key, None)
        self.free_at = now + sum(self.pending.values())
        self.decoding += 1
        self.decode_context += tokens
        expected = predicted - placed_at
        observed = now - placed_at
        if key > 0 and expected > 0 and observed > 0:
            updated = self.scale * (observed / expected) ** _SCALE_STEP
            self.scale = min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], updated))

    def abandon_prefill(self, key: int, now: float) -> None:
        """A placed request left before its first token."""
        cost = self.pending.pop(key, 0.0)
        self.free_at = max(now, self.free_at - cost)

    def generated(self, tokens: int) -> None:
        """Output tokens arrived for a decoding request (its context grew)."""
        self.decode_context += tokens

    def finish_decode(self, context_tokens: int) -> None:
        """A decoding request ended, releasing its context."""
        self.decoding = max(0, self.decoding - 1)
        self.decode_context = max(0, self.decode_context - context_tokens)
