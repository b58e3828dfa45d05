"""Predictive admission: project a request's time to first token before admitting it (pure).

The projection is what the request would see if admitted now, replaying what the dispatcher
will do with the requests queued before it:

1. **a seat**: each engine holds at most ``decode_concurrency`` requests (in prefill or in
   decode). A seat is free now, or when a running request's output ends: its expected length
   (learned, :mod:`narwhal.scheduling.lengths`, given what it already produced) times the
   engine's time per output token. Each request ahead takes the earliest seat, and keeps it
   until its own expected output has run;
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
import math
from collections.abc import Iterable, Sequence

import attrs

from narwhal.admission.queue import Waiter
from narwhal.errors import PredictiveRefusal
from narwhal.scheduling.engines import Engine
from narwhal.scheduling.lengths import OutputLengths

__all__ = ["Projection", "check_budget", "project"]


@attrs.frozen
class Projection:
    """A projected time to first token, and its parts (seconds)."""

    ttft_s: float
    wait_s: float
    own_prefill_s: float
    prompt_alone_s: float
    engine: str


class _EnginePlan:
    """One engine's seats and pipeline as the replay goes."""

    __slots__ = ("engine", "free_at", "seats", "tpot_s")

    def __init__(self, engine: Engine, lengths: OutputLengths, now: float) -> None:
        forecast = engine.forecast
        self.engine = engine
        self.free_at = forecast.free_at
        self.tpot_s = forecast.tpot_s()
        releases: list[float] = []
        for slot in engine.slots:
            total = lengths.expected_total(slot.route, slot.max_tokens, slot.generated_tokens)
            start = max(now, slot.predicted_first_token_at) if slot.phase == "prefill" else now
            releases.append(start + (total - slot.generated_tokens) * self.tpot_s)
        releases.extend([now] * max(0, engine.decode_limit - len(engine.slots)))
        heapq.heapify(releases)
        self.seats = releases

    def first_token(self, tokens: int, now: float) -> tuple[float, float]:
        """``(seat time, first-token time)`` of a request taking the next seat here."""
        seat = self.seats[0] if self.seats else math.inf
        at = max(now, seat)
        return seat, self.engine.forecast.predict(tokens, at, self.free_at)

    def take(self, waiter: Waiter, lengths: OutputLengths, now: float) -> float:
        """Seat ``waiter`` here; return its first-token time."""
        seat = heapq.heappop(self.seats) if self.seats else math.inf
        at = max(now, seat)
        first = self.engine.forecast.predict(waiter.prompt_tokens, at, self.free_at)
        self.free_at = self.engine.forecast.pipeline_after(waiter.prompt_tokens, at, self.free_at)
        total = lengths.expected_total(waiter.route, waiter.max_tokens)
        heapq.heappush(self.seats, first + total * self.tpot_s)
        return first


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
        plan = _earliest(plans, waiter.prompt_tokens, waiter.need_token_ids, now)
        if plan is not None:
            plan.take(waiter, lengths, now)
    plan = _earliest(plans, request.prompt_tokens, request.need_token_ids, now)
    if plan is None:
        return None
    seat, first_token_at = plan.first_token(request.prompt_tokens, now)
    start = max(now, seat, plan.free_at)
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
    plans: Sequence[_EnginePlan], tokens: int, need_token_ids: bool, now: float
) -> _EnginePlan | None:
    best: _EnginePlan | None = None
    best_at = math.inf
    for plan in plans:
        if need_token_ids and not plan.engine.provides_token_ids:
            continue
        _, at = plan.first_token(tokens, now)
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
