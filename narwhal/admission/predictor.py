"""Predictive admission: project a request's time to first token before admitting it (pure).

The projection is what the request would see if admitted now: the dispatcher's own rule
(:class:`~narwhal.admission.plan.Plan`) replayed over the requests queued before it, then over
the request itself: a seat on the engine where its first token comes earliest, a prefill slot,
the prefills ahead of it in that engine's pipeline, its own prefill, later by what the requests
behind it in its instant add to its prefill step (:func:`joined_by`); plus the time already
spent in the router and ``frontend_overhead_s``.

That is the typical first token. Admission decides on it plus the learned caution
(:class:`~narwhal.admission.margin.SafetyMargin`), which sits on the uncertain part, the wait,
and on the own prefill only as far as the own prefill's error goes. Two refusals follow (docs:
Errors and refusals): when even the prompt alone, on the fastest idle eligible engine, cannot
meet the budget, waiting cannot help (429 ``prompt_exceeds_ttft_budget``); when the projection
is strictly over the budget, the client is told when to come back (429
``ttft_budget_exceeded`` with the overrun as ``Retry-After``).

Only engines whose context holds the prompt are considered (:mod:`narwhal.admission.context`).
A prompt longer than every eligible engine's context is not refused at all: the engine refuses
it with its own 400, at once, and the queue places it at once. Its projection is what it would
see if the engine served it after all (its size, at most that context, placed now on the
engine the queue will choose), marked :attr:`Projection.beyond_context` so that
:func:`check_budget` lets it through.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from narwhal.admission.context import beyond_context, placed_size
from narwhal.admission.margin import SafetyMargin
from narwhal.admission.plan import EnginePlan, Plan
from narwhal.admission.queue import Waiter
from narwhal.errors import PredictiveRefusal
from narwhal.scheduling.engines import Engine
from narwhal.scheduling.lengths import OutputLengths

__all__ = ["Projection", "Ticks", "check_budget", "joined_by", "judge", "project"]

_TICK_RATE = 0.05  # how far one instant moves the learned share of instants with several arrivals


@attrs.frozen
class Projection:
    """A projected time to first token, and its parts (seconds).

    Attributes:
        ttft_s: the projection admission decides on: ``typical_s`` plus the safety margin's
            caution on the wait and the own prefill.
        typical_s: the typical first token (as likely earlier as later): the parts below,
            the wait and the own prefill corrected by their learned bias.
        wait_s: the wait for a seat and the prefills ahead, as the plan predicts it.
        own_prefill_s: the request's own prefill, as the forecast predicts it.
        prompt_alone_s: the prompt alone on the fastest idle eligible engine.
        engine: where it would go.
        beyond_context: the prompt is longer than every eligible engine's context: the engine
            is to refuse it, so admission does not.
        fixed_s: the parts that do not wait: the time already spent in the router and
            ``frontend_overhead_s``.
        seat_s: the part of ``wait_s`` spent waiting for a seat, beyond the prefill compute
            ahead (:meth:`~narwhal.admission.plan.EnginePlan.seat_wait`).
    """

    ttft_s: float
    typical_s: float
    wait_s: float
    own_prefill_s: float
    prompt_alone_s: float
    engine: str
    beyond_context: bool = False
    fixed_s: float = 0.0
    seat_s: float = 0.0


@attrs.define
class Ticks:
    """How often requests arrive in ticks: several in the same instant.

    Prompts placed on an engine in the same instant share its next prefill step, and a
    prompt's first token comes when that step ends: later with every prompt that joins it
    after it. When a request arrives, those behind it in its tick have not: its projection
    expects them with the chance :meth:`arrive` gives
    (:meth:`~narwhal.scheduling.forecast.PrefillForecast.joining_s`).

    Attributes:
        share: the share of recent instants that held more than one arrival (a moving
            average that each instant moves 5 % of the way).
    """

    share: float = 0.0
    _at: float = -math.inf
    _count: int = 0

    def arrive(self, now: float) -> float:
        """A request arrives ``now``: the chance that more will arrive after it in this
        instant. One when one already did (it is in a tick), else the learned share."""
        if now != self._at:
            if self._count:
                self.share += _TICK_RATE * ((self._count > 1) - self.share)
            self._at, self._count = now, 0
        self._count += 1
        return 1.0 if self._count > 1 else self.share


def project(
    engines: Iterable[Engine],
    ahead: Sequence[Waiter],
    request: Waiter,
    lengths: OutputLengths,
    *,
    now: float,
    elapsed_s: float,
    overhead_s: float,
    margin: SafetyMargin | None = None,
    tpot_target_s: float = math.inf,
    plan: Plan | None = None,
    overrun: float = 0.0,
    budget_s: float = 2.0,
    overloaded: bool = False,
    joiners: float = 0.0,
    behind: Sequence[Waiter] = (),
    company: bool = False,
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
        margin: the learned caution (none: the projection is the typical first token).
        tpot_target_s: ``admission.tpot_target_s`` (placement prefers engines inside it).
        plan: the rule already walked over ``ahead`` (the queue keeps one,
            :meth:`~narwhal.admission.queue.AdmissionQueue.current_plan`); without it, the
            walk is made here.
        overrun: how far the requests waiting now have overrun their predicted waits
            (:meth:`~narwhal.admission.queue.AdmissionQueue.overrun`).
        budget_s: ``admission.ttft_budget_s`` (the margin judges a wait by its share of it).
        overloaded: admission is refusing
            (:meth:`~narwhal.admission.margin.SafetyMargin.overloaded`): the caution grows
            with the wait.
        joiners: the chance that requests arriving after it in its instant will join its
            prefill step (:meth:`Ticks.arrive`): its first token is expected that much of
            the learned fill of its step's room later
            (:meth:`~narwhal.scheduling.forecast.PrefillForecast.joining_s`).
        behind: the requests that arrived after it in its instant
            (:class:`~narwhal.admission.instants.Turn`): the rule is walked over them too, on
            a copy of the plan, and its first token is as late as those that join its last
            prefill step make it (:func:`joined_by`); ``joiners`` then plays no part.
        company: it is decided with the rest of its instant, in a tick of several requests
            (:class:`~narwhal.admission.instants.Turn`): the margin reads its caution at its
            tick quantile while admission is not refusing
            (:attr:`~narwhal.admission.margin.SafetyMargin.tick_quantile`).
    """
    engines = list(engines)
    over = beyond_context(engines, request.prompt_tokens, request.need_token_ids)
    if over is not None:
        return _beyond_context(over, request, now, elapsed_s, overhead_s, margin, budget_s)
    if plan is None:
        plan = Plan(engines, lengths, now=now, tpot_target_s=tpot_target_s)
        for waiter in ahead:
            plan.place(waiter)
    else:
        plan.advance(now)
    choice = plan.choose_timed(request)
    if choice is None:
        return None
    chosen, first_token_at = choice
    if behind:
        first_token_at += joined_by(plan, chosen, request, behind, budget_s=budget_s)
    elif joiners > 0:
        forecast = chosen.forecast
        after = forecast.after(
            request.prompt_tokens, chosen.placement(), chosen.backlog, chosen.decoding
        )
        first_token_at += forecast.joining_s(after, chosen.decoding, chance=joiners)
    start = chosen.start()
    seat_s = min(chosen.seat_wait(), start - now)
    tokens = request.prompt_tokens
    alone = min(  # on the engines as the plan took them, as choose() read them
        p.forecast.standalone_s(tokens)
        for p in plan.engines
        if p.serves(tokens, request.need_token_ids)
    )
    return _projection(
        elapsed_s + overhead_s,
        start - now,
        first_token_at - start,
        alone + overhead_s,
        chosen.engine,
        margin,
        overrun=overrun,
        budget_s=budget_s,
        seat_s=seat_s,
        overloaded=overloaded,
        company=company,
    )


