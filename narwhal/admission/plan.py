"""Where and when each queued request goes: the one placement rule, replayed (pure).

The dispatcher places queued requests and predictive admission projects a newcomer's time to
first token, and both follow one rule, :class:`Plan`: in arrival order, each request goes to the
engine where it would get its first token earliest, among the eligible engines whose context
holds its prompt (and that provide token IDs, if it needs them), preferring those where one
more sequence keeps the predicted time per output token inside ``admission.tpot_target_s``. It
waits for that engine when the engine is full, rather than taking a slower one that is free.

A plan replays that rule from what the engines hold now:

1. **a seat**: each engine holds at most ``decode_concurrency`` requests (in prefill or in
   decode). A seat is free now, or when running requests end. Each running request's remaining
   output is a learned distribution (:mod:`narwhal.scheduling.lengths`, given what it already
   produced), run at the engine's decode step (its own speed, without prompt chunks beside
   it), and the steps until then also carry the prompts placed before (those in prefill now
   and those the replay places), as far as a step's token budget carries them; summed over
   the running requests,
   that gives the expected number of seats freed by each time, and the ``k``-th seat is free
   when that number reaches ``k - 1/2`` (with a hundred requests running, the first seat frees
   long before any one of them is expected to end). Each request ahead takes the earliest
   seat, and keeps it until its own expected output has run;
2. **a prefill slot**: at most ``prefill_concurrency`` requests are in prefill at once; a slot
   frees at its request's expected first token (as revised since placement; one already late
   is expected to be as late again);
3. **the prefill pipeline**: on that engine it then waits for the compute of the prefills
   placed before it, and has its own
   (:class:`~narwhal.scheduling.forecast.PrefillForecast`).

The dispatcher (:class:`~narwhal.admission.queue.AdmissionQueue`) walks the queue with a plan
and places, for real, each request whose chosen engine has room now; the others keep their
place in the plan, so that the requests behind them are planned as the dispatcher will place
them. The projection (:mod:`narwhal.admission.predictor`) walks the same plan to the newcomer.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from narwhal.scheduling.engines import Engine
from narwhal.scheduling.lengths import SEGMENTS, Census, OutputLengths, Remaining

if TYPE_CHECKING:
    from narwhal.admission.queue import Waiter

__all__ = ["EnginePlan", "Plan"]


_SHARE = 1.0 / SEGMENTS  # the weight of one share of a request's end


class _Ends:
    """Seats freed as running requests end: the ``k``-th when ``k - 1/2`` are expected to have.

    Each running request's end is a distribution (its remaining output, in equal shares, at
    the engine's time per output token): uniform within each share, a point where a share has
    no width. Summed, the expected number of ends by time ``t`` is piecewise linear. The sweep
    walks it once, in order, as the replay takes seats, and reads each request's next bound only
    when the sweep reaches the one before: a short queue costs about one step per running
    request.
    """

    __slots__ = ("_freed", "_knots", "_next", "_slope", "_taken", "_time", "_tpot_s")

    def __init__(self, plan: EnginePlan) -> None:
        self._tpot_s = tpot = plan.decode_tpot_s
        # Each running request's next bound: (its time, a tie-breaker, the share it closes,
        # the rate of ends until it, when the request decodes from, its remaining output).
        knots: list[tuple[float, int, int, float, float, Remaining]] = []
        now = plan.now
        remaining = plan.census.get().remaining_of
        for number, slot in enumerate(plan.slots):
            start = now
            if slot.phase == "prefill":
                start = max(start, slot.expected_first_token_at)
            rest = remaining(slot.length_keys, slot.max_tokens, slot.generated_tokens)
            knots.append((start + rest.bound(0) * tpot, number, 0, 0.0, start, rest))
        heapq.heapify(knots)
        self._knots = knots
        self._time = plan.now
        self._freed = 0.0
        self._slope = 0.0
        self._taken = 0
        self._next: float | None = None  # next(), until a seat is taken

    def copy(self) -> _Ends:
        """The sweep as it stands, to go on apart."""
        twin = _Ends.__new__(_Ends)
        for name in _Ends.__slots__:
            setattr(twin, name, getattr(self, name))
        twin._knots = list(self._knots)
        return twin

    def next(self) -> float:
        """When the next seat frees (``inf`` when the running requests cannot free one)."""
        if self._next is not None:
            return self._next
        self._next = at = self._sweep()
        return at

    def _sweep(self) -> float:
        target = self._taken + 0.5
        freed = self._freed
        if freed >= target - 1e-9:
            return self._time
        # The sweep, with its state in locals (it runs for every seat a walk takes).
        knots = self._knots
        slope = self._slope
        time = self._time
        tpot = self._tpot_s
        while True:
            upcoming = knots[0][0] if knots else math.inf
            if slope > 1e-12:
                hit = time + (target - freed) / slope
                if hit <= upcoming:
                    break
            if upcoming == math.inf:
                hit = math.inf
                break
            freed += slope * (upcoming - time)
            time = upcoming
            # Move past the earliest bound of some request: its next share, or its shares
            # with no width at once (their ends come together).
            at, number, share, rate, start, rest = knots[0]
            slope -= rate
            if slope < 0.0:
                slope = 0.0
            while share < SEGMENTS:
                share += 1
                following = start + rest.bound(share) * tpot
                if following - at > 1e-12:
                    rate = _SHARE / (following - at)
                    slope += rate
                    heapq.heapreplace(knots, (following, number, share, rate, start, rest))
                    break
                freed += _SHARE
            else:  # its last share passed: it leaves the sweep
                heapq.heappop(knots)
            if freed >= target - 1e-9:
                hit = time
                break
        self._freed = freed
        self._slope = slope
        self._time = time
        return hit

    def take(self) -> float:
        """Take the next seat; return when it frees."""
        at = self.next()
        self._taken += 1
        self._next = None
        return at


class EnginePlan:
    """One engine's seats and pipeline as the replay goes."""

    __slots__ = (
        "_at",
        "_ends",
        "backlog",
        "batch",
        "census",
        "compute_free",
        "context",
        "decode_tpot_s",
        "decoding",
        "engine",
        "forecast",
        "free",
        "max_len",
        "now",
        "penalty",
        "placed",
        "prefill_ahead",
        "prefill_free",
        "slots",
        "step_compute",
        "token_ids",
        "tpot_s",
    )

    def __init__(self, engine: Engine, census: _LazyCensus, now: float) -> None:
        self.forecast = forecast = engine.forecast
        self.engine = engine
        # What the walk asks of the engine for every request, as it is now.
        self.penalty = engine.placement_penalty
        self.token_ids = engine.provides_token_ids
        self.max_len = engine.max_model_len
        self.census = census
        self.now = now
        self.backlog = forecast.pipeline_at(now)
        # When the prompts' compute placed here would be done, alone (seats never short, no
        # decode step beside): the wait beyond it depends on the running requests (seat_wait).
        self.compute_free = self.backlog.free_at
        self.tpot_s = forecast.tpot_s()
        # The running requests' ends are timed by the decode step alone, and a seat frees
        # that much later for the prompt compute the engine runs first: the prompts in
        # prefill now and those the replay places, as far as the steps before it carry them.
        self.decode_tpot_s = forecast.decode_tpot_s()
        self.prefill_ahead = forecast.pending_compute_s()
        self.step_compute = forecast.step_compute_s()
        # What one more sequence would decode beside (PrefillForecast.tpot_with, as it is now:
        # the TPOT check does not grow the batch).
        self.batch = forecast.decoding + forecast.in_prefill + 1
        self.context = forecast.decode_context + sum(p.tokens for p in forecast.pending.values())
        # The decoding batch the replay's prefills run beside, as it grows: every request in
        # prefill and every one the replay places will decode, every seat freed is one less.
        self.decoding = (self.batch - 1, self.context)
        # The running requests as they are now: the dispatcher places for real as it walks
        # the plan, and each placement is in the plan already.
        self.slots = list(engine.slots)
        self.free = max(0, engine.decode_limit - len(self.slots))
        self.placed: list[float] = []  # when the replay's own placements end (a heap)
        self._ends: _Ends | None = None  # the running requests' ends, once needed
        # When each prefill slot frees: a placement needs one too (a heap). A first token
        # already late is expected as late again: the longer it is overdue, the later.
        self.prefill_free = [
            at if at > now else now + (now - at)
            for slot in self.slots
            if slot.phase == "prefill"
            for at in [slot.expected_first_token_at]
        ]
        self.prefill_free.extend([now] * max(0, engine.prefill_limit - len(self.prefill_free)))
        heapq.heapify(self.prefill_free)
        self._at: float | None = None  # placement(), until the plan here changes

    def copy(self) -> EnginePlan:
        """This engine's plan as it stands, to be walked apart (a hypothetical walk)."""
        twin = EnginePlan.__new__(EnginePlan)
        for name in EnginePlan.__slots__:
            setattr(twin, name, getattr(self, name))
        twin.placed = list(self.placed)
        twin.prefill_free = list(self.prefill_free)
        twin._ends = None if self._ends is None else self._ends.copy()
        return twin

    def serves(self, tokens: int, need_token_ids: bool) -> bool:
        """Whether the engine can take such a request, as it was when the plan was made: its
        context holds the prompt (:func:`~narwhal.admission.context.fits`), and it provides
        token IDs if the request needs them."""
        if need_token_ids and not self.token_ids:
            return False
        return self.max_len is None or tokens <= self.max_len

    @property
    def ends(self) -> _Ends:
        if self._ends is None:
            self._ends = _Ends(self)
        return self._ends

    def _stretched(self, at: float) -> float:
        """When the decoding batch reaches ``at`` (on the decode step's own time), with the
        prompt compute ahead run beside it: at most what the steps until then carry."""
        if at == math.inf or self.prefill_ahead <= 0:
            return at
        steps = (at - self.now) / self.decode_tpot_s if self.decode_tpot_s > 0 else math.inf
        return at + min(self.prefill_ahead, steps * self.step_compute)

    def next_seat(self) -> float:
        """When the next seat here is free."""
        if self.free:
            return self.now
        later = self.placed[0] if self.placed else math.inf
        return min(self._stretched(self.ends.next()), later)

    def _take_seat(self) -> float:
        if self.free:
            self.free -= 1
            return self.now
        sequences, context = self.decoding
        if sequences:  # the seat is one a decoding request frees: the batch loses it
            self.decoding = (sequences - 1, context - context // sequences)
        if self.placed and self.placed[0] < self._stretched(self.ends.next()):
            return heapq.heappop(self.placed)
        return self._stretched(self.ends.take())

    def placement(self) -> float:
        """When the next request could be placed here: a seat and a prefill slot are free."""
        at = self._at
        if at is None:
            at = self._at = max(self.now, self.next_seat(), self.prefill_free[0])
        return at

    def start(self) -> float:
        """When the next request's prefill could start here: once it is placed, after the
        compute ahead of it."""
        return max(self.placement(), self.backlog.free_at)

    def earliest_first_token(self, tokens: int) -> float:
        """A lower bound of :meth:`first_token`: its prefill starts no earlier than
        :meth:`start`, and takes at least its own tokens' compute."""
        return self.start() + self.forecast.compute_s(tokens) + self.forecast.latency_s

    def seat_wait(self) -> float:
        """How much of the next request's wait here depends on the running requests: how much
        later its prefill starts than the compute of the prompts ahead alone would have it
        start. That is the wait for a seat, which frees only when a running request's output
        ends, and the decode steps the prefills ahead run beside: the least predictable part
        of a wait (:class:`~narwhal.admission.margin.SafetyMargin` learns its error apart)."""
        return max(0.0, self.start() - max(self.now, self.compute_free))

    def tpot_with(self, tokens: int) -> float:
        """Predicted time per output token there with one more sequence of ``tokens`` (judged
        on the batch as it was when the plan was made: the replay does not grow it)."""
        return self.forecast.decode_step_s(self.batch, self.context + tokens)

    def first_token(self, tokens: int) -> float:
        """When a request placed here next would get its first token."""
        at = self.placement()
        if at == math.inf:
            return at
        return self.forecast.predict(tokens, at, self.backlog, self.decoding)

    def take(self, waiter: Waiter) -> None:
        """Place ``waiter`` here, as the dispatcher will."""
        self._at = None
        at = max(self.now, self._take_seat(), heapq.heappop(self.prefill_free))
        if at == math.inf:
            heapq.heappush(self.prefill_free, at)
            return
        forecast = self.forecast
        compute = forecast.compute_s(waiter.prompt_tokens)
        self.prefill_ahead += compute
        self.compute_free = max(self.now, self.compute_free) + compute
        self.backlog = forecast.after(waiter.prompt_tokens, at, self.backlog, self.decoding)
        sequences, context = self.decoding
        self.decoding = (sequences + 1, context + waiter.prompt_tokens)  # it decodes next
        first = self.backlog.free_at + forecast.latency_s
        heapq.heappush(self.prefill_free, first)  # its prefill slot frees at its first token
        rest = self.census.get().remaining_of(waiter.length_keys, waiter.max_tokens, 0)
        heapq.heappush(self.placed, first + rest.mean_bound() * self.tpot_s)


class _LazyCensus:
    """The census of the running requests, taken when the plan first needs it (a plan that
    only places on free engines never does)."""

    __slots__ = ("_census", "_engines", "_lengths")

    def __init__(self, lengths: OutputLengths, engines: list[Engine]) -> None:
        self._lengths = lengths
        self._engines = engines
        self._census: Census | None = None

    def get(self) -> Census:
        """The census, taken now if it was not yet."""
        census = self._census
        if census is None:
            census = self._census = Census(
                self._lengths,
                (
                    (slot.length_keys, slot.generated_tokens)
                    for engine in self._engines
                    for slot in engine.slots
                ),
            )
        return census


class Plan:
    """The placement rule replayed over the pool's eligible engines, from ``now``.

    Args:
        engines: the pool.
        lengths: the learned output lengths.
        now: the Trio clock.
        tpot_target_s: ``admission.tpot_target_s``.
    """

    __slots__ = ("built_at", "engines", "now", "tpot_target_s")

    def __init__(
        self,
        engines: Iterable[Engine],
        lengths: OutputLengths,
        *,
        now: float,
        tpot_target_s: float = math.inf,
    ) -> None:
        eligible = [engine for engine in engines if engine.eligible]
        census = _LazyCensus(lengths, eligible)
        self.now = self.built_at = now
        self.tpot_target_s = tpot_target_s
        self.engines = [EnginePlan(engine, census, now) for engine in eligible]

    def choose(self, waiter: Waiter) -> EnginePlan | None:
        """The engine ``waiter`` goes to (``None``: no eligible engine can serve it)."""
        chosen = self.choose_timed(waiter)
        return None if chosen is None else chosen[0]

    def choose_timed(self, waiter: Waiter) -> tuple[EnginePlan, float] | None:
        """The engine ``waiter`` goes to, and its first token there
        (:meth:`EnginePlan.first_token`; ``None``: no eligible engine can serve it).

        The earliest first token among the engines that can serve it, those inside the TPOT
        target first; a drifting engine's time counts as longer by its placement penalty.
        """
        tokens = waiter.prompt_tokens
        candidates: list[tuple[float, int, EnginePlan]] = []
        need_token_ids = waiter.need_token_ids
        for number, plan in enumerate(self.engines):
            if plan.serves(tokens, need_token_ids):
                candidates.append((plan.earliest_first_token(tokens), number, plan))
        # The engines in the order of their earliest possible first token: one whose bound
        # already loses to the best found cannot win, and its forecast is not asked.
        candidates.sort()
        best: EnginePlan | None = None
        best_first = math.inf
        # (over the TPOT target, penalised time to first token, configuration order)
        best_key: tuple[bool, float, int] = (True, math.inf, len(self.engines))
        now = self.now
        target = self.tpot_target_s
        for earliest, number, plan in candidates:
            # A drifting engine's predictions are not to be trusted as they are: its time to
            # the first token counts as longer (Engine.placement_penalty, 1 without drift).
            least = (earliest - now) * plan.penalty
            if best is not None and not best_key[0] and (least, number) >= best_key[1:]:
                continue  # it loses to the best found even inside the TPOT target
            slow = plan.tpot_with(tokens) > target
            if best is not None and (slow, least, number) >= best_key:
                continue
            first = plan.first_token(tokens)
            key = (slow, (first - now) * plan.penalty, number)
            if best is None or key < best_key:
                best, best_key, best_first = plan, key, first
        return None if best is None else (best, best_first)

    def copy(self) -> Plan:
        """The plan as it stands, to be walked apart: walking the copy leaves it as it is."""
        twin = Plan.__new__(Plan)
        twin.built_at, twin.now, twin.tpot_target_s = self.built_at, self.now, self.tpot_target_s
        twin.engines = [plan.copy() for plan in self.engines]
        return twin

    def place(self, waiter: Waiter) -> tuple[EnginePlan, float] | None:
        """Choose ``waiter``'s engine and take its place there in the plan.

        Returns the engine's plan and when the request is to be placed there (``None``: no
        eligible engine can serve it).
        """
        plan = self.choose(waiter)
        if plan is None:
            return None
        at = plan.placement()
        plan.take(waiter)
        return plan, at

    def advance(self, now: float) -> None:
        """Move the plan's present to ``now`` (later): nothing is placed in the past."""
        if now > self.now:
            self.now = now
            for plan in self.engines:
                plan.now = now
                plan._at = None
