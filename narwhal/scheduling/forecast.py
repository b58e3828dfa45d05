"""The router's running forecast of each engine's prefill pipeline (pure, no I/O).

An engine runs its prefills first come, first served, in steps of chunked prefill beside its
decoding sequences (the physics of :mod:`narwhal.scheduling.profiles`). A request's time to
first token there has two parts:

* **compute**, which queues: its own prefill chunks plus the decode steps they ride along with,
  after the compute of every prefill placed before it (a prompt joining a running prefill does
  not pay the step's fixed cost again). ``free_at`` is when the placed compute is predicted
  done;
* **latency**, which does not queue: the engine's front end, the network, the step boundary.

Both are learned from the truth as it arrives, from requests placed on an idle pipeline (whose
time is their own): ``scale`` multiplies the profile's compute (a slower or faster engine than
its profile; the engine's drift) and ``latency_s`` is added. The two are fitted together by
normalised least mean squares on ``observed = latency + scale * compute``, so prompts of
different sizes tell them apart; with one size only, the part that is larger explains more.
When a first token arrives, the pipeline is replanned from the compute still pending.
"""

from __future__ import annotations

import attrs

from narwhal.scheduling.profiles import EngineProfile

__all__ = ["PrefillForecast"]

_LEARNING_RATE = 0.2
_DECODE_RATE = 0.02
_SCALE_BOUNDS = (0.05, 50.0)
_LATENCY_BOUNDS = (0.0, 10.0)
_LATENCY_UNIT_S = 0.01  # the latency term's regressor: makes both weights dimensionless


