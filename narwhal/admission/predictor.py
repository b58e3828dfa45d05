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

The request itself goes to the engine where that gives the earliest first token. Two refusals
follow (docs: Errors and refusals): when even the prompt alone, on the fastest idle eligible
engine, cannot meet the budget, waiting cannot help (429 ``prompt_exceeds_ttft_budget``); when
the projection is strictly over the budget, the client is told when to come back (429
``ttft_budget_exceeded`` with the overrun as ``Retry-After``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Sequence

import attrs

from narwhal.admission.queue import Waiter
from narwhal.errors import PredictiveRefusal
from narwhal.scheduling.engines import Engine
from narwhal.scheduling.lengths import SEGMENTS, OutputLengths

__all__ = ["Projection", "check_budget", "project"]


@attrs.frozen
class Projection:
    """A projected time to first token, and its parts (seconds)."""

    ttft_s: float
    wait_s: float
    own_prefill_s: float
    prompt_alone_s: float
    engine: str


class _Ends:
    """Seats freed as running requests end: the ``k``-th when ``k - 1/2`` are expected to have.

    Each running request's end is a distribution (its remaining output, in equal shares, at
    the engine's time per output token): uniform within each share, a point where a share has
    no width. Summed, the expected number of ends by time ``t`` is piecewise linear; the sweep
    walks it once, in order, as the replay takes seats.
    """

    __slots__ = ("_events", "_freed", "_index", "_slope", "_taken", "_time")

    def __init__(self, events: list[tuple[float, float, float]], now: float) -> None:
        events.sort()
        self._events = events  # (time, ends at that instant, change of ends per second)
        self._index = 0
        self._time = now
        self._freed = 0.0
        self._slope = 0.0
        self._taken = 0

    @classmethod
    def of(cls, plan: _EnginePlan) -> _Ends:
        share = 1.0 / SEGMENTS
        events: list[tuple[float, float, float]] = []
        for slot in plan.engine.slots:
            start = plan.now
            if slot.phase == "prefill":
                start = max(start, slot.predicted_first_token_at)
            bounds = plan.lengths.remaining(slot.route, slot.max_tokens, slot.generated_tokens)
            ends = [start + tokens * plan.tpot_s for tokens in bounds]
            for low, high in itertools.pairwise(ends):
                if high - low > 1e-12:
                    rate = share / (high - low)
                    events.append((low, 0.0, rate))
                    events.append((high, 0.0, -rate))
                else:
                    events.append((low, share, 0.0))
        return cls(events, plan.now)

    def next(self) -> float:
        """When the next seat frees (``inf`` when the running requests cannot free one)."""
        target = self._taken + 0.5
        events = self._events
        while True:
            if self._freed >= target - 1e-9:
                return self._time
            upcoming = events[self._index][0] if self._index < len(events) else math.inf
            if self._slope > 1e-12:
                hit = self._time + (target - self._freed) / self._slope
                if hit <= upcoming:
                    return hit
            if upcoming == math.inf:
                return math.inf
            self._freed += self._slope * (upcoming - self._time)
            self._time = upcoming
            while self._index < len(events) and events[self._index][0] == upcoming:
                _, jump, change = events[self._index]
                self._freed += jump
                self._slope = max(0.0, self._slope + change)
                self._index += 1

    def take(self) -> float:
        """Take the next seat; return when it frees."""
        at = self.next()
        self._taken += 1
        return at


class _EnginePlan:
    """One engine's seats and pipeline as the replay goes."""

    __slots__ = ("_ends", "backlog", "engine", "free", "lengths", "now", "placed", "tpot_s")

    def __init__(self, engine: Engine, lengths: OutputLengths, now: float) -> None:
        forecast = engine.forecast
        self.engine = engine
        self.lengths = lengths
        self.now = now
        self.backlog = forecast.pipeline
        self.tpot_s = forecast.tpot_s()
        self.free = max(0, engine.decode_limit - len(engine.slots))
        self.placed: list[float] = []  # when the replay's own placements end (a heap)
        self._ends: _Ends | None = None  # the running requests' ends, once needed

    @property
    def ends(self) -> _Ends:
        if self._ends is None:
            self._ends = _Ends.of(self)
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

    def first_token(self, tokens: int) -> float:
        """When a request taking the next seat here would get its first token."""
        at = max(self.now, self.next_seat())
        return self.engine.forecast.predict(tokens, at, self.backlog) if at < math.inf else at

    def take(self, waiter: Waiter) -> None:
        """Seat ``waiter`` here, as the dispatcher would."""
        at = max(self.now, self._take_seat())
        if at == math.inf:
            return
        forecast = self.engine.forecast
        self.backlog = forecast.after(waiter.prompt_tokens, at, self.backlog)
        first = self.backlog.free_at + forecast.latency_s
        bounds = self.lengths.remaining(waiter.route, waiter.max_tokens)
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
    """
    plans = [_EnginePlan(engine, lengths, now) for engine in engines if engine.eligible]
    for waiter in ahead:
        plan = _earliest(plans, waiter.prompt_tokens, waiter.need_token_ids)
        if plan is not None:
            plan.take(waiter)
    plan = _earliest(plans, request.prompt_tokens, request.need_token_ids)
    if plan is None:
        return None
    first_token_at = plan.first_token(request.prompt_tokens)
    start = max(now, plan.next_seat(), plan.backlog.free_at)
    alone = min(
        p.engine.forecast.standalone_s(request.prompt_tokens)
        for p in plans
        if p.engine.provides_token_ids or not request.need_token_ids
    )
    return Projection(
        ttft_s=elapsed_s + (first_token_at - now) + overhead_s,
        wait_s=start - now,
        own_prefill_s=first_token_at - start,
        prompt_alone_s=alone + overhead_s,
        engine=plan.engine.name,
    )


def _earliest(
    plans: Sequence[_EnginePlan], tokens: int, need_token_ids: bool
) -> _EnginePlan | None:
    best: _EnginePlan | None = None
    best_at = math.inf
    for plan in plans:
        if need_token_ids and not plan.engine.provides_token_ids:
            continue
        at = plan.first_token(tokens)
        if best is None or at < best_at:
            best, best_at = plan, at
    return best


def check_budget(projection: Projection, budget_s: float) -> None:
    """Refuse a projection over budget.

    Raises:
        PredictiveRefusal: ``prompt_exceeds_ttft_budget`` when the prompt alone is over the
            budget; ``ttft_budget_exceeded`` when the projection is strictly over it.
    """
    if projection.prompt_alone_s > budget_s:
        raise PredictiveRefusal.prompt_too_long(projection.prompt_alone_s, budget_s)
    if projection.ttft_s > budget_s:
        raise PredictiveRefusal.over_budget(projection.ttft_s - budget_s)
