"""The admission queue: a bounded record of who waits, and one dispatcher that places them.

A request that passed admission joins the queue (a full queue is an immediate 429) and waits
for the dispatcher's decision under two cancel scopes: the admission wait, which
:meth:`AdmissionQueue.wait_for_placement` opens, inside the request deadline, which the caller
opened when the request arrived. The dispatcher, a task in the app's nursery, follows the one
placement rule that the TTFT projection also replays (:class:`~narwhal.admission.plan.Plan`):
in arrival order, each request goes to the engine where its first token would come earliest,
and is placed as soon as that engine has a free prefill slot and decode headroom. A request
whose engine is full keeps its place in the plan, and a request behind it whose own best engine
has room goes ahead of it. The dispatcher looks again whenever something changes (a request
joined or left, a slot freed, an engine joined or left) and, when a request waits for an
engine, when that engine is expected to have room. When no engine is eligible at all, every
queued request that cannot be served gets its 503 at once.

A router that may not hold the lease (``fenced`` or ``standby``: ``control.placing`` is false,
:mod:`narwhal.control.lease`) places nothing from that instant: each queued request gets its 503
``router_fenced`` or ``router_standby`` at once (counted ``unavailable``), as a newcomer would,
rather than wait out its admission wait for a lease that, by then, the other router holds. Its
retry reaches the active router. Requests already placed finish.

``queue_limit`` counts the record: a request that leaves (its client went away, its wait ran
out) stops counting at once.

Placement honours the engines' context length (:mod:`narwhal.admission.context`): a request
goes only to an engine whose context holds its prompt, and a prompt longer than every eligible
engine's context does not queue at all: it is placed at once on the engine with the longest
context, which refuses it with its own 400 (or serves it, if the prompt was sized too long).
Waiting could not change that answer, and such a request at the head of the queue would hold up
everyone behind it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from narwhal.admission.context import Candidates, placed_size
from narwhal.admission.plan import EnginePlan, Plan
from narwhal.control.state import ControlState
from narwhal.errors import CapacityRejection, Expired, NarwhalError, Unavailable
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.scheduling.lengths import Keys, OutputLengths, request_keys

__all__ = ["AdmissionQueue", "QueueStatistics", "Waiter"]

_RECHECK_S = 0.005  # the soonest the dispatcher looks again for a request whose engine is full
# The queue's plan is walked again from the engines' state at least this often. Between walks,
# ends and first tokens are taken as the plan expected them, and a request waiting past its
# planned time has the plan walked again at once; 0.25 s kept the conversation trace's in-budget
# share at 2x and 3x and its refusals at 1x as they were with 0.1 s, at 2.5 times fewer walks.
_REFRESH_S = 0.25
# A plan at least this old is walked again when an engine has room that it did not expect.
_EARLY_S = 0.02


@attrs.define(eq=False)
class Waiter:
    """One request waiting for placement.

    Attributes:
        prompt_tokens: the sized prompt.
        need_token_ids: only engines that provide token IDs may take it.
        enqueued_at: Trio clock time of enqueueing.
        decided: set once the dispatcher placed or refused the request.
        slot: the placement, until the request takes it.
        failure: the refusal, if the dispatcher refused.
        withdrawn: the request left the queue (placed, expired or cancelled).
    """

    prompt_tokens: int
    need_token_ids: bool
    route: str = "chat"
    max_tokens: int | None = None
    enqueued_at: float = attrs.field(factory=trio.current_time)
    decided: trio.Event = attrs.field(factory=trio.Event)
    slot: Slot | None = None
    failure: NarwhalError | None = None
    withdrawn: bool = False
    # The wait its projection at arrival predicted (predictive and shadow modes).
    projected_wait_s: float | None = None
    # Where the queue's plan sends it, and when it expects to place it there.
    planned: EnginePlan | None = attrs.field(default=None, repr=False)
    planned_at: float = math.inf
    # The output-length distributions it will count in (each walk of the plan asks).
    length_keys: Keys = attrs.field(init=False, repr=False)

    @length_keys.default
    def _length_keys(self) -> Keys:
        return request_keys(self.route, self.max_tokens, self.prompt_tokens)


@attrs.frozen
class QueueStatistics:
    """A snapshot of the admission queue.

    ``placed_over_context`` counts the placements of prompts longer than every eligible
    engine's context (placed at once, for the engine to refuse).
    """

    depth: int
    limit: int
    enqueued: int
    placed: int
    refused_unavailable: int
    placed_over_context: int


class AdmissionQueue:
    """The queue and its dispatcher.

    Args:
        pool: the engines to place on.
        limit: ``admission.queue_limit``.
        lengths: the learned output lengths (the plan's running requests end by them).
        control: the router's state: nothing is placed while ``control.placing`` is false.
    """

    def __init__(
        self,
        pool: EnginePool,
        limit: int,
        lengths: OutputLengths | None = None,
        *,
        control: ControlState | None = None,
    ) -> None:
        self.pool = pool
        self.control = control
        self.limit = limit
        self.lengths = OutputLengths() if lengths is None else lengths
        self._waiting: dict[Waiter, None] = {}
        self._closed = False
        # The rule walked over every waiting request (current_plan), kept between changes.
        self._plan: Plan | None = None
        self._plan_engines: list[Engine] = []
        self._enqueued = 0
        self._placed = 0
        self._unavailable = 0
        self._placed_over = 0

    # -- the request's side ---------------------------------------------------------------------

    def waiting(self) -> list[Waiter]:
        """The live, unplaced requests, in arrival order."""
        return list(self._waiting)

    def plan(self) -> Plan:
        """The placement rule, from the engines as they are now."""
        return Plan(
            self.pool, self.lengths, now=trio.current_time(), tpot_target_s=self.pool.tpot_target_s
        )

    def current_plan(self) -> Plan:
        """The rule walked over every waiting request, in order: where the queue's plan has
        each go (:attr:`Waiter.planned`), and the state a newcomer would find.

        Walking the queue costs a step per waiting request and per running one, so the plan
        is kept, and each newcomer that joins the queue extends it. It is walked again from
        the engines as they are when it is older than ``_REFRESH_S``, when the eligible
        engines changed, and when a request waits past the time it was planned for
        (:meth:`dispatch`): between those, requests ending and first tokens arriving are
        taken as the plan expected them.
        """
        now = trio.current_time()
        plan = self._plan
        eligible = [engine for engine in self.pool if engine.eligible]
        if plan is None or now - plan.built_at > _REFRESH_S or eligible != self._plan_engines:
            plan = self._plan = self.plan()
            self._plan_engines = eligible
            for waiter in self._waiting:
                self._walk(plan, waiter)
        else:
            plan.advance(now)
        return plan

    def overrun(self, now: float, floor_s: float) -> float:
        """How far the waiting requests have overrun their projected waits: the largest ratio
        of the time one has waited so far to the wait its projection predicted, among those
        whose predicted wait was at least ``floor_s`` (0 when none is waiting)."""
        worst = 0.0
        for waiter in self._waiting:
            predicted = waiter.projected_wait_s
            if predicted is not None and predicted >= floor_s:
                ratio = (now - waiter.enqueued_at) / predicted
                if ratio > worst:
                    worst = ratio
        return worst

    def _walk(self, plan: Plan, waiter: Waiter) -> None:
        placed = plan.place(waiter)
        waiter.planned, waiter.planned_at = (None, math.inf) if placed is None else placed

    def place_now(self, waiter: Waiter) -> Slot | None:
        """Place at once when the engine the rule chooses, after everyone waiting, has room:
        what the dispatcher would do, without the hop through it.

        A prompt longer than every eligible engine's context is placed at once whoever waits.
        """
        if self._not_placing() is not None:
            return None
        slot = self._over_context(waiter, Candidates(self.pool))
        if slot is None:
            plan = self.current_plan()
            chosen = plan.choose(waiter)
            # Only when the plan has room for it now, after everyone waiting: an engine with room
            # now may be the one a waiting request is planned for, and the dispatcher is about
            # to place that one there.
            if (
                chosen is not None
                and chosen.placement() <= plan.now
                and self._has_room(chosen, waiter)
            ):
                slot = _take(chosen.engine, waiter)
                chosen.take(waiter)  # the plan knows it: the next newcomer is planned after it
        if slot is not None:
            self._enqueued += 1
            self._placed += 1
        return slot

    def _has_room(self, chosen: EnginePlan, waiter: Waiter) -> bool:
        """Whether the engine the rule chose can take ``waiter`` now."""
        engine = chosen.engine
        return (
            engine.can_place
            and engine.forecast.tpot_with(waiter.prompt_tokens) <= self.pool.tpot_target_s
        )

    def _over_context(self, waiter: Waiter, candidates: Candidates) -> Slot | None:
        """A place for a prompt longer than every eligible engine's context, else ``None``."""
        engine = candidates.beyond(waiter.prompt_tokens, waiter.need_token_ids)
        if engine is None:
            return None
        self._placed_over += 1
        return _take(engine, waiter, placed_size(engine, waiter.prompt_tokens))

    @asynccontextmanager
    async def placement(
        self, waiter: Waiter, wait_s: float, *, queued: Callable[[], None] | None = None
    ) -> AsyncIterator[Slot]:
        """The request's slot while the block runs, given back at exit however it ends.

        Places at once when nobody waits and an engine has room, else queues and waits at most
        ``wait_s`` for the dispatcher. ``queued`` is called once the request is placed or
        queued, before any wait (its turn in its instant ends: :mod:`narwhal.admission.instants`).

        Raises:
            CapacityRejection: the queue is full.
            Expired: ``admission_wait_expired``.
            Unavailable: no engine is eligible, or the router does not hold the lease.
        """
        refusal = self._not_placing()
        if refusal is not None:
            raise refusal
        slot = self.place_now(waiter)
        if slot is None:
            self.enqueue(waiter)
            if queued is not None:
                queued()
            slot = await self.wait_for_placement(waiter, wait_s)
        elif queued is not None:
            queued()
        with slot:
            yield slot

    def enqueue(self, waiter: Waiter) -> None:
        """Join the queue without waiting.

        Raises:
            CapacityRejection: the queue is full (429 ``admission_queue_full``).
        """
        if len(self._waiting) >= self.limit or self._closed:
            raise _queue_full()
        self._waiting[waiter] = None
        self._enqueued += 1
        if self._plan is not None:  # it joins the plan, after everyone waiting
            self._walk(self._plan, waiter)
        self.pool.notify()  # the dispatcher may place it at once

    async def wait_for_placement(self, waiter: Waiter, wait_s: float) -> Slot:
        """Wait at most ``wait_s`` for the dispatcher's decision; return the placement.

        Whatever ends the wait (expiry, refusal, cancellation), the waiter leaves the queue and
        a placement it did not take is given back.

        Raises:
            Expired: ``admission_wait_expired``, at exactly ``wait_s`` after enqueueing.
            Unavailable: no engine is eligible.
        """
        try:
            with trio.move_on_at(waiter.enqueued_at + wait_s):
                await waiter.decided.wait()
            if waiter.slot is not None:
                slot, waiter.slot = waiter.slot, None
                return slot
            if waiter.failure is not None:
                raise waiter.failure
            raise Expired(
                f"No engine could take the request within the admission wait of {wait_s:g} s.",
                code="admission_wait_expired",
            )
        finally:
            self.withdraw(waiter)

    def withdraw(self, waiter: Waiter) -> None:
        """Leave the queue (idempotent); give back a placement that was not taken."""
        if waiter.withdrawn:
            return
        waiter.withdrawn = True
        self._waiting.pop(waiter, None)
        waiter.planned = None  # a request that holds on to a plan would keep it alive
        if waiter.slot is not None:
            waiter.slot.release()
            waiter.slot = None
        self.pool.notify()  # the dispatcher may be holding this one

    # -- the dispatcher -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Place queued requests by the rule, until :meth:`close` (run it in the app's nursery)."""
        async with trio.open_nursery() as nursery:
            if self.control is not None:
                nursery.start_soon(self._follow, self.control)
            task_status.started()
            while not self._closed:
                changed = self.pool.next_change()
                look_again_at = self.dispatch()
                if look_again_at == math.inf:  # nothing to look at again by itself: no deadline
                    await changed.wait()
                    continue
                with trio.move_on_at(look_again_at):
                    await changed.wait()
            nursery.cancel_scope.cancel()

    async def _follow(self, control: ControlState) -> None:
        """Look again whenever the router's state changes: placing may have stopped."""
        while True:
            await control.wait_changed()
            self.pool.notify()

    def _not_placing(self) -> Unavailable | None:
        """The refusal of a router that may not place now (``fenced``, ``standby``), else
        ``None``."""
        control = self.control
        if control is None or control.placing:
            return None
        lease = control.lease
        return Unavailable(
            f"This router is {lease} and places no requests; retry shortly.", code=f"router_{lease}"
        )

    def dispatch(self) -> float:
        """Place every queued request whose engine, by the plan, has room now.

        Returns when to look again if nothing changes before (``inf``: only a change can help):
        the earliest time a request that could not be placed was planned for. A request still
        waiting past that time has its engine running late: the plan is walked again, so that
        it may go elsewhere.
        """
        if not self._waiting:
            return math.inf
        refusal = self._not_placing()
        if refusal is not None:
            for waiter in list(self._waiting):
                self._unavailable += 1
                self._decide(waiter, failure=refusal)
            return math.inf  # the change that lets it place again wakes the dispatcher
        candidates = Candidates(self.pool)  # no engine's eligibility changes during the pass
        self._refuse_unservable(candidates)
        pool = self.pool
        now = trio.current_time()
        look_again_at = math.inf
        if not any(engine.can_place for engine in pool):
            return look_again_at  # nobody can be placed until a slot frees, which wakes us
        plan = self.current_plan()
        overdue = False
        waited_for: set[Engine] = set()  # the engines the requests left waiting are planned on
        shortest = math.inf  # and the shortest of their prompts
        for waiter in list(self._waiting):
            # The engine that held its prompt may have left: it may be over context now.
            slot = self._over_context(waiter, candidates)
            if slot is None:
                chosen = waiter.planned
                if chosen is None:
                    continue
                if self._has_room(chosen, waiter):
                    slot = _take(chosen.engine, waiter)
                else:  # it waits for that engine: look again when it should have room
                    overdue = overdue or waiter.planned_at < now
                    look_again_at = min(look_again_at, max(waiter.planned_at, now + _RECHECK_S))
                    waited_for.add(chosen.engine)
                    shortest = min(shortest, waiter.prompt_tokens)
            if slot is not None:
                self._decide(waiter, slot=slot)
                self._placed += 1
                if not any(engine.can_place for engine in pool):
                    break
        if plan is self._plan and (overdue or self._early(plan, waited_for, shortest, now)):
            # Its engine runs late, or another has room sooner than planned: walk the plan
            # again, so that the requests waiting may go elsewhere.
            self._plan = None
            look_again_at = min(look_again_at, now + _RECHECK_S)
        return look_again_at

    def _early(self, plan: Plan, waited_for: set[Engine], shortest: float, now: float) -> bool:
        """Whether an engine has room now that the plan did not expect it to have yet, and no
        waiting request is planned on it: it freed sooner than planned, or its time per output
        token has come back inside the target, and the requests waiting for others might take
        it (the plan is at least :data:`_EARLY_S` old). An engine the plan knew to be free and
        fast enough, and chose for nobody, is no reason to walk it again."""
        if not waited_for or now - plan.built_at < _EARLY_S:
            return False
        tokens = int(shortest)
        target = self.pool.tpot_target_s
        return any(
            engine.can_place
            and engine not in waited_for
            and engine.forecast.tpot_with(tokens) <= target
            and (planned.placement() > now or planned.tpot_with(tokens) > target)
            for planned in plan.engines
            for engine in [planned.engine]
        )

    def _decide(
        self, waiter: Waiter, *, slot: Slot | None = None, failure: NarwhalError | None = None
    ) -> None:
        self._waiting.pop(waiter, None)
        waiter.planned = None
        waiter.slot = slot
        waiter.failure = failure
        waiter.decided.set()

    def _refuse_unservable(self, candidates: Candidates) -> None:
        if candidates.any(need_token_ids=True):
            return  # an engine that provides token IDs serves every request
        for waiter in list(self._waiting):
            if not candidates.any(need_token_ids=waiter.need_token_ids):
                self._unavailable += 1
                self._decide(
                    waiter,
                    failure=Unavailable(
                        "No engine is eligible to serve this request; retry shortly."
                    ),
                )

    def close(self) -> None:
        """Stop the dispatcher (shutdown)."""
        self._closed = True
        self.pool.notify()

    def statistics(self) -> QueueStatistics:
        """A frozen snapshot."""
        return QueueStatistics(
            depth=len(self._waiting),
            limit=self.limit,
            enqueued=self._enqueued,
            placed=self._placed,
            refused_unavailable=self._unavailable,
            placed_over_context=self._placed_over,
        )


def _take(engine: Engine, waiter: Waiter, tokens: int | None = None) -> Slot:
    size = waiter.prompt_tokens if tokens is None else tokens
    return Slot.take(engine, size, route=waiter.route, max_tokens=waiter.max_tokens)


def _queue_full() -> CapacityRejection:
    return CapacityRejection(
        "The admission queue is full; retry shortly.", code="admission_queue_full"
    )