def joined_by(
    plan: Plan,
    chosen: EnginePlan,
    request: Waiter,
    behind: Sequence[Waiter],
    *,
    budget_s: float = math.inf,
) -> float:
    """How much later ``request``'s first token comes, placed next on ``chosen``, for the
    requests ``behind`` it that join its last prefill step: the rule walked over it and them on
    a copy of ``plan`` (the plan itself is left as it is). Those whose own first token, so
    walked, is past ``budget_s`` are taken to be refused, and join nothing.

    A prompt placed on an engine while the step holding the end of another's prefill has not
    started shares that step, and the step ends later, as the forecast revises a placed prompt
    (:meth:`~narwhal.scheduling.forecast.PrefillForecast.join_delay_s`). Steps it adds after the
    request's own do not delay it: the engine prefills first come, first served.
    """
    walk = plan.copy()
    mine = walk.engines[plan.engines.index(chosen)]
    mine.take(request)
    forecast = mine.forecast
    own = mine.backlog
    end = own.free_at
    now = walk.now
    for waiter in behind:
        chosen_timed = walk.choose_timed(waiter)
        if chosen_timed is None:
            continue
        where, first = chosen_timed
        if first - now > budget_s:
            continue  # its own first token is past the budget: it is to be refused
        if where is not mine:
            where.take(waiter)
            continue
        before, batch = mine.backlog, mine.decoding
        mine.take(waiter)
        after = mine.backlog
        if after.tokens <= waiter.prompt_tokens or end <= before.last_step_at:
            continue  # it did not join the step the request's prefill ends in
        end += forecast.join_delay_s(before, after, waiter.prompt_tokens, batch[0])
    return end - own.free_at


