"""Predictive admission: project a request's time to first token before admitting it (pure).

The projection is what the request would see if admitted now, replaying what the dispatcher
will do with the requests queued before it:

1. **a seat**: each engine holds at most ``decode_concurrency`` requests (in prefill or in
   decode). A seat is free now, or when running requests end. Each running request's remaining
   output is a learned distribution (:mod:`narwhal.scheduling.lengths`, given what it already
   produced), run at the engine's time per output token; summed over the running requests,
   that gives the expected number of seats freed by each time, and the ``k``-th seat is free
   when that number reaches ``k - 1/2`` (with a hundred requests running, the first seat frees
   long before any one of them is expected to end). Each request ahead takes the earliest
   seat, and keeps it until its own expected output has run;
2. **the prefill pipeline**: on that engine it then waits for the compute of the prefills
   placed before it, and has its own
   (:class:`~narwhal.scheduling.forecast.PrefillForecast`);
3. plus the time already spent in the router and ``frontend_overhead_s``.

The request itself goes to the engine where that gives the earliest first token. That is the
typical first token; multiplied by the learned safety factor
(:class:`~narwhal.admission.margin.SafetyMargin`) it is the projection admission decides on.
Two refusals
follow (docs: Errors and refusals): when even the prompt alone, on the fastest idle eligible
engine, cannot meet the budget, waiting cannot help (429 ``prompt_exceeds_ttft_budget``); when
the projection is strictly over the budget, the client is told when to come back (429
``ttft_budget_exceeded`` with the overrun as ``Retry-After``).

Only engines whose context holds the prompt are considered (:mod:`narwhal.admission.context`).
A prompt longer than every eligible engine's context is not refused at all: the engine refuses
it with its own 400, at once, and the queue places it at once. Its projection is what it would
see if the engine served it after all (its size, at most that context, placed now on the
engine the queue will choose), marked :attr:`Projection.beyond_context` so that
:func:`check_budget` lets it through.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

import attrs

from narwhal.admission.context import beyond_context, fits, placed_size
from narwhal.admission.queue import Waiter
from narwhal.errors import PredictiveRefusal
from narwhal.scheduling.engines import Engine
from narwhal.scheduling.lengths import SEGMENTS, Census, OutputLengths, Remaining

__all__ = ["Projection", "check_budget", "judge", "project"]


@attrs.frozen
class Projection:
    """A projected time to first token, and its parts (seconds).

    Attributes:
        ttft_s: the projection admission decides on: ``typical_s`` times the safety margin.
        typical_s: the typical first token (as likely earlier as later).
        wait_s: the wait for a seat and the prefills ahead.
        own_prefill_s: the request's own prefill.
        prompt_alone_s: the prompt alone on the fastest idle eligible engine.
        engine: where it would go.
        beyond_context: the prompt is longer than every eligible engine's context: the engine
            is to refuse it, so admission does not.
    """

    ttft_s: float
    typical_s: float
    wait_s: float
    own_prefill_s: float
    prompt_alone_s: float
    engine: str
    beyond_context: bool = False


class _Running:
    """One running request in the sweep: where its end distribution stands."""

    __slots__ = ("rate", "rest", "share", "start")

    def __init__(self, start: float, rest: Remaining) -> None:
        self.start = start  # when its decoding starts (now, or its predicted first token)
        self.rest = rest
        self.share = 0  # the sweep has passed bound ``share``
        self.rate = 0.0  # its expected ends per second since that bound


class _Ends:
    """Seats freed as running requests end: the ``k``-th when ``k - 1/2`` are expected to have.

    Each running request's end is a distribution (its remaining output, in equal shares, at
    the engine's time per output token): uniform within each share, a point where a share has
    no width. Summed, the expected number of ends by time ``t`` is piecewise linear. The sweep
    walks it once, in order, as the replay takes seats, and reads each request's next bound only
    when the sweep reaches the one before: a short queue costs about one step per running
    request.
    """

    __slots__ = ("_freed", "_knots", "_slope", "_taken", "_time", "_tpot_s")

    def __init__(self, plan: _EnginePlan) -> None:
        self._tpot_s = tpot = plan.tpot_s
        knots: list[tuple[float, int, _Running]] = []  # (next bound's time, tie-breaker, who)
        for number, slot in enumerate(plan.engine.slots):
            start = plan.now
            if slot.phase == "prefill":
                start = max(start, slot.predicted_first_token_at)
            rest = plan.census.remaining(slot.route, slot.max_tokens, slot.generated_tokens)
            knots.append((start + rest.bound(0) * tpot, number, _Running(start, rest)))
        heapq.heapify(knots)
        self._knots = knots
        self._time = plan.now
        self._freed = 0.0
        self._slope = 0.0
        self._taken = 0

    def _pass_knot(self) -> None:
        """Move past the earliest bound of some request (the sweep's time is there)."""
        at, number, running = heapq.heappop(self._knots)
        self._slope = max(0.0, self._slope - running.rate)
        running.rate = 0.0
        weight = 1.0 / SEGMENTS
        while running.share < SEGMENTS:
            following = running.start + running.rest.bound(running.share + 1) * self._tpot_s
            running.share += 1
            if following - at > 1e-12:
                running.rate = weight / (following - at)
                self._slope += running.rate
                heapq.heappush(self._knots, (following, number, running))
                return
            self._freed += weight  # a share with no width: its ends come at once

    def next(self) -> float:
        """When the next seat frees (``inf`` when the running requests cannot free one)."""
        target = self._taken + 0.5
        while True:
            if self._freed >= target - 1e-9:
                return self._time
            upcoming = self._knots[0][0] if self._knots else math.inf
            if self._slope > 1e-12:
                hit = self._time + (target - self._freed) / self._slope
                if hit <= upcoming:
                    return hit
            if upcoming == math.inf:
                return math.inf
            self._freed += self._slope * (upcoming - self._time)
            self._time = upcoming
            self._pass_knot()

    def take(self) -> float:
        """Take the next seat; return when it frees."""
        at = self.next()
        self._taken += 1
        return at


class _EnginePlan:
    """One engine's seats and pipeline as the replay goes."""

    __slots__ = (
        "_ends",
        "backlog",
        "census",
        "engine",
        "free",
        "now",
        "placed",
        "prefill_free",
        "tpot_s",
    )

    def __init__(self, engine: Engine, census: Census, now: float) -> None:
        forecast = engine.forecast
        self.engine = engine
        self.census = census
        self.now = now
        self.backlog = forecast.pipeline
        self.tpot_s = forecast.tpot_s()
        self.free = max(0, engine.decode_limit - len(engine.slots))
        self.placed: list[float] = []  # when the replay's own placements end (a heap)
        self._ends: _Ends | None = None  # the running requests' ends, once needed
        # When each prefill slot frees: a placement needs one too (a heap).
        self.prefill_free = [
            max(now, slot.predicted_first_token_at)
            for slot in engine.slots
            if slot.phase == "prefill"
        ]
        self.prefill_free.extend([now] * max(0, engine.prefill_limit - len(self.prefill_free)))
        heapq.heapify(self.prefill_free)

    @property
    def ends(self) -> _Ends:
        if self._ends is None:
            self._ends = _Ends(self)
        return self._ends

    def next_seat(self) -> float:
        """When the next seat here is free."""
        if self.free:
            return self.now
        later = self.placed[0] if self.placed else math.inf
        return min(self.ends.next(), later)

    def _take_seat(self) -> float:
        if self.free:
            self.free -= 1
            return self.now
        if self.placed and self.placed[0] < self.ends.next():
            return heapq.heappop(self.placed)
        return self.ends.take()

    def placement(self) -> float:
        """When the next request could be placed here: a seat and a prefill slot are free."""
        return max(self.now, self.next_seat(), self.prefill_free[0])

    def first_token(self, tokens: int) -> float:
        """When a request placed here next would get its first token."""
        at = self.placement()
        return self.engine.forecast.predict(tokens, at, self.backlog) if at < math.inf else at

    def take(self, waiter: Waiter) -> None:
        """Place ``waiter`` here, as the dispatcher would."""
        at = max(self.now, self._take_seat(), heapq.heappop(self.prefill_free))
        if at == math.inf:
            heapq.heappush(self.prefill_free, at)
            return
        forecast = self.engine.forecast
        self.backlog = forecast.after(waiter.prompt_tokens, at, self.backlog)
        first = self.backlog.free_at + forecast.latency_s
        heapq.heappush(self.prefill_free, first)  # its prefill slot frees at its first token
        bounds = self.census.remaining(waiter.route, waiter.max_tokens).bounds()
        heapq.heappush(self.placed, first + sum(bounds) / len(bounds) * self.tpot_s)


def project(
    engines: Iterable[Engine],
    ahead: Sequence[Waiter],
    request: Waiter,
    lengths: OutputLengths,
    *,
    now: float,
    elapsed_s: float,
    overhead_s: float,
    margin: float = 1.0,
) -> Projection | None:
    """Project the TTFT of a request arriving now; ``None`` when no engine could serve it.

    Args:
        engines: the pool.
        ahead: the queued requests, in order.
        request: this request (its size, needs, route and ``max_tokens``).
        lengths: the learned output lengths.
        now: the Trio clock.
        elapsed_s: time this request already spent in the router.
        overhead_s: ``admission.frontend_overhead_s``.
        margin: the safety factor (:class:`~narwhal.admission.margin.SafetyMargin`).
    """
    engines = list(engines)
    census = lengths.census(
        (slot.route, slot.max_tokens, slot.generated_tokens)
        for engine in engines
        for slot in engine.slots
    )
    plans = [_EnginePlan(engine, census, now) for engine in engines if engine.eligible]
    over = beyond_context(engines, request.prompt_tokens, request.need_token_ids)
    if over is not None:
        return _beyond_context(over, request, now, elapsed_s, overhead_s, margin)
    for waiter in ahead:
        plan = _earliest(plans, waiter.prompt_tokens, waiter.need_token_ids)
        if plan is not None:
            plan.take(waiter)
    plan = _earliest(plans, request.prompt_tokens, request.need_token_ids)
    if plan is None:
        return None
    first_token_at = plan.first_token(request.prompt_tokens)
    start = max(plan.placement(), plan.backlog.free_at)
    alone = min(
        p.engine.forecast.standalone_s(request.prompt_tokens)
        for p in plans
        if (p.engine.provides_token_ids or not request.need_token_ids)
        and fits(p.engine, request.prompt_tokens)
    )
    typical = elapsed_s + (first_token_at - now) + overhead_s
    return Projection(
        ttft_s=typical * margin,
        typical_s=typical,
        wait_s=start - now,
        own_prefill_s=first_token_at - start,
        prompt_alone_s=alone + overhead_s,
        engine=plan.engine.name,
    )


def _beyond_context(
    engine: Engine,
    request: Waiter,
    now: float,
    elapsed_s: float,
    overhead_s: float,
    margin: float,
) -> Projection:
    """A prompt longer than every context: what it would see if ``engine`` served it anyway.

    It is placed at once (no queue ahead, no wait for a seat), sized at most at the context.
    """
    forecast = engine.forecast
    tokens = placed_size(engine, request.prompt_tokens)
    start = max(now, forecast.free_at)
    first_token_at = forecast.predict(tokens, now)
    typical = elapsed_s + (first_token_at - now) + overhead_s
    return Projection(
        ttft_s=typical * margin,
        typical_s=typical,
        wait_s=start - now,
        own_prefill_s=first_token_at - start,
        prompt_alone_s=forecast.standalone_s(tokens) + overhead_s,
        engine=engine.name,
        beyond_context=True,
    )


def _earliest(
    plans: Sequence[_EnginePlan], tokens: int, need_token_ids: bool
) -> _EnginePlan | None:
    best: _EnginePlan | None = None
    best_at = math.inf
    for plan in plans:
        if need_token_ids and not plan.engine.provides_token_ids:
            continue
        if not fits(plan.engine, tokens):
            continue
        at = plan.first_token(tokens)
        if best is None or at < best_at:
            best, best_at = plan, at
    return best


def judge(projection: Projection, budget_s: float) -> PredictiveRefusal | None:
    """The refusal predictive admission makes of ``projection``, or ``None`` to admit it.

    Never a refusal for a prompt beyond every context (the engine's 400 answers it):
    ``prompt_exceeds_ttft_budget`` when the prompt alone is over the budget;
    ``ttft_budget_exceeded`` (with the overrun as ``Retry-After``) when the projection is
    strictly over it.
    """
    if projection.beyond_context:
        return None
    if projection.prompt_alone_s > budget_s:
        return PredictiveRefusal.prompt_too_long(projection.prompt_alone_s, budget_s)
    if projection.ttft_s > budget_s:
        return PredictiveRefusal.over_budget(projection.ttft_s - budget_s)
    return None


def check_budget(projection: Projection, budget_s: float) -> None:
    """Refuse a projection over budget (:func:`judge`).

    Raises:
        PredictiveRefusal: the refusal :func:`judge` makes.
    """
    refusal = judge(projection, budget_s)
    if refusal is not None:
        raise refusal
