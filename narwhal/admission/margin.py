"""The safety margin of predictive admission, learned, and put where the uncertainty is (pure).

The projection (:mod:`narwhal.admission.predictor`) aims at the typical first token: half of
the requests see theirs later than projected. Admitting every request whose projection fits the
budget would therefore, under overload, fill the queue up to the budget's edge and let half of
what it admits miss. Predictive admission adds caution: how much later than predicted a first
token comes, learned in seconds, on the part that was uncertain.

* **The wait** is learned from requests that waited: ``observed wait - predicted wait``, where
  the observed wait is the observed TTFT less the parts that do not wait and the predicted own
  prefill, so the own prefill's error is inside it. It has two parts, which err apart: the wait
  for **the prefills ahead** is the compute of prompts of known sizes; the wait for **a seat**
  depends on how long the running requests' outputs go on, which nobody knows
  (:meth:`~narwhal.admission.plan.EnginePlan.seat_wait` splits them). Each part's caution is a
  high quantile (the 99th percentile by default) of those seconds over recent requests whose
  wait was mostly of that part and whose part was in the same band of the budget
  (:class:`Overruns`). The error is about the same number of seconds whatever the wait's
  length (on the wrong prior's benchmark its 99th percentile was 0.26 to 0.41 s for predicted
  waits from 0.1 to 1.6 s, while ``observed / predicted`` went from 3.2 to 1.35): a ratio,
  learned by a band's shortest waits, put 0.9 s of caution on a 0.35 s wait that needed 0.3 s.
* **The request's own prefill**, for a request that hardly waits (a long prompt on an idle
  engine), is learned from such requests alike, by band of predicted prefill: a prompt that
  shares its step with a neighbour arriving after it gets its first token up to a step later,
  about the same added time whatever its size. A request that waits carries no separate own
  caution: its wait's error already holds it.

The typical projection corrects each part by its learned bias (the median of its observed
ratios): the compute ahead and the wait for a seat each by its own, the own prefill of a
request that hardly waits by that of such requests (a waiting request's own prefill is taken
as predicted, as its wait's error was measured). The projection decided on adds to it the
cautions of the compute ahead, the seat and the own prefill, each how far its high quantile
lies beyond its typical, as independent errors add: root-sum-square. The learned
overruns only know requests that have finished waiting; when the requests waiting now have
already overrun their predicted waits by more (the queue runs late now), that overrun is the
wait's. Until enough requests have taught a band, the caution is a cautious prior: 1.5 times
the compute ahead, 2 times the wait for a seat, 1.25 times the own prefill. While what is
admitted meets the budget (at most one miss among the last 512 admitted requests), each part is
read at its 95th percentile rather than its 99th (:attr:`SafetyMargin.quantile`): the target
is 99 % in budget, and misses come in bursts, which bring the 99th back.

**While admission refuses** (it refused a request as over budget within the last budget, before
this instant: :meth:`SafetyMargin.overloaded`), the caution adds a quarter of the predicted
wait (:attr:`SafetyMargin.overload_share`). Requests keep arriving at the edge then, and the
engines stay busy whoever is admitted: a request with a long wait adds no work that those
arriving behind it would not bring, while it is the one an engine found slower late makes miss.
(On the code trace at half load, admitting one refused request pushed others out of their
budget, about 2.8 a refusal; on the bursty trace, whose refusals are a tick's tail with nobody
behind it before the queue drains, none: ``benchmarks/README.md``, "Nineteenth round".) A
tick's requests arrive in one instant and the first refusal of a tick does not tighten the
rest.

**While admission is not refusing**, each part is read at its median
(:attr:`SafetyMargin.quiet_quantile`): nobody waits at the edge behind a request then, so
admitting it risks its own budget only, and it is admitted when it is as likely to meet the
budget as not. A request decided with the rest of its instant (a tick's,
:mod:`narwhal.admission.instants`) knows every request that arrived with it: it is read at the
20th percentile (:attr:`SafetyMargin.tick_quantile`), which may lie under its typical (the
parts that come early there count against those that come late), and admitted when one in five
like it met the budget.

A wait partly for a seat, where no seat has taught its band (traffic whose waits are seldom
mostly for a seat), is judged whole by the compute ahead's bands once they know a wait that
long, not given the seat's prior on its seat part.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import attrs

__all__ = ["WAIT_BANDS", "Overruns", "Ratios", "SafetyMargin"]


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
        high = self.at(self.quantile)
        return self.prior if high is None else max(self.least, high)

    @property
    def high(self) -> float | None:
        """The quantile of the values held, whatever its sign (``None`` before
        ``min_samples``)."""
        return self.at(self.quantile)

    def at(self, quantile: float) -> float | None:
        """The ``quantile`` of the values held (``None`` before ``min_samples``)."""
        ordered = self._ordered
        if len(ordered) < self.min_samples:
            return None
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

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


def _bias_ratios() -> Ratios:
    # No floor: waits that come in well under their prediction let more requests in.
    return Ratios(prior=1.0, least=0.0)


WAIT_BANDS = (0.05, 0.2, 0.4, 0.6, 0.8)
"""A predicted wait (or own prefill) is judged by the errors of those of about its length: these
shares of the budget start each band."""

_LADDER = 1.05  # a band not yet taught: the nearest taught one's, plus 5 % of the wait a band


def _seconds() -> Ratios:
    return Ratios(prior=0.0, least=-math.inf)


@attrs.define
class Overruns:
    """How much later than predicted (seconds, at a high quantile) a part of the wait, or an
    own prefill, comes, by band of its predicted length (:data:`WAIT_BANDS`).

    Each band keeps the recent ``observed - predicted`` of its predictions, and its caution is
    their quantile (negative where they come in early even then): queueing errors under a
    rising load reach long waits last, so a band is judged by its own. A prediction under the
    first band takes that band's in proportion to its length. A band not yet taught takes the
    nearest taught one below plus 5 % of the prediction per band climbed (compounded:
    admitting slightly longer waits, with caution, is how the band learns), at most what the
    prior would add. Until a band up to it is taught, the prior: the prediction times
    ``prior``.

    Attributes:
        prior: the factor on the prediction until a band is taught.
        bands: the seconds late of recent predictions, one window per band.
    """

    prior: float
    bands: tuple[Ratios, ...] = attrs.field(factory=lambda: tuple(_seconds() for _ in WAIT_BANDS))

    @staticmethod
    def band(predicted_s: float, budget_s: float) -> int | None:
        """The band of a prediction (``None``: under the first)."""
        share = predicted_s / budget_s if budget_s > 0 else 0.0
        index = None
        for number, start in enumerate(WAIT_BANDS):
            if share >= start:
                index = number
        return index

    def over_s(
        self, predicted_s: float, budget_s: float, quantile: float | None = None
    ) -> float | None:
        """How much later than ``predicted_s`` it comes at the quantile (``None``: no band up
        to it is taught)."""
        index = self.band(predicted_s, budget_s)
        share = 1.0
        if index is None:
            index, start = 0, WAIT_BANDS[0] * budget_s
            share = min(1.0, predicted_s / start) if start > 0 else 1.0
        for climbed in range(index + 1):
            band = self.bands[index - climbed]
            high = band.high if quantile is None else band.at(quantile)
            if high is None:
                continue
            if not climbed:
                return high * share
            ladder = high + (_LADDER**climbed - 1.0) * predicted_s
            return min((self.prior - 1.0) * predicted_s, ladder)
        return None

    def taught(self, predicted_s: float, budget_s: float) -> bool:
        """Whether a band up to that of ``predicted_s`` is taught (its caution is learned, not
        the prior's)."""
        return self.over_s(predicted_s, budget_s) is not None

    def cautious_s(
        self, predicted_s: float, budget_s: float, quantile: float | None = None
    ) -> float:
        """The prediction as late as it comes at the quantile (the prior's until taught)."""
        if predicted_s <= 0:
            return 0.0
        over = self.over_s(predicted_s, budget_s, quantile)
        return self.prior * predicted_s if over is None else predicted_s + over

    def add(self, predicted_s: float, budget_s: float, observed_s: float) -> None:
        """A prediction of ``predicted_s`` came true in ``observed_s``."""
        index = self.band(predicted_s, budget_s)
        if index is not None:
            self.bands[index].add(observed_s - predicted_s)


def _apart(first: float, second: float, early: bool) -> float:
    """Two parts' deviations from their typical, added as independent errors do
    (root-sum-square): the late ones' beyond typical less, where ``early``, the early ones'
    under it (otherwise an early part counts as none)."""
    late = math.hypot(max(0.0, first), max(0.0, second))
    if not early:
        return late
    return late - math.hypot(min(0.0, first), min(0.0, second))


@attrs.define
class SafetyMargin:
    """How much later than typical a first token may come: on the wait, and on the own prefill.

    Attributes:
        compute_late: how late waits for the prefill compute ahead came (seconds, by band of
            predicted wait), from waits whose seat's share was at most ``compute_share``.
            Prior 1.5: prompts of known sizes, predicted as the own prefill is.
        seat_late: how late waits for a seat came (seconds, by band of the predicted seat
            wait), from waits mostly for a seat (its share at least ``seat_share``, and itself
            at least ``floor_share`` of the budget). Prior 2: a seat frees when running outputs
            end, which nobody knows.
        own: how late own prefills came (seconds, by band of predicted prefill), from long
            prompts that hardly waited. Prior 1.25.
        every: every wait's ``observed / predicted``: their median is the wait's bias until
            both parts below are taught, their high quantile
            ``narwhal_admission_safety_factor``.
        compute: the same ratio of waits that were for the prefill compute ahead (a seat's
            share of them at most ``compute_share``): their median is that part's bias.
        seats: the seat's ratio of waits that were mostly for a seat (its share at least
            ``seat_share``, and itself at least ``floor_share`` of the budget), the compute
            ahead taken as predicted: their median is the seat's bias.
        own_bias: ``observed / predicted`` own prefill of every request that hardly waited,
            whatever its size: their median corrects a non-waiting request's own prefill.
        floor_share: a predicted wait (or own prefill) under this share of the budget does not
            teach its band: short times have the largest relative error (a prompt that shares
            its step with an unforeseen neighbour takes twice its 30 ms) and it does not matter
            there.
        own_only_share: a request teaches the own prefill only when its predicted wait was
            under this share of its own prefill (its TTFT was its prefill's).
        calm_quantile: the quantile the parts' cautions are read at while at most
            ``calm_misses`` of the last ``outcomes`` admitted requests (and at least a quarter
            of that many seen) missed the budget; otherwise each window's own (the 99th).
        overload_share: the share of the predicted wait the caution adds while admission
            refuses (:meth:`overloaded`).
        quiet_quantile: the quantile the parts' cautions are read at while admission is not
            refusing (the median: a request is admitted when it is as likely to meet the
            budget as not; ``None``: as while it refuses).
        tick_quantile: the same for a request decided with the rest of its instant, a tick's
            (the 20th percentile: it knows every request that arrived with it, and a refusal
            of what would have met loses its work where a miss costs its own engine time;
            ``None``: as ``quiet_quantile``).
    """

    compute_late: Overruns = attrs.field(factory=lambda: Overruns(1.5))
    seat_late: Overruns = attrs.field(factory=lambda: Overruns(2.0))
    own: Overruns = attrs.field(factory=lambda: Overruns(1.25))
    every: Ratios = attrs.field(factory=lambda: Ratios(prior=2.0, least=0.0))
    compute: Ratios = attrs.field(factory=_bias_ratios)
    seats: Ratios = attrs.field(factory=_bias_ratios)
    own_bias: Ratios = attrs.field(factory=_bias_ratios)
    floor_share: float = 0.05
    own_only_share: float = 0.25
    compute_share: float = 0.1
    seat_share: float = 0.5
    calm_quantile: float = 0.95
    calm_misses: int = 1
    outcomes: int = 512
    overload_share: float = 0.25
    quiet_quantile: float | None = 0.5
    tick_quantile: float | None = 0.2
    _missed: deque[bool] = attrs.field(init=False, factory=deque)
    _misses: int = attrs.field(init=False, default=0)
    _refused_at: float = attrs.field(init=False, default=-math.inf)
    _refused_before: float = attrs.field(init=False, default=-math.inf)

    def refused(self, now: float) -> None:
        """Admission refused a request as over budget (or, in shadow mode, would have) at
        ``now``; a prompt over the budget alone says nothing of the load and is not told."""
        if now != self._refused_at:  # the last refusal of an earlier instant is kept too
            self._refused_before = self._refused_at
            self._refused_at = now

    def overloaded(self, now: float, budget_s: float) -> bool:
        """Whether admission is refusing: it refused a request within the last ``budget_s``,
        before ``now`` (one instant's arrivals, a tick, do not tighten each other, but a
        refusal of this instant does not hide one of an earlier instant)."""
        last = self._refused_at if self._refused_at < now else self._refused_before
        return now - budget_s < last < now

    @property
    def quantile(self) -> float | None:
        """The quantile each part's caution is read at: ``calm_quantile`` while at most
        ``calm_misses`` of the last ``outcomes`` admitted requests missed the budget (``None``:
        each window's own, the 99th percentile)."""
        if len(self._missed) >= self.outcomes // 4 and self._misses <= self.calm_misses:
            return self.calm_quantile
        return None

    def reading(self, overloaded: bool, company: bool = False) -> float | None:
        """The quantile the parts' cautions are read at: while admission is not refusing
        (``overloaded`` false), :attr:`tick_quantile` for a request decided with the rest of its
        instant (``company``), :attr:`quiet_quantile` for any other; :attr:`quantile` while it
        refuses (``None``: each window's own, the 99th percentile)."""
        if not overloaded:
            if company and self.tick_quantile is not None:
                return self.tick_quantile
            if self.quiet_quantile is not None:
                return self.quiet_quantile
        return self.quantile

    def caution_quantile(self, *, overloaded: bool = True) -> float:
        """The quantile the parts' cautions are read at (``narwhal_admission_caution_quantile``,
        with ``overloaded`` as :meth:`overloaded` says now): :meth:`reading`, else each band's
        own."""
        reading = self.reading(overloaded)
        return self.compute_late.bands[0].quantile if reading is None else reading

    @property
    def recent_misses(self) -> int:
        """How many of the last ``outcomes`` admitted requests missed the budget
        (``narwhal_admission_recent_misses``)."""
        return self._misses

    @property
    def wait(self) -> Ratios:
        """Every wait's ratio: their median is the wait's bias, their high quantile
        ``narwhal_admission_safety_factor``."""
        return self.every

    @property
    def factor(self) -> float:
        """The high quantile of every wait's ratio (``narwhal_admission_safety_factor``)."""
        return self.every.factor

    @property
    def samples(self) -> int:
        """How many requests taught the wait."""
        return self.every.samples

    def waits(self, wait_s: float, budget_s: float) -> bool:
        """Whether a predicted wait is long enough to teach the wait (and to carry the own
        prefill's error in its own)."""
        return wait_s >= self.floor_share * budget_s

    def typical(
        self, wait_s: float, own_prefill_s: float, seat_s: float = 0.0, *, budget_s: float = 2.0
    ) -> tuple[float, float]:
        """The wait and own prefill as typically observed: the predictions, corrected by the
        median of their observed ratios (their learned bias).

        Once both parts of the wait have taught their ratios, each is corrected by its own:
        the compute ahead (``wait_s - seat_s``) by the compute waits' median, the seat
        (``seat_s``) by the seat waits'. They err apart (on the wrong prior's benchmark at 1x
        to 3x, seat waits ran 0.21 to 0.33 s shorter than planned while compute waits were
        about right), and one median for every wait would carry one part's bias into the
        other. Until then, every wait's median corrects the whole wait. The own prefill is
        corrected only for a request that hardly waits, as those that taught its bias did: a
        waiting request's own prefill is inside its wait's error, which was measured with it
        taken as predicted (its bias applied there too counted a step's neighbour twice).
        """
        seat_s = min(max(0.0, seat_s), wait_s)
        compute, seat = self._typical_parts(wait_s - seat_s, seat_s)
        return compute + seat, self._typical_own(wait_s, own_prefill_s, budget_s)

    def _typical_own(self, wait_s: float, own_prefill_s: float, budget_s: float) -> float:
        """The own prefill, corrected by its bias only for a request that hardly waits."""
        if self.waits(wait_s, budget_s):
            return own_prefill_s
        return own_prefill_s * self.own_bias.median

    def _typical_parts(self, compute_s: float, seat_s: float) -> tuple[float, float]:
        """The compute ahead and the seat's wait, each corrected by its bias (both by every
        wait's until both parts are taught)."""
        compute, seat = self.compute, self.seats
        if compute.samples < compute.min_samples or seat.samples < seat.min_samples:
            every = self.every.median
            return compute_s * every, seat_s * every
        return compute_s * compute.median, seat_s * seat.median

    def caution_s(
        self,
        wait_s: float,
        own_prefill_s: float,
        overrun: float = 0.0,
        *,
        budget_s: float = 2.0,
        seat_s: float = 0.0,
        overloaded: bool = False,
        company: bool = False,
    ) -> float:
        """What the projection adds to the typical first token (seconds): never negative but
        for a tick's request read under the median (``company``, :attr:`tick_quantile`), whose
        parts that come early at that quantile count against those that come late.

        Args:
            wait_s: the predicted wait.
            own_prefill_s: the predicted own prefill.
            overrun: how far the requests waiting now have already overrun their own
                predicted waits (the largest ratio of time waited so far to predicted wait): a
                lower bound on the wait's error now, which the learned overruns, taught by
                requests that have finished waiting, only show later.
            budget_s: the budget (each band is a share of it).
            seat_s: the part of ``wait_s`` that is for a seat.
            overloaded: admission is refusing (:meth:`overloaded`): add ``overload_share`` of
                the predicted wait.
            company: the request is decided with the rest of its instant, a tick's
                (:mod:`narwhal.admission.instants`): read at :attr:`tick_quantile` while
                admission is not refusing.
        """
        seat_s = min(max(0.0, seat_s), wait_s)
        compute_s = wait_s - seat_s
        typical_compute, typical_seat = self._typical_parts(compute_s, seat_s)
        typical_wait = typical_compute + typical_seat
        # Each part of the wait as late as waits of its kind and length came, beyond its
        # typical; the two err apart (a prefill's speed and neighbours, outputs' lengths), so
        # their cautions add root-sum-square, as the wait's and the own prefill's do.
        quantile = self.reading(overloaded, company)
        seat_unknown = seat_s > 0 and not self.seat_late.taught(seat_s, budget_s)
        if seat_unknown and self.compute_late.taught(wait_s, budget_s):
            # No wait for a seat has taught its band (seats seldom hold this traffic's waits),
            # waits for the compute ahead have: the wait is judged as those were, whole.
            compute_s, typical_compute, seat_s, typical_seat = wait_s, typical_wait, 0.0, 0.0
        compute_over = self.compute_late.cautious_s(compute_s, budget_s, quantile) - typical_compute
        seat_over = self.seat_late.cautious_s(seat_s, budget_s, quantile) - typical_seat
        # Read under the median (quiet), a part may come earlier than typical: the caution
        # then goes under the typical first token. Otherwise it never does.
        early = quantile is not None and quantile < 0.5
        wait = max(_apart(compute_over, seat_over, early), overrun * wait_s - typical_wait)
        own = 0.0
        if not self.waits(wait_s, budget_s):
            cautious_own = self.own.cautious_s(own_prefill_s, budget_s, quantile)
            own = cautious_own - self._typical_own(wait_s, own_prefill_s, budget_s)
        # The wait's error and the own prefill's are apart (a queue's, and a step's neighbour):
        # both at their 99th percentile at once is far rarer than either, so their cautions
        # add as independent errors do, root-sum-square, not as a sum.
        caution = _apart(wait, own, early)
        if overloaded:
            caution += self.overload_share * wait_s
        return caution

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
        missed = observed_s > budget_s
        self._missed.append(missed)
        self._misses += missed
        if len(self._missed) > self.outcomes:
            self._misses -= self._missed.popleft()
        if self.waits(wait_s, budget_s):
            # What the wait really was, taking the parts that do not wait as predicted.
            waited = observed_s - fixed_s - own_prefill_s
            self.every.add(waited / wait_s)
            seat_s = min(max(0.0, seat_s), wait_s)
            if seat_s <= self.compute_share * wait_s:
                self.compute.add(waited / wait_s)
                self.compute_late.add(wait_s, budget_s, waited)
            elif seat_s >= self.seat_share * wait_s and self.waits(seat_s, budget_s):
                # The compute ahead taken as predicted: the rest of the error is the seat's.
                seated = waited - (wait_s - seat_s)
                self.seats.add(seated / seat_s)
                self.seat_late.add(seat_s, budget_s, seated)
        elif own_prefill_s > 0 and wait_s < self.own_only_share * own_prefill_s:
            took = observed_s - fixed_s - wait_s
            self.own_bias.add(took / own_prefill_s)
            if own_prefill_s >= self.floor_share * budget_s:
                self.own.add(own_prefill_s, budget_s, took)