def _projection(
    fixed_s: float,
    wait_s: float,
    own_prefill_s: float,
    prompt_alone_s: float,
    engine: Engine,
    margin: SafetyMargin | None,
    *,
    overrun: float = 0.0,
    budget_s: float = 2.0,
    beyond_context: bool = False,
    seat_s: float = 0.0,
    overloaded: bool = False,
    company: bool = False,
) -> Projection:
    typical_wait, typical_own, caution = wait_s, own_prefill_s, 0.0
    if margin is not None:
        typical_wait, typical_own = margin.typical(wait_s, own_prefill_s, seat_s, budget_s=budget_s)
        caution = margin.caution_s(
            wait_s,
            own_prefill_s,
            overrun,
            budget_s=budget_s,
            seat_s=seat_s,
            overloaded=overloaded,
            company=company,
        )
    typical_s = fixed_s + typical_wait + typical_own
    return Projection(
        ttft_s=typical_s + caution,
        typical_s=typical_s,
        wait_s=wait_s,
        own_prefill_s=own_prefill_s,
        prompt_alone_s=prompt_alone_s,
        engine=engine.name,
        beyond_context=beyond_context,
        fixed_s=fixed_s,
        seat_s=seat_s,
    )


def _beyond_context(
    engine: Engine,
    request: Waiter,
    now: float,
    elapsed_s: float,
    overhead_s: float,
    margin: SafetyMargin | None,
    budget_s: float,
) -> Projection:
    """A prompt longer than every context: what it would see if ``engine`` served it anyway.

    It is placed at once (no queue ahead, no wait for a seat), sized at most at the context.
    """
    forecast = engine.forecast
    tokens = placed_size(engine, request.prompt_tokens)
    start = max(now, forecast.free_at)
    first_token_at = forecast.predict(tokens, now)
    return _projection(
        elapsed_s + overhead_s,
        start - now,
        first_token_at - start,
        forecast.standalone_s(tokens) + overhead_s,
        engine,
        margin,
        budget_s=budget_s,
        beyond_context=True,
    )


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
