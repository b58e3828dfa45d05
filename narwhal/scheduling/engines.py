"""The engine pool: each engine's state, occupancy and token accounting, and placement.

Pure state, no I/O: an engine's health (:class:`~narwhal.scheduling.health.EngineHealth`) is
fed by the polls of :mod:`narwhal.upstream.health` and by the requests the exchange makes. An
engine becomes eligible once it has *joined*: it answers ``/health``, lists the served model in
``/v1/models`` and, where token IDs are wanted, a probe request has shown whether it really
returns them (vLLM before 0.10.2 ignores ``return_token_ids``: such an engine is reported
``token_accounting: unavailable`` instead of failing every request). An engine in a maintenance
wave (:mod:`narwhal.control.maintenance`) is not eligible whatever its health. Every change of
eligibility wakes the dispatcher (:meth:`EnginePool.notify`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, Protocol

import attrs
import trio

from narwhal.config import EngineConfig
from narwhal.scheduling.drift import Drift, DriftStatistics
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.health import (
    Change,
    EngineHealth,
    Failure,
    HealthState,
    HealthStatistics,
)
from narwhal.scheduling.lengths import Keys, request_keys

__all__ = [
    "Engine",
    "EngineConnection",
    "EngineMetrics",
    "EnginePool",
    "EngineStatistics",
    "Slot",
    "TokenAccounting",
]

TokenAccounting = Literal["token_ids", "unavailable"]


class EngineConnection(Protocol):
    """What the pool knows of an engine's connection pool: that it can be closed.

    The upstream layer owns the real client (:class:`narwhal.upstream.client.EngineClient`);
    scheduling does not depend on it.
    """

    async def aclose(self) -> None:
        """Close every pooled connection."""


@attrs.frozen
class EngineMetrics:
    """An engine's queue gauges as its last good ``/metrics`` poll read them
    (:mod:`narwhal.upstream.engine_metrics`); a gauge the engine does not publish is ``None``."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None

    @property
    def empty(self) -> bool:
        """Whether none of the gauges was there (the engine does not publish them)."""
        return self.running is None and self.waiting is None and self.kv_cache_usage is None

    def as_json(self) -> dict[str, float | None]:
        """The readings by name."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_cache_usage,
        }


@attrs.frozen
class EngineStatistics:
    """A snapshot of one engine, as ``/ready`` and ``/metrics`` show it."""

    name: str
    url: str
    dialect: str
    wave: str
    state: HealthState
    eligible: bool
    reason: str | None
    token_accounting: TokenAccounting
    prefill: int
    decode: int
    prefill_limit: int
    decode_limit: int
    completed: int
    failed: int
    prefill_scale: float
    health: HealthStatistics
    profiled: bool = False
    drift: DriftStatistics = attrs.field(factory=lambda: Drift().statistics())
    # How old the last good health and metrics polls are (seconds; ``None``: none yet), the
    # metrics they read, and whether metrics polls are expected of this engine at all.
    health_age_s: float | None = None
    metrics_age_s: float | None = None
    metrics: EngineMetrics | None = None
    metrics_expected: bool = False
    # The maintenance wave holding the engine out of placement, and the forecast's learned
    # latency and decode scale (``prefill_scale`` is its prefill scale).
    maintenance: str | None = None
    latency_s: float = 0.0
    decode_scale: float = 1.0


@attrs.define(eq=False)
class Engine:
    """One engine: its client, its health and what is running on it."""

    config: EngineConfig
    client: EngineConnection
    prefill_limit: int
    decode_limit: int
    forecast: PrefillForecast
    health: EngineHealth = attrs.field(factory=EngineHealth)
    token_accounting: TokenAccounting = "unavailable"
    prefill: int = 0
    decode: int = 0
    completed: int = 0
    failed: int = 0
    pool_changed: Callable[[], None] = lambda: None
    # Set by the pool: whether an engine other than this one is eligible (severe drift never
    # takes the last eligible engine out of placement), and what to do when this one leaves
    # placement (release drift holds if none is left).
    others_eligible: Callable[[Engine], bool] = lambda engine: False
    left_placement: Callable[[], None] = lambda: None
    slots: dict[Slot, None] = attrs.field(factory=dict)  # placed and not yet released
    # Attempts waiting for this engine's response headers: cancelled when its circuit opens,
    # so that they are retried elsewhere instead of waiting out the read timeout.
    attempts: set[trio.CancelScope] = attrs.field(factory=set)
    # The engine's own object for the served model, from its ``/v1/models`` (vLLM's carries
    # ``max_model_len``, ``root``, ``owned_by``...); ``None`` until a poll has read it.
    model_card: dict[str, object] | None = None
    # Profiling (narwhal.upstream.profiling) fits the forecast before the engine joins, and
    # again when it drifts (narwhal.scheduling.drift).
    drift: Drift = attrs.field(factory=Drift)
    profiled: bool = False
    # Whether something re-profiles the engine (its health poller, with monitoring.profiling):
    # only then does severe drift take it out of placement, the re-profiling bringing it back.
    reprofiled_on_drift: bool = False
    # The maintenance wave holding the engine out of placement (narwhal.control.maintenance),
    # or None: running requests finish, no new one is placed.
    maintenance: str | None = None
    # The forecast's prefill and decode scales as the last profiling fitted them (the prior's
    # until then): drift is measured against them, not against what was learned since.
    profiled_scale: float = attrs.field(init=False)
    profiled_decode_scale: float = attrs.field(init=False)
    # When a request here last left prefill (its first token, or it left): an inter-token gap
    # that began before then may have shared its step with a prefill.
    prefill_seen_at: float = -math.inf
    # The engine's queue gauges from its /metrics (narwhal.upstream.health polls them): the
    # last good poll's readings and time. ``metrics_expected`` turns false where the dialect
    # has no such gauges (openai) or the engine showed it publishes none (a 404, no gauge);
    # the watchdog (narwhal.control.watchdog) then does not wait for them.
    metrics: EngineMetrics | None = None
    metrics_at: float | None = None
    metrics_expected: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.profiled_scale = self.forecast.scale
        self.profiled_decode_scale = self.forecast.decode_scale
        self.metrics_expected = self.config.dialect != "openai"

    @property
    def placement_penalty(self) -> float:
        """What placement multiplies this engine's predicted wait by (1.0: no drift; the drift
        ratio while drift is sustained; see :attr:`narwhal.scheduling.drift.Drift.penalty`)."""
        return self.drift.penalty

    @property
    def wants_profile(self) -> bool:
        """Whether the health poller should (re-)profile the engine when it is idle."""
        return not self.profiled or self.drift.wants_profile

    @property
    def overcommitted(self) -> bool:
        """Whether more requests are placed here than the engine's batch holds
        (``max_num_seqs`` of its profile): the engine then queues some of them itself, and the
        times it is seen to take reflect that queue, which the forecast does not model. They
        teach neither the prefill speed, nor the decode speed, nor drift (an engine saturated
        by a router whose limits exceed its batch would otherwise look slower than it is, and
        be taken out of placement for it: a closed loop of 640 requests on two engines of 256
        taught one engine's prefill scale its bound, 50 times its profile)."""
        return len(self.slots) > self.forecast.profile.max_num_seqs

    @property
    def learned_prefill(self) -> float:
        """The forecast's prefill scale over the last profiling's: how much slower than
        measured it has learned the engine's prefill to be."""
        return self.forecast.scale / self.profiled_scale

    @property
    def learned_decode(self) -> float:
        """The forecast's decode scale over the last profiling's."""
        return self.forecast.decode_scale / self.profiled_decode_scale

    def observe_ttft(
        self, observed_s: float, predicted_s: float, *, learned: float | None = None
    ) -> None:
        """A first token, ``observed_s`` after placement where ``predicted_s`` was predicted
        by a forecast that had then learned ``learned`` (:attr:`learned_prefill` at the
        prediction, by default now's: what it has learned since the prediction must not
        count against it, or a slowdown the forecast is learning reads twice over).

        Sustained and severe drift penalise placement (:attr:`placement_penalty`) and ask for
        a re-profiling when the engine is next idle (:attr:`wants_profile`); severe drift
        takes it out of placement at once where it is re-profiled (:meth:`hold_for_drift`).
        """
        if learned is None:
            learned = self.learned_prefill
        self.drift.observe_ttft(observed_s, predicted_s, learned=learned)
        if self.reprofiled_on_drift:
            self.hold_for_drift()

    def observe_tpot(
        self, observed_s: float, predicted_s: float, *, learned: float | None = None
    ) -> None:
        """A request's gaps came ``observed_s`` per token where ``predicted_s`` was predicted
        with ``learned`` (:attr:`learned_decode` over its gaps as they were predicted; by
        default now's)."""
        if learned is None:
            learned = self.learned_decode
        self.drift.observe_tpot(observed_s, predicted_s, learned=learned)
        if self.reprofiled_on_drift:
            self.hold_for_drift()

    def hold(self, reason: str) -> Change | None:
        """Keep the engine out of placement for ``reason`` (see :meth:`EngineHealth.hold`)."""
        return self._changed(self.health.hold(reason))

    @property
    def held_for_drift(self) -> bool:
        """Whether a severe drift holds the engine out of placement (reason ``drift: ...``)."""
        held = self.health.held
        return held is not None and held.startswith("drift")

    @property
    def learned_slowdown(self) -> float:
        """How much slower than its last profiling the forecast has learned the engine to be,
        as far as drift shows it: the prefill scale over the profiling's where the time to first
        token drifts severely, the decode scale's where the time per output token drifts (the
        larger; of both while neither drifts severely; 1.0: as measured)."""
        drift = self.drift
        prefill, decode = self.learned_prefill, self.learned_decode
        ttft, tpot = drift.ttft, drift.tpot
        ttft_severe = ttft.samples >= drift.warm_up and ttft.far_above >= drift.sustain
        tpot_severe = tpot.samples >= drift.warm_up and tpot.far_above >= drift.sustain
        if not (ttft_severe or tpot_severe):
            return max(prefill, decode)
        learned = [prefill] if ttft_severe else []
        # The decode scale is learned from every gap, those of steps that also prefilled
        # included: it vouches for a slowdown only where the gaps of steps that only decoded
        # (the TPOT drift) show one too.
        if tpot.samples >= drift.warm_up and tpot.above >= drift.sustain:
            learned.append(decode)
        return max(learned, default=1.0)

    def hold_for_drift(self) -> Change | None:
        """Take the engine out of placement while its drift is severe, until it is re-profiled
        (:meth:`profiled_now`); ``held`` when it did.

        Never the last eligible engine of its pool (a slow engine serving is better than
        none), and only once the forecast has learned the engine itself slower than its
        profiling by the sustained threshold, in the phase that drifts
        (:attr:`learned_slowdown`): a severe ratio the forecast's speed does not share is the
        forecast's error (its queueing under a load it models badly), which a re-profiling
        would not change; the penalty answers that. A time to first token three times its
        prediction does not hold an engine whose decode steps merely run slower beside heavy
        prefill (the decode scale learned from them rises; its prefill scale does not).
        """
        if self.drift.state != "severe" or not self.eligible or not self.others_eligible(self):
            return None
        if self.learned_slowdown < self.drift.sustained_at:
            return None
        ttft, tpot = self.drift.ttft.ratio, self.drift.tpot.ratio
        return self.hold(f"drift: severe (ttft {ttft:.2f}x, tpot {tpot:.2f}x its profiling)")

    def release_drift(self) -> Change | None:
        """End a drift hold (no other engine is eligible any more); ``released`` when that made
        the engine eligible again."""
        if not self.held_for_drift:
            return None
        return self._changed(self.health.release())

    def profiled_now(self) -> Change | None:
        """A profiling succeeded (the forecast is calibrated): its drift starts again from the
        forecast's scales and any hold ends."""
        self.profiled = True
        self.profiled_scale = self.forecast.scale
        self.profiled_decode_scale = self.forecast.decode_scale
        self.drift.reset()
        return self._changed(self.health.release())

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length in tokens, where its model object says it."""
        card = self.model_card
        value = None if card is None else card.get("max_model_len")
        return value if type(value) is int and value > 0 else None

    @property
    def name(self) -> str:
        """The configured name."""
        return self.config.name

    @property
    def eligible(self) -> bool:
        """Whether new requests may be placed here: healthy, and in no maintenance wave."""
        return self.health.eligible and self.maintenance is None

    def enter_maintenance(self, wave: str) -> None:
        """Take the engine out of placement for maintenance wave ``wave`` (what runs here
        finishes); wakes the dispatcher, which plans without it from now on."""
        was = self.eligible
        self.maintenance = wave
        if was:
            self.left_placement()
        self.pool_changed()

    def leave_maintenance(self) -> None:
        """End the engine's maintenance: placeable again once healthy; wakes the dispatcher,
        since queued requests may go here now."""
        self.maintenance = None
        self.pool_changed()

    @property
    def can_place(self) -> bool:
        """Eligible, with a free prefill slot and decode headroom for when the prefill ends."""
        return (
            self.eligible
            and self.prefill < self.prefill_limit
            and self.prefill + self.decode < self.decode_limit
        )

    @property
    def provides_token_ids(self) -> bool:
        """Whether requests placed here are asked for, and validated by, token IDs."""
        return self.token_accounting == "token_ids"

    def record_outcome(self, *, ok: bool) -> None:
        """A request placed here ended: answered in full, or failed on this engine."""
        if ok:
            self.completed += 1
        else:
            self.failed += 1

    # -- health reports (each wakes the dispatcher when eligibility changes) ----------------------

    def poll_succeeded(self, now: float) -> Change | None:
        """A poll found the engine healthy (see :meth:`EngineHealth.poll_succeeded`)."""
        return self._changed(self.health.poll_succeeded(now))

    def poll_failed(self, now: float, failure: Failure) -> Change | None:
        """A poll failed (see :meth:`EngineHealth.poll_failed`)."""
        return self._changed(self.health.poll_failed(now, failure))

    def request_answered(self, now: float) -> None:
        """A request's response headers arrived: the engine is responsive."""
        self.health.request_answered(now)

    def request_failed(self, now: float, failure: Failure) -> Change | None:
        """A request met an unresponsive engine (see :meth:`EngineHealth.request_failed`)."""
        return self._changed(self.health.request_failed(now, failure))

    def _changed(self, change: Change | None) -> Change | None:
        # Joining or closing may make queued requests placeable; opening may make them
        # unservable (the dispatcher then refuses them at once).
        if change in ("opened", "held"):
            self.left_placement()
        if change in ("joined", "opened", "closed", "held", "released"):
            self.pool_changed()
        if change == "opened":
            for attempt in self.attempts:
                attempt.cancel()
        return change

    def metrics_polled(self, now: float, metrics: EngineMetrics) -> None:
        """A metrics poll read ``metrics`` at ``now`` (none of the gauges: the engine publishes
        none, and is no longer expected to)."""
        if metrics.empty:
            self.metrics_expected = False
            return
        self.metrics, self.metrics_at = metrics, now

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot."""
        now = trio.current_time()
        health = self.health.statistics(now)
        good = health.last_good_poll_at
        return EngineStatistics(
            name=self.name,
            url=self.config.url,
            dialect=self.config.dialect,
            wave=self.config.wave,
            state=health.state,
            eligible=self.eligible,
            reason=(
                health.reason if self.maintenance is None else f"maintenance: {self.maintenance}"
            ),
            token_accounting=self.token_accounting,
            prefill=self.prefill,
            decode=self.decode,
            prefill_limit=self.prefill_limit,
            decode_limit=self.decode_limit,
            completed=self.completed,
            failed=self.failed,
            prefill_scale=self.forecast.scale,
            health=health,
            profiled=self.profiled,
            drift=self.drift.statistics(),
            health_age_s=None if good is None else now - good,
            metrics_age_s=None if self.metrics_at is None else now - self.metrics_at,
            metrics=self.metrics,
            metrics_expected=self.metrics_expected,
            maintenance=self.maintenance,
            latency_s=self.forecast.latency_s,
            decode_scale=self.forecast.decode_scale,
        )


@attrs.define(eq=False, hash=False)
class Slot:
    """A request's place on an engine: prefill until its first output event, then decode.

    Creating the slot takes the prefill slot and records the forecast; the slot is exchanged
    for a decode slot at the first output event and released once, whatever happens.
    """

    engine: Engine
    prompt_tokens: int
    placed_at: float
    route: str = "chat"
    max_tokens: int | None = None
    predicted_first_token_at: float = 0.0
    phase: Literal["prefill", "decode", "released"] = "prefill"
    context_tokens: int = 0
    generated_tokens: int = 0
    key: int = 0
    learned_prefill: float = 1.0
    gaps_observed_s: float = 0.0
    gaps_predicted_s: float = 0.0
    gaps_profiled_s: float = 0.0
    gap_tokens: int = 0
    # The output-length distributions it counts in (fixed: its route, max_tokens and prompt
    # do not change): a plan's census reads them for every running request at every walk.
    length_keys: Keys = attrs.field(init=False, repr=False)

    @length_keys.default
    def _length_keys(self) -> Keys:
        return request_keys(self.route, self.max_tokens, self.prompt_tokens)

    @classmethod
    def take(
        cls,
        engine: Engine,
        prompt_tokens: int,
        *,
        route: str = "chat",
        max_tokens: int | None = None,
    ) -> Slot:
        """Place a request on ``engine`` now."""
        now = trio.current_time()
        slot = cls(engine, prompt_tokens, now, route, max_tokens)
        slot.key, slot.predicted_first_token_at = engine.forecast.place(prompt_tokens, now)
        slot.learned_prefill = engine.learned_prefill
        engine.prefill += 1
        engine.slots[slot] = None
        return slot

    def observe_gap(self, gap_s: float, tokens: int, *, now: float | None = None) -> None:
        """Output events of this request arrived ``gap_s`` after its last ones (at ``now``,
        by default the current time), carrying ``tokens`` tokens.

        The relay calls it once per network read (``Exchange.settle``): ``tokens`` is then
        the tokens of every output event of the read that had a gap (at least one each) and
        ``gap_s`` the sum of their gaps as the router saw them (the later events of one read
        came with the first: zero apart).
        """
        tokens = max(1, tokens)
        engine = self.engine
        if engine.overcommitted:
            return
        forecast = engine.forecast
        # Drift counts each request once, at its end: its gaps against their predictions, those
        # whose steps only decoded (no prompt here was in prefill since the gap began): the
        # predicted time per output token is the decode step's, which a step that also
        # prefills exceeds by its prefill chunk (TPOT would read 2 to 4x on a healthy engine
        # under prefill load).
        if now is None:
            now = trio.current_time()
        decode_only = engine.prefill == 0 and engine.prefill_seen_at <= now - gap_s
        if decode_only:
            predicted = forecast.tpot_s() * tokens
            self.gaps_observed_s += gap_s
            self.gaps_predicted_s += predicted
            # The same gap at the speed of the last profiling, by what the forecast had
            # learned at this gap (not at the request's end).
            self.gaps_profiled_s += predicted / engine.learned_decode
            self.gap_tokens += tokens
        forecast.observe_gap(gap_s, tokens, decode_only=decode_only)

    @property
    def expected_first_token_at(self) -> float:
        """When the first token is expected now: the placement's prediction as the forecast
        has revised it since (the pipeline runs late, later prompts joined its step)."""
        expected = self.engine.forecast.expected_first_token(self.key)
        return self.predicted_first_token_at if expected is None else expected

    @property
    def predicted_ttft_s(self) -> float:
        """Placement to first token, as predicted at placement."""
        return self.predicted_first_token_at - self.placed_at

    def to_decode(self, *, observed: bool = True, now: float | None = None) -> None:
        """Exchange the prefill slot for a decode slot: the first output event arrived (at
        ``now``, by default the current time), or, not ``observed``, the predicted time of a
        first token that cannot be seen has come (a request its engine answers whole); the
        forecast then learns nothing from it."""
        if self.phase != "prefill":
            return
        engine = self.engine
        engine.prefill -= 1
        engine.decode += 1
        self.phase = "decode"
        self.context_tokens = self.prompt_tokens
        if now is None:
            now = trio.current_time()
        engine.prefill_seen_at = now
        if observed:
            overcommitted = engine.overcommitted
            # What the placement predicted, with the prompts that joined its step since: the
            # engine's speed is judged against that (a burst's prompts share steps).
            predicted = self.predicted_first_token_at + engine.forecast.joined_s(self.key)
            if not overcommitted:
                engine.observe_ttft(
                    now - self.placed_at, predicted - self.placed_at, learned=self.learned_prefill
                )
            engine.forecast.saw_step(now)
            engine.forecast.first_token(
                self.key,
                placed_at=self.placed_at,
                predicted=predicted,
                now=now,
                tokens=self.prompt_tokens,
                learn=not overcommitted,
            )
        else:
            engine.forecast.assume_first_token(self.key, now=now, tokens=self.prompt_tokens)
        # A prefill slot is free now: a queued request may be placeable.
        engine.pool_changed()

    def generated(self, tokens: int, *, now: float | None = None) -> None:
        """Output tokens arrived (at ``now``, by default the current time): the request's
        context grew. The relay calls it once per network read, with the read's tokens."""
        self.generated_tokens += tokens
        if self.phase == "decode" and tokens:
            self.context_tokens += tokens
            forecast = self.engine.forecast
            forecast.generated(tokens)
            forecast.saw_step(trio.current_time() if now is None else now)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def failed(self, *, counted: bool = True) -> None:
        """An attempt on this slot failed: give it back at once (so that its engine's
        occupancy is true during a retry), counted against the engine unless not
        ``counted`` (an engine refusing work, as a 503 says, has not failed)."""
        self.release()
        if counted:
            self.engine.failed += 1

    def release(self) -> None:
        """Give the slot back (idempotent; also at the end of a ``with`` block)."""
        engine = self.engine
        if self.phase == "prefill":
            engine.prefill -= 1
            engine.prefill_seen_at = trio.current_time()
            engine.forecast.abandon_prefill(self.key, trio.current_time())
        elif self.phase == "decode":
            engine.decode -= 1
            engine.forecast.finish_decode(self.context_tokens)
            if self.gap_tokens:
                tokens = self.gap_tokens
                predicted = self.gaps_predicted_s
                engine.observe_tpot(
                    self.gaps_observed_s / tokens,
                    predicted / tokens,
                    learned=predicted / self.gaps_profiled_s if self.gaps_profiled_s > 0 else 1.0,
                )
        else:
            return
        self.phase = "released"
        engine.slots.pop(self, None)
        engine.pool_changed()


class EnginePool:
    """The configured engines and the placement among them."""

    def __init__(self, engines: Iterable[Engine], *, tpot_target_s: float = math.inf) -> None:
        self.engines: Sequence[Engine] = tuple(engines)
        self.tpot_target_s = tpot_target_s
        self._changed = trio.Event()
        for engine in self.engines:
            engine.pool_changed = self.notify
            engine.others_eligible = self._others_eligible
            engine.left_placement = self._keep_serving

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.engines)

    def notify(self) -> None:
        """Something changed (a slot freed, an engine joined or left): wake the dispatcher."""
        self._changed.set()
        self._changed = trio.Event()

    def _others_eligible(self, engine: Engine) -> bool:
        return any(other.eligible for other in self.engines if other is not engine)

    def _keep_serving(self) -> None:
        # An engine left placement: if none is eligible now, engines held only for their drift
        # serve again (slowly is better than refusing everything) until another one is back.
        if not any(engine.eligible for engine in self.engines):
            for engine in self.engines:
                engine.release_drift()

    def next_change(self) -> trio.Event:
        """The event the next :meth:`notify` sets (take it before looking, then wait on it:
        no change in between is missed)."""
        return self._changed

    def eligible(self) -> list[Engine]:
        """Engines that may take new work now."""
        return [engine for engine in self.engines if engine.eligible]

    def any_eligible(self, *, need_token_ids: bool = False) -> bool:
        """Whether some engine is eligible (and provides token IDs, if needed)."""
        return any(
            engine.eligible and (engine.provides_token_ids or not need_token_ids)
            for engine in self.engines
        )

    def any_provides_token_ids(self) -> bool:
        """Whether a configured engine is (or is expected to be) able to return token IDs."""
        return any(
            engine.provides_token_ids
            or (not engine.health.joined and engine.config.wants_token_ids)
            for engine in self.engines
        )

    def best(
        self,
        prompt_tokens: int,
        *,
        exclude: Iterable[Engine] = (),
        need_token_ids: bool = False,
    ) -> Engine | None:
        """The engine that may take the request now with the earliest predicted first token."""
        excluded = set(exclude)
        now = trio.current_time()
        best: Engine | None = None
        best_at = 0.0
        for engine in self.engines:
            if not engine.can_place or engine in excluded:
                continue
            if need_token_ids and not engine.provides_token_ids:
                continue
            if engine.forecast.tpot_with(prompt_tokens) > self.tpot_target_s:
                continue  # one more sequence would slow every stream there past the target
            at = engine.forecast.predict(prompt_tokens, now)
            if best is None or at < best_at:
                best, best_at = engine, at
        return best

    async def retake(
        self, failed: Slot, *, exclude: Iterable[Engine] = (), need_token_ids: bool = False
    ) -> Slot | None:
        """A slot elsewhere for the request whose attempt on ``failed`` failed: on the engine
        that may take it now with the earliest predicted first token (:meth:`best`), or
        ``None``. (A coroutine: a relay worker's pool asks its controller.)"""
        other = self.best(failed.prompt_tokens, exclude=exclude, need_token_ids=need_token_ids)
        if other is None:
            return None
        return Slot.take(
            other, failed.prompt_tokens, route=failed.route, max_tokens=failed.max_tokens
        )
