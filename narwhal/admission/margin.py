"""The safety margin of predictive admission, learned, and put where the uncertainty is (pure).

The projection (:mod:`narwhal.admission.predictor`) aims at the typical first token: half of
the requests see theirs later than projected. Admitting every request whose projection fits the
budget would therefore, under overload, fill the queue up to the budget's edge and let half of
what it admits miss. Predictive admission adds caution, but not to the whole projection: its
parts are not equally uncertain.

* **The wait** is the uncertain part, and it has two parts of its own. The wait for **the
  prefills ahead** is the compute of prompts of known sizes, predicted as the request's own is;
  the wait for **a seat** depends on how long the running requests' outputs go on, which nobody
  knows (:meth:`~narwhal.admission.plan.EnginePlan.seat_wait` splits them). Each part's caution
  is a high quantile (the 99th percentile by default) of ``observed wait / predicted wait`` over
  recent admitted requests whose wait was mostly of that part and a real share of the budget,
  where the observed wait is the observed TTFT less the parts that do not wait. A burst of long
  prompts is not judged by how wrong output lengths can be, and a queue for seats is not
  trusted as far as a queue of prefills.
* **The request's own prefill** is known from its size and the engine's learned speed. Its
  caution is the same quantile of ``observed / predicted`` prefill, learned from requests that
  hardly waited, so that a long prompt on an idle engine is judged by how well the model
  predicts long prompts, not by how long queues run; and by band of predicted prefill, as
  the waits are: a prompt that shares its step with a neighbour arriving after it gets its
  first token up to a step's chunk later, which is twice a 0.1 s prefill and a quarter of a
  1.4 s one, so short prompts' errors may lower a long prompt's caution, never raise it.

The typical projection corrects each part by its learned bias (the median of its observed
ratios), and the projection decided on adds the caution of the wait (``compute_factor *
compute_wait + seat_factor * seat_wait`` over its typical) and of the own prefill
(``own_factor * own`` over its typical) as independent errors add, root-sum-square: the two
err apart, and taking both at their 99th percentile at once refused requests whose first token
would have come at a third of the budget. A
request that waits for nothing is not made to look longer than its own prefill's error allows,
and a burst's long queue is not trusted further than the queue's error. The learned factors
only know requests that have finished waiting; when the requests waiting now have already
overrun their predicted waits by more (the queue runs late now), that overrun is the wait's
factor. Until enough requests have taught a factor, it is a cautious prior: 1.5 on the compute
ahead, 2 on a seat.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import attrs

__all__ = ["WAIT_BANDS", "Ratios", "SafetyMargin", "WaitFactors"]


@attrs.define
class Ratios:
    """A window of recent ``observed / predicted`` ratios and its high quantile.

    Attributes:
        prior: the factor before ``min_samples`` ratios are held.
        least: the factor never goes below this.
        quantile: the quantile used as the factor.
        window: how many recent ratios are kept.
        min_samples: below this many, the factor is ``prior``.
    """

    prior: float
    least: float = 1.0
    quantile: float = 0.99
    window: int = 512
    min_samples: int = 32
    _recent: deque[float] = attrs.field(init=False, factory=deque)
    _ordered: list[float] = attrs.field(init=False, factory=list)

    @property
    def factor(self) -> float:
        """The quantile of the ratios held (or the prior), at least ``least``."""
        ordered = self._ordered
        if len(ordered) < self.min_samples:
            return self.prior
        return max(self.least, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])

    @property
    def median(self) -> float:
        """The median of the ratios held (1.0 before ``min_samples``): the prediction's bias."""
        ordered = self._ordered
        if len(ordered) < self.min_samples:
            return 1.0
        return ordered[len(ordered) // 2]

    @property
    def samples(self) -> int:
        """How many ratios it holds."""
        return len(self._recent)

    def add(self, ratio: float) -> None:
        """Hold ``ratio``, forgetting the oldest once the window is full."""
        if len(self._recent) >= self.window:
            old = self._recent.popleft()
            del self._ordered[bisect.bisect_left(self._ordered, old)]
        self._recent.append(ratio)
        bisect.insort(self._ordered, ratio)


def _wait_ratios(prior: float = 2.0) -> Ratios:
    # No floor: waits that come in well under their prediction let more requests in.
    return Ratios(prior=prior, least=0.0)


WAIT_BANDS = (0.05, 0.2, 0.4, 0.6, 0.8)
"""Predicted waits are judged by the error of waits of about their length: these shares of
the budget start each band."""

_LADDER = 1.15  # a band not yet taught takes the factor of the band below it, times this


@attrs.define
class WaitFactors:
    """The wait's ratios in bands of predicted wait (:data:`WAIT_BANDS`), so that a long wait
    is judged by how long waits fare: queueing errors add up along a queue, and under a rising
    load the short waits that finish first would vouch for the long ones too soon.

    A band with fewer than ``min_samples`` ratios takes the factor of the nearest band below
    that has them, times 1.15 per band climbed (a ladder: admitting slightly longer waits, with
    caution, is how the band learns), at most the prior, or the prior when none has: shorter
    waits have the larger relative errors, so what they teach may lower a longer wait's
    caution, never raise it.
    """

    prior: float = 2.0
    bands: tuple[Ratios, ...] = attrs.field(
        default=attrs.Factory(
            lambda self: tuple(_wait_ratios(self.prior) for _ in WAIT_BANDS), takes_self=True
        )
    )
    all: Ratios = attrs.field(
        default=attrs.Factory(lambda self: _wait_ratios(self.prior), takes_self=True)
    )

    def band(self, wait_s: float, budget_s: float) -> int | None:
        """The band of a predicted wait (``None``: under the first, too short to judge)."""
        share = wait_s / budget_s if budget_s > 0 else 0.0
        index = None
        for number, start in enumerate(WAIT_BANDS):
            if share >= start:
                index = number
        return index

    def factor(self, wait_s: float, budget_s: float) -> float:
        """The factor for a predicted wait of ``wait_s`` under ``budget_s``."""
        index = self.band(wait_s, budget_s)
        if index is None:
            index = 0
        climbed = 0
        while index >= 0:
            ratios = self.bands[index]
            if ratios.samples >= ratios.min_samples:
                if not climbed:
                    return ratios.factor
                # Shorter waits have the larger relative errors: what they teach may make a
                # longer wait's caution less than the prior, never more.
                return min(self.prior, ratios.factor * _LADDER**climbed)
            index -= 1
            climbed += 1
        return self.prior

    def add(self, wait_s: float, budget_s: float, ratio: float) -> None:
        """A request predicted to wait ``wait_s`` waited ``ratio`` times that."""
        index = self.band(wait_s, budget_s)
        if index is not None:
            self.bands[index].add(ratio)
            self.all.add(ratio)


def _own_factors() -> WaitFactors:
    # Never under 1 (a prefill faster than predicted does not make a longer one safer), prior
    # 1.25, by band of predicted own prefill: what short prompts teach never raises a long
    # one's caution (a neighbour sharing its step adds at most a step's chunk, which doubles
    # a 0.1 s prefill and adds a quarter to a 1.4 s one).
    def ratios() -> Ratios:
        return Ratios(prior=1.25)

    return WaitFactors(1.25, tuple(ratios() for _ in WAIT_BANDS), ratios())


def _bias_ratios() -> Ratios:
    return Ratios(prior=1.0, least=0.0)


def _compute_waits() -> WaitFactors:
    # The prefills ahead are prompts of known sizes, predicted as the own prefill is (prior
    # 1.25); their errors add up along a queue, and partly cancel.
    return WaitFactors(prior=1.5)


@attrs.define
class SafetyMargin:
    """How much later than typical a first token may come: on the wait, and on the own prefill.

    Attributes:
        waits: ratios of observed to predicted wait, by band, from requests whose wait was
            for the prefill compute ahead (a seat's share of it at most ``compute_share``).
        seats: the same, from requests whose wait was mostly for a seat (its share at least
            ``seat_share``): the seat's ratio, the compute ahead taken as predicted.
        every: every wait's ratio: their median is the wait's bias.
        own: ratios of observed to predicted own prefill, from long prompts that hardly waited,
            by band of predicted own prefill (a band not yet taught climbs from the one below,
            never above the prior, as the waits' bands do).
        own_bias: the same ratios from every request that hardly waited, whatever its size:
            their median corrects the typical own prefill.
        floor_share: a predicted wait (or own prefill) under this share of the budget does not
            teach its factor: short times have the largest relative error (a prompt that shares
            its step with an unforeseen neighbour takes twice its 30 ms) and it does not matter
            there (twice 30 ms is still far inside a 2 s budget).
        own_only_share: a request teaches the own-prefill ratios only when its predicted wait
            was under this share of its own prefill (its TTFT was its prefill's).
    """

    waits: WaitFactors = attrs.field(factory=_compute_waits)
    seats: WaitFactors = attrs.field(factory=WaitFactors)  # prior 2
    every: Ratios = attrs.field(factory=_wait_ratios)
    own: WaitFactors = attrs.field(factory=_own_factors)
    own_bias: Ratios = attrs.field(factory=_bias_ratios)
    floor_share: float = 0.05
    own_only_share: float = 0.25
    compute_share: float = 0.1
    seat_share: float = 0.5

    @property
    def wait(self) -> Ratios:
        """Every wait's ratio, whatever its band and part: their median is the wait's bias,
        their high quantile ``narwhal_admission_safety_factor``."""
        return self.every

    @property
    def factor(self) -> float:
        """The factor on every wait together (``narwhal_admission_safety_factor``)."""
        return self.every.factor

    @property
    def samples(self) -> int:
        """How many requests taught the wait factors."""
        return self.every.samples

    def typical(
        self, wait_s: float, own_prefill_s: float, seat_s: float = 0.0
    ) -> tuple[float, float]:
        """The wait and own prefill as typically observed: the predictions, corrected by the
        median of their observed ratios (their learned bias).

        Once both parts of the wait have taught their ratios, each is corrected by its own:
        the compute ahead (``wait_s - seat_s``) by the compute waits' median, the seat
        (``seat_s``) by the seat waits'. They err apart (on the wrong prior's benchmark at 1x
        to 3x, seat waits ran 0.21 to 0.33 s shorter than planned while compute waits were
        about right), and one median for every wait would carry one part's bias into the
        other. Until then, every wait's median corrects the whole wait.
        """
        own = own_prefill_s * self.own_bias.median
        compute, seat = self.waits.all, self.seats.all
        if compute.samples < compute.min_samples or seat.samples < seat.min_samples:
            return wait_s * self.every.median, own
        seat_s = min(max(0.0, seat_s), wait_s)
        return (wait_s - seat_s) * compute.median + seat_s * seat.median, own

    def caution_s(
        self,
        wait_s: float,
        own_prefill_s: float,
        overrun: float = 0.0,
        *,
        budget_s: float = 2.0,
        seat_s: float = 0.0,
    ) -> float:
        """What the projection adds to the typical first token (seconds, never negative).

        Args:
            wait_s: the predicted wait.
            own_prefill_s: the predicted own prefill.
            overrun: how far the requests waiting now have already overrun their own
                predicted waits (the largest ratio of time waited so far to predicted wait): a
                lower bound on the wait's error now, which the learned factor, taught by
                requests that have finished waiting, only shows later.
            budget_s: the budget (each part's band is a share of it).
            seat_s: the part of ``wait_s`` that is for a seat.
        """
        typical_wait, typical_own = self.typical(wait_s, own_prefill_s, seat_s)
        seat_s = min(max(0.0, seat_s), wait_s)
        compute_s = wait_s - seat_s
        cautious = self.waits.factor(compute_s, budget_s) * compute_s
        if seat_s > 0:
            cautious += self.seats.factor(seat_s, budget_s) * seat_s
        wait = max(0.0, max(cautious, overrun * wait_s) - typical_wait)
        own_factor = self.own.factor(own_prefill_s, budget_s)
        own = max(0.0, own_factor * own_prefill_s - typical_own)
        # The wait's error and the own prefill's are apart (a queue's, and a step's neighbour):
        # both at their 99th percentile at once is far rarer than either, so their cautions
        # add as independent errors do, root-sum-square, not as a sum.
        return math.hypot(wait, own)

    def observe(
        self,
        fixed_s: float,
        wait_s: float,
        own_prefill_s: float,
        observed_s: float,
        *,
        budget_s: float,
        seat_s: float = 0.0,
    ) -> None:
        """An admitted request saw its first token at ``observed_s`` from arrival, where
        ``wait_s`` waiting (``seat_s`` of it for a seat) and ``own_prefill_s`` of its own
        prefill were predicted, after ``fixed_s`` (the time in the router and the overhead,
        which do not wait)."""
        floor = self.floor_share * budget_s
        if wait_s >= floor:
            # What the wait really was, taking the parts that do not wait as predicted.
            waited = observed_s - fixed_s - own_prefill_s
            self.every.add(waited / wait_s)
            seat_s = min(max(0.0, seat_s), wait_s)
            if seat_s <= self.compute_share * wait_s:
                self.waits.add(wait_s, budget_s, waited / wait_s)
            elif seat_s >= self.seat_share * wait_s:
                # The compute ahead taken as predicted: the rest of the error is the seat's.
                self.seats.add(seat_s, budget_s, (waited - (wait_s - seat_s)) / seat_s)
        elif own_prefill_s > 0 and wait_s < self.own_only_share * own_prefill_s:
            ratio = (observed_s - fixed_s - wait_s) / own_prefill_s
            self.own_bias.add(ratio)
            if own_prefill_s >= floor:
                self.own.add(own_prefill_s, budget_s, ratio)