@attrs.define
class PrefillForecast:
    """One engine's prefill pipeline as the router predicts it.

    Attributes:
        profile: the engine's step costs.
        scale: observed over profiled compute, learned (1.0: the profile is right).
        latency_s: time to first token that does not queue, learned.
        free_at: when the placed compute is predicted done (Trio clock seconds).
        pending: predicted compute (seconds) of each placed request still waiting for its first
            token, by placement key, in placement order.
        decoding: requests past their first token.
        decode_context: context tokens (prompt and output so far) of the decoding requests.
    """

    profile: EngineProfile
    scale: float = 1.0
    latency_s: float = 0.0
    decode_scale: float = 1.0
    free_at: float = 0.0
    pending: dict[int, float] = attrs.field(factory=dict)
    decoding: int = 0
    decode_context: int = 0
    _keys: int = 0
    _teachers: dict[int, float] = attrs.field(factory=dict)
    _prompts: dict[int, int] = attrs.field(factory=dict)

    @property
    def in_prefill(self) -> int:
        """Requests placed and still waiting for their first token."""
        return len(self.pending)

    def compute_s(self, tokens: int, *, joins_running_prefill: bool) -> float:
        """Profiled (unscaled) seconds of compute to prefill ``tokens`` here as it is now."""
        profile = self.profile
        budget = max(1, profile.max_num_batched_tokens - self.decoding)
        steps = max(1, -(-tokens // budget))
        work_ms = profile.prefill_chunk_ms(0, tokens)
        if not joins_running_prefill and self.decoding == 0:
            work_ms += profile.prefill_base_ms
        work_ms += steps * profile.decode_step_ms(self.decoding, self.decode_context)
        return work_ms / 1000

    def tpot_with(self, tokens: int) -> float:
        """Predicted time per output token if one more sequence of ``tokens`` joined the batch.

        Every sequence placed here will decode: those in prefill count already.
        """
        batch = self.decoding + self.in_prefill + 1
        context = self.decode_context + sum(self._prompts.values()) + tokens
        # The profile's decode step: ``scale`` is learned from prefills, not from decoding.
        return self.profile.decode_step_ms(batch, context) / 1000

    def tpot_s(self) -> float:
        """Predicted time per output token of the decoding batch as it is now."""
        batch = max(1, self.decoding)
        context = self.decode_context + sum(self._prompts.values())
        return self.profile.decode_step_ms(batch, context) / 1000 * self.decode_scale

    def observe_gap(self, gap_s: float, tokens: int) -> None:
        """An inter-token gap was observed (per token): learn the decode scale."""
        expected = self.profile.decode_step_ms(max(1, self.decoding), self.decode_context) / 1000
        if expected <= 0 or gap_s <= 0:
            return
        ratio = min(max(gap_s / tokens / expected, self.decode_scale / 2), self.decode_scale * 2)
        updated = self.decode_scale + _DECODE_RATE * (ratio - self.decode_scale)
        self.decode_scale = min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], updated))

    def standalone_s(self, tokens: int) -> float:
        """The prompt's time to first token on an idle engine: the least it can take here."""
        return self.profile.prefill_ms(tokens) / 1000 * self.scale + self.latency_s

    def predict(self, tokens: int, now: float, free_at: float | None = None) -> float:
        """When a prompt placed now would get its first token (absolute time)."""
        free = self.free_at if free_at is None else free_at
        busy = free > now
        compute = self.compute_s(tokens, joins_running_prefill=busy) * self.scale
        return max(now, free) + compute + self.latency_s

    def pipeline_after(self, tokens: int, now: float, free_at: float) -> float:
        """``free_at`` once a prompt placed at ``now`` has had its compute."""
        busy = free_at > now
        return max(now, free_at) + self.compute_s(tokens, joins_running_prefill=busy) * self.scale

    def place(self, tokens: int, now: float) -> tuple[int, float]:
        """Record a placement; return its key and predicted first-token time."""
        idle = self.free_at <= now
        compute = self.compute_s(tokens, joins_running_prefill=not idle)
        start = max(now, self.free_at)
        self._keys += 1
        key = self._keys
        self.pending[key] = compute * self.scale
        self._prompts[key] = tokens
        if idle:  # its time will be its own: it can teach the model
            self._teachers[key] = compute
        self.free_at = start + compute * self.scale
        return key, self.free_at + self.latency_s

    def first_token(
        self, key: int, *, placed_at: float, predicted: float, now: float, tokens: int
    ) -> None:
        """A placed request got its first token: replan the pipeline and learn.

        The engine serves prefills first come, first served, so what is still pending starts
        now at the latest: the pipeline is free once their predicted compute has run.
        """
        self.pending.pop(key, None)
        self._prompts.pop(key, None)
        self.free_at = now + sum(self.pending.values())
        self.decoding += 1
        self.decode_context += tokens
        compute = self._teachers.pop(key, None)
        if compute is not None:
            self._learn(observed=now - placed_at, compute=compute)

    def _learn(self, *, observed: float, compute: float) -> None:
        x_latency, x_compute = 1.0, compute / _LATENCY_UNIT_S
        w_latency, w_compute = self.latency_s / _LATENCY_UNIT_S, self.scale
        predicted = w_latency * x_latency + w_compute * x_compute
        # One outlier (a stall, a hiccup) moves the model by at most a factor of two.
        target = min(max(observed / _LATENCY_UNIT_S, predicted / 2), predicted * 2)
        error = target - predicted
        norm = x_latency * x_latency + x_compute * x_compute
        w_latency += _LEARNING_RATE * error * x_latency / norm
        w_compute += _LEARNING_RATE * error * x_compute / norm
        self.latency_s = min(
            _LATENCY_BOUNDS[1], max(_LATENCY_BOUNDS[0], w_latency * _LATENCY_UNIT_S)
        )
        self.scale = min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], w_compute))

    def abandon_prefill(self, key: int, now: float) -> None:
        """A placed request left before its first token."""
        cost = self.pending.pop(key, 0.0)
        self._teachers.pop(key, None)
        self._prompts.pop(key, None)
        self.free_at = max(now, self.free_at - cost)

    def generated(self, tokens: int) -> None:
        """Output tokens arrived for a decoding request (its context grew)."""
        self.decode_context += tokens

    def finish_decode(self, context_tokens: int) -> None:
        """A decoding request ended, releasing its context."""
        self.decoding = max(0, self.decoding - 1)
        self.decode_context = max(0, self.decode_context - context_tokens)
