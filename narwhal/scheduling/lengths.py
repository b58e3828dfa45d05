"""Output lengths, learned (pure): how long will a request keep its decode slot?

A request's decode slot is free again when its output ends. Admission needs that time for the
requests already running (when every decode slot is taken, a newcomer waits for the first to
end), so Narwhal learns output lengths per route and ``max_tokens`` bucket from the validated
token counts of completed requests, keeps the recent ones, and answers with a quantile of the
lengths still possible: a request that has already produced ``g`` tokens is expected to stop at
a length above ``g`` (decode correction), not at the unconditional median.

A single conservative figure per request is the wrong answer to "when does the next decode slot
free up?": with a hundred requests running, the first of them ends long before any one of them
is expected to. :meth:`OutputLengths.remaining` therefore gives each running request's whole
conditional distribution, as the bounds of :data:`SEGMENTS` equal shares of it, and the
projection adds them up into the expected number of slots freed by each time
(:mod:`narwhal.admission.predictor`).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

import attrs

__all__ = ["SEGMENTS", "OutputLengths", "Remaining"]

_WINDOW = 512
_PRIOR_TOKENS = 256
SEGMENTS = 8
""":meth:`OutputLengths.remaining` splits each distribution into this many equal shares."""


def _bucket(route: str, max_tokens: int | None) -> tuple[str, int]:
    if max_tokens is None:
        return route, 0
    return route, max(1, max_tokens).bit_length()


@attrs.define
class _Lengths:
    recent: deque[int] = attrs.field(factory=lambda: deque(maxlen=_WINDOW))
    ordered: list[int] = attrs.field(factory=list)

    def add(self, tokens: int) -> None:
        if len(self.recent) == self.recent.maxlen:
            old = self.recent[0]
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        self.recent.append(tokens)
        bisect.insort(self.ordered, tokens)


@attrs.define
class OutputLengths:
    """The learned output-length distributions.

    Attributes:
        quantile: which quantile of the possible lengths to expect (conservative above 0.5).
    """

    quantile: float = 0.75
    _by_bucket: dict[tuple[str, int], _Lengths] = attrs.field(factory=dict)

    def learn(self, route: str, max_tokens: int | None, tokens: int) -> None:
        """A request of this route and ``max_tokens`` produced ``tokens`` tokens."""
        key = _bucket(route, max_tokens)
        lengths = self._by_bucket.get(key)
        if lengths is None:
            lengths = self._by_bucket[key] = _Lengths()
        lengths.add(tokens)

    def expected_total(self, route: str, max_tokens: int | None, generated: int = 0) -> float:
        """The output length to expect, given ``generated`` tokens so far."""
        cap = max_tokens if max_tokens is not None else None
        lengths = self._by_bucket.get(_bucket(route, max_tokens))
        if lengths is None or not lengths.ordered:
            guess = float(max(_PRIOR_TOKENS, generated + 1))
        else:
            ordered = lengths.ordered
            start = bisect.bisect_right(ordered, generated)
            if start >= len(ordered):
                guess = generated * 1.25 + 1  # longer than anything seen: a bit more
            else:
                index = start + int(self.quantile * (len(ordered) - 1 - start))
                guess = float(ordered[index])
        if cap is not None:
            guess = min(guess, float(cap))
        return max(guess, generated + 1.0)

    def remaining(self, route: str, max_tokens: int | None, generated: int = 0) -> Remaining:
        """The tokens still to come, given ``generated`` so far, as a distribution."""
        lengths = self._by_bucket.get(_bucket(route, max_tokens))
        ordered = lengths.ordered if lengths is not None else []
        start = bisect.bisect_right(ordered, generated)
        if start >= len(ordered):
            left = self.expected_total(route, max_tokens, generated) - generated
            return Remaining((), 0, 0, left, 0)
        cap = math.inf if max_tokens is None else float(max_tokens)
        return Remaining(ordered, start, len(ordered) - 1 - start, cap, generated)


class Remaining:
    """One request's remaining output as a distribution, in :data:`SEGMENTS` equal shares.

    :meth:`bound` ``(j)`` is the quantile ``j / SEGMENTS`` of the lengths still possible, less
    what was generated: each share between two consecutive bounds holds an equal part of the
    probability. Without data every bound is the prior. Bounds are computed when asked for:
    the projection rarely needs more than the first few of each running request.
    """

    __slots__ = ("_cap", "_generated", "_last", "_ordered", "_start")

    def __init__(
        self, ordered: Sequence[int], start: int, last: int, cap: float, generated: int
    ) -> None:
        self._ordered = ordered
        self._start = start
        self._last = last
        self._cap = cap  # with no data: the prior's remaining tokens
        self._generated = generated

    def bound(self, share: int) -> float:
        """Remaining tokens at the quantile ``share / SEGMENTS`` (at least one)."""
        if not self._ordered:
            return self._cap
        length = self._ordered[self._start + self._last * share // SEGMENTS]
        return max(1.0, min(float(length), self._cap) - self._generated)

    def bounds(self) -> list[float]:
        """Every bound, ``0`` to ``SEGMENTS``."""
        return [self.bound(share) for share in range(SEGMENTS + 1)]
