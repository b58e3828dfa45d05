"""The safety margin of predictive admission, learned (pure).

The projection (:mod:`narwhal.admission.predictor`) aims at the typical first token: half of
the requests see theirs later than projected. Admitting every request whose projection fits the
budget would therefore, under overload, fill the queue up to the budget's edge and let half of
what it admits miss. Predictive admission instead refuses when ``projection * factor`` exceeds
the budget, where ``factor`` is a high quantile (the 99th percentile by default) of
``observed / projected`` over the recent admitted requests: the error the projection actually
makes, measured, not assumed.

Only projections of at least a quarter of the budget teach it. Short waits are where the
relative error is largest (a prompt that shares its step with an unforeseen neighbour can take
twice its 30 ms), and where it does not matter: a factor of 2 on a 40 ms projection is still far
inside a 2 s budget. Until enough requests have taught it, the factor is a cautious prior.
"""

from __future__ import annotations

import bisect
from collections import deque

import attrs

__all__ = ["SafetyMargin"]


@attrs.define
class SafetyMargin:
    """``observed / projected`` TTFT of recent admitted requests, and the factor it gives.

    Attributes:
        quantile: the quantile of the ratio used as the factor.
        window: how many recent requests are kept.
        min_samples: below this many, the factor is ``prior``.
        prior: the factor before anything is learned.
        floor_share: projections under this share of the budget do not teach.
        least: the factor never goes below this: the error of the recent past is not a
            promise.
    """

    quantile: float = 0.99
    window: int = 512
    min_samples: int = 32
    prior: float = 2.0
    floor_share: float = 0.25
    least: float = 1.1
    _recent: deque[float] = attrs.field(init=False, factory=deque)
    _ordered: list[float] = attrs.field(init=False, factory=list)

    @property
    def factor(self) -> float:
        """What projections are multiplied by before they are compared with the budget."""
        ordered = self._ordered
        if len(ordered) < self.min_samples:
            return self.prior
        return max(self.least, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])

    def observe(self, projected_s: float, observed_s: float, budget_s: float) -> None:
        """An admitted request projected at ``projected_s`` saw its first at ``observed_s``."""
        if projected_s <= 0 or projected_s < self.floor_share * budget_s:
            return
        ratio = observed_s / projected_s
        if len(self._recent) >= self.window:
            old = self._recent.popleft()
            del self._ordered[bisect.bisect_left(self._ordered, old)]
        self._recent.append(ratio)
        bisect.insort(self._ordered, ratio)

    @property
    def samples(self) -> int:
        """How many requests it holds."""
        return len(self._recent)
