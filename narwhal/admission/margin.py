"""The safety margin of predictive admission, learned, and put where the uncertainty is (pure).

The projection (:mod:`narwhal.admission.predictor`) aims at the typical first token: half of
the requests see theirs later than projected. Admitting every request whose projection fits the
budget would therefore, under overload, fill the queue up to the budget's edge and let half of
what it admits miss. Predictive admission adds caution, but not to the whole projection: its
parts are not equally uncertain.

* **The wait** (for a seat, for the prefills ahead) is the uncertain part: it depends on how long
  the running requests go on and on what the requests ahead really cost. Its caution is a high
  quantile (the 99th percentile by default) of ``observed wait / predicted wait`` over recent
  admitted requests whose predicted wait was a real share of the budget, where the observed wait
  is the observed TTFT less the parts that do not wait.
* **The request's own prefill** is known from its size and the engine's learned speed. Its
  caution is the same quantile of ``observed / predicted`` prefill, learned from requests that
  hardly waited, so that a long prompt on an idle engine is judged by how well the model
  predicts long prompts, not by how long queues run.

The projection decided on is ``typical + (wait_factor - 1) * wait + (own_factor - 1) * own``.
A request that waits for nothing is not made to look longer than its own prefill's error
allows, and a burst's long queue is not trusted further than the queue's error.
Until enough requests have taught a factor, it is a cautious prior.
"""

from __future__ import annotations

import bisect
from collections import deque

import attrs

__all__ = ["Ratios", "SafetyMargin"]


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


def _wait_ratios() -> Ratios:
    return Ratios(prior=2.0)


def _own_ratios() -> Ratios:
    return Ratios(prior=1.25)


@attrs.define
class SafetyMargin:
    """How much later than typical a first token may come: on the wait, and on the own prefill.

    Attributes:
        wait: ratios of observed to predicted wait.
        own: ratios of observed to predicted own prefill.
        floor_share: a predicted wait (or own prefill) under this share of the budget does not
            teach its factor: short times have the largest relative error (a prompt that shares
            its step with an unforeseen neighbour takes twice its 30 ms) and it does not matter
            there (twice 30 ms is still far inside a 2 s budget).
        own_only_share: a request teaches the own-prefill factor only when its predicted wait
            was under this share of its own prefill (its TTFT was its prefill's).
    """

    wait: Ratios = attrs.field(factory=_wait_ratios)
    own: Ratios = attrs.field(factory=_own_ratios)
    floor_share: float = 0.05
    own_only_share: float = 0.25

    @property
    def factor(self) -> float:
        """The factor on the predicted wait (``narwhal_admission_safety_factor``)."""
        return self.wait.factor

    @property
    def samples(self) -> int:
        """How many requests taught the wait factor."""
        return self.wait.samples

    def caution_s(self, wait_s: float, own_prefill_s: float) -> float:
        """What the projection adds to the typical first token (seconds, never negative)."""
        wait = max(0.0, self.wait.factor - 1.0) * max(0.0, wait_s)
        own = max(0.0, self.own.factor - 1.0) * max(0.0, own_prefill_s)
        return wait + own

    def observe(
        self,
        typical_s: float,
        wait_s: float,
        own_prefill_s: float,
        observed_s: float,
        *,
        budget_s: float,
    ) -> None:
        """An admitted request projected at ``typical_s`` (of which ``wait_s`` waiting and
        ``own_prefill_s`` its own prefill) saw its first token at ``observed_s``."""
        floor = self.floor_share * budget_s
        fixed = typical_s - wait_s - own_prefill_s  # in the router, front end, overhead
        if wait_s >= floor:
            # What the wait really was, taking the parts that do not wait as predicted.
            self.wait.add((observed_s - fixed - own_prefill_s) / wait_s)
        elif own_prefill_s >= floor and wait_s < self.own_only_share * own_prefill_s:
            self.own.add((observed_s - fixed - wait_s) / own_prefill_s)
