"""Output lengths, learned (pure): how long will a request keep its decode slot?

A request's decode slot is free again when its output ends. Admission needs that time for the
requests already running (when every decode slot is taken, a newcomer waits for the first to
end), so Narwhal learns output lengths per route and ``max_tokens`` bucket from the validated
token counts of completed requests, keeps the recent ones, and answers with a quantile of the
lengths still possible: a request that has already produced ``g`` tokens is expected to stop at
a length above ``g`` (decode correction), not at the unconditional median.

Within a bucket, lengths are also learned per **prompt band** (quarter octaves of the sized
prompt: 1,024 to 1,279 tokens, 1,280 to 1,535, ...), and a band that holds at least
:data:`BAND_LEAST` completions answers for its prompts instead of the whole bucket. Traffic
from templates and applications often ties the answer's length to the prompt's: in the Azure
conversation trace, prompts of 1,024 to 1,279 tokens answer with 374 to 491 tokens (10th to
90th percentile) where the whole trace spans 54 to 424, and the mean error of a band's median
is a third of the whole trace's (42 tokens against 131). Where prompts say nothing of the
answer (the Azure code trace), a band's distribution is the bucket's, only noisier until it
fills.

A single conservative figure per request is the wrong answer to "when does the next decode slot
free up?": with a hundred requests running, the first of them ends long before any one of them
is expected to. :meth:`OutputLengths.remaining` therefore gives each running request's whole
conditional distribution, as the bounds of :data:`SEGMENTS` equal shares of it, and the
projection adds them up into the expected number of slots freed by each time
(:mod:`narwhal.admission.predictor`).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import deque
from collections.abc import Iterable, Sequence

import attrs

__all__ = [
    "BAND_LEAST",
    "SEGMENTS",
    "Census",
    "Key",
    "Keys",
    "OutputLengths",
    "Remaining",
    "prompt_band",
    "request_keys",
]

_WINDOW = 512
_PRIOR_TOKENS = 256
_PRIOR_SAMPLES = 64  # a bucket's prior: pseudo-completions, kept past the longest output seen
_PRIOR_LEAST = 8  # ... fewer as real completions arrive, down to this many
_PRIOR_SHORTEST = 16
_PRIOR_LONGEST = 4096  # the prior's longest output when requests set no max_tokens
SEGMENTS = 8
""":meth:`OutputLengths.remaining` splits each distribution into this many equal shares."""

BAND_LEAST = 32
"""Completions a prompt band needs before it answers for its prompts instead of its bucket."""

_WHOLE = -1  # the band of a bucket's every prompt

Key = tuple[str, int, int]
"""A distribution's key: route, ``max_tokens`` bucket, prompt band (or ``_WHOLE``)."""


@functools.cache
def _bucket(route: str, max_tokens: int | None) -> tuple[str, int]:
    if max_tokens is None:
        return route, 0
    return route, max(1, max_tokens).bit_length()


@functools.cache
def prompt_band(tokens: int) -> int:
    """The prompt band of a ``tokens``-token prompt: quarter octaves (4 per doubling; a
    prompt under 4 tokens counts as 4)."""
    tokens = max(tokens, 4)
    bits = tokens.bit_length()
    return bits * 4 + ((tokens >> (bits - 3)) & 3)


Keys = tuple[Key, Key | None]
"""The distributions a request counts in: its bucket's and its prompt band's (``None``: the
prompt's size is not known)."""


def request_keys(route: str, max_tokens: int | None, prompt_tokens: int | None) -> Keys:
    """The distributions a request counts in (:data:`Keys`): fixed for its life, so a running
    request's are worked out once, not at every census."""
    route, bits = _bucket(route, max_tokens)
    band = None if prompt_tokens is None else (route, bits, prompt_band(prompt_tokens))
    return (route, bits, _WHOLE), band


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
        prior: whether each bucket's distribution holds the prior's pseudo-completions past
            the longest output seen (see :func:`_with_prior`).
    """

    quantile: float = 0.75
    prior: bool = True
    _by_bucket: dict[Key, _Lengths] = attrs.field(factory=dict)

    def learn(
        self, route: str, max_tokens: int | None, tokens: int, prompt_tokens: int | None = None
    ) -> None:
        """A request of this route and ``max_tokens`` (and a ``prompt_tokens``-token prompt,
        as it was sized) produced ``tokens`` tokens."""
        keys = [(*_bucket(route, max_tokens), _WHOLE)]
        if prompt_tokens is not None:
            keys.append((*_bucket(route, max_tokens), prompt_band(prompt_tokens)))
        for key in keys:
            lengths = self._by_bucket.get(key)
            if lengths is None:
                lengths = self._by_bucket[key] = _Lengths()
            lengths.add(tokens)

    def key(self, route: str, max_tokens: int | None, prompt_tokens: int | None = None) -> Key:
        """The distribution that answers for such a request: its prompt band's once the band
        holds :data:`BAND_LEAST` completions, else its bucket's."""
        return self.resolve(request_keys(route, max_tokens, prompt_tokens))

    def resolve(self, keys: Keys) -> Key:
        """:meth:`key` for a request's :func:`request_keys`."""
        whole, band = keys
        if band is not None:
            lengths = self._by_bucket.get(band)
            if lengths is not None and len(lengths.ordered) >= BAND_LEAST:
                return band
        return whole

    def expected_total(
        self,
        route: str,
        max_tokens: int | None,
        generated: int = 0,
        prompt_tokens: int | None = None,
    ) -> float:
        """The output length to expect, given ``generated`` tokens so far."""
        cap = max_tokens if max_tokens is not None else None
        lengths = self._by_bucket.get(self.key(route, max_tokens, prompt_tokens))
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

    def remaining(
        self,
        route: str,
        max_tokens: int | None,
        generated: int = 0,
        prompt_tokens: int | None = None,
    ) -> Remaining:
        """The tokens still to come for one request, given ``generated`` so far.

        Learned from the completed requests alone; :meth:`census` also counts the running ones.
        """
        return self.census(()).remaining(route, max_tokens, generated, prompt_tokens)

    def census(self, running: Iterable[tuple[str, int | None, int, int | None]]) -> Census:
        """The distributions, completed by the requests running now (see :class:`Census`).

        Args:
            running: ``(route, max_tokens, generated, prompt_tokens)`` of each running request
                (``prompt_tokens`` ``None``: unknown, its bucket's).
        """
        return Census(
            self,
            (
                (request_keys(route, max_tokens, prompt_tokens), generated)
                for route, max_tokens, generated, prompt_tokens in running
            ),
        )

    def completed(self, key: Key) -> Sequence[int]:
        """The distribution's recent completed lengths, ascending."""
        lengths = self._by_bucket.get(key)
        return lengths.ordered if lengths is not None else ()


class Census:
    """The output-length distributions, with the running requests counted in.

    The window holds *completed* requests, and under a sudden load the long ones have not
    completed yet: learned from completions alone, lengths come out short, and the projection
    frees decode slots too early. Each running request is evidence too: its length is more than
    what it has generated so far. The Kaplan-Meier estimator takes both, completed lengths as
    observed and running requests as censored at their current length, per bucket, when a
    projection first asks for it.
    """

    def __init__(self, lengths: OutputLengths, running: Iterable[tuple[Keys, int]]) -> None:
        """``running``: each running request's :func:`request_keys` and count generated."""
        self._lengths = lengths
        # Each running request counts in its bucket's distribution and in its band's.
        self._running: dict[Key, list[int]] = {}
        for (whole, band), generated in running:
            self._running.setdefault(whole, []).append(generated)
            if band is not None:
                self._running.setdefault(band, []).append(generated)
        self._distributions: dict[Key, _Distribution] = {}
        self._answers: dict[tuple[Key, int | None, int], Remaining] = {}

    def remaining(
        self,
        route: str,
        max_tokens: int | None,
        generated: int = 0,
        prompt_tokens: int | None = None,
    ) -> Remaining:
        """The tokens still to come for a request that has generated ``generated`` (of a
        ``prompt_tokens``-token prompt: its band's distribution, once the band has learned)."""
        return self.remaining_of(
            request_keys(route, max_tokens, prompt_tokens), max_tokens, generated
        )

    def remaining_of(self, keys: Keys, max_tokens: int | None, generated: int) -> Remaining:
        """:meth:`remaining` for a request's :func:`request_keys`."""
        key = self._lengths.resolve(keys)
        asked = (key, max_tokens, generated)
        known = self._answers.get(asked)  # running requests often stand at the same count
        if known is None:
            known = self._answers[asked] = self._remaining(key, max_tokens, generated)
        return known

    def _remaining(self, key: Key, max_tokens: int | None, generated: int) -> Remaining:
        distribution = self._distributions.get(key)
        if distribution is None:
            completed = self._lengths.completed(key)
            running = self._running.get(key, [])
            horizon = max(completed[-1] if completed else 0, max(running, default=0))
            if self._lengths.prior:
                # A band's prior weighs as its bucket's does: what the bucket has learned
                # of how far outputs go holds for the band.
                known = len(self._lengths.completed((key[0], key[1], _WHOLE)))
                completed = _with_prior(completed, key, horizon, known)
            distribution = _Distribution(completed, running)
            self._distributions[key] = distribution
        cap = math.inf if max_tokens is None else float(max_tokens)
        if not distribution.lengths:
            prior = min(float(max(_PRIOR_TOKENS, generated + 1)), max(cap, generated + 1.0))
            return Remaining(distribution, generated, cap, prior - generated)
        return Remaining(distribution, generated, cap)


def _with_prior(
    completed: Sequence[int], key: Key, horizon: int, known: int | None = None
) -> Sequence[int]:
    """A bucket's completed lengths, with its prior's pseudo-completions beyond what is known.

    The first requests to complete are the short ones, and a request still running has only
    shown that it runs longer than what it has generated: no data says how far past the
    longest output seen so far (``horizon``, completed or generated) outputs go. Without a
    prior, every running request near that horizon would be expected to end at once, and
    the seats they hold to free long before they do. So the bucket also holds the
    pseudo-completions of a prior, spread log-uniformly from 16 tokens to the bucket's
    largest ``max_tokens`` (4,096 without one), but only those past the horizon: outputs may
    be long until shown otherwise, and a pseudo-completion drops out once a real output has
    run past it. There are 64 of them in an empty bucket, fewer as real completions arrive,
    and 8 from a whole window of them on: a long tail stays possible, with a small weight.
    """
    bits = key[1]
    longest = (1 << bits) - 1 if bits else _PRIOR_LONGEST
    if longest <= max(horizon, _PRIOR_SHORTEST):
        return completed
    known = len(completed) if known is None else known
    share = max(_PRIOR_LEAST, round(_PRIOR_SAMPLES * (1.0 - known / _WINDOW)))
    # In proportion to the distribution's own completions when the bucket knows more.
    count = max(1, round(share * max(len(completed), 1) / max(known, len(completed), 1)))
    ratio = longest / _PRIOR_SHORTEST
    prior = [
        length
        for i in range(count)
        if (length := round(_PRIOR_SHORTEST * ratio ** ((i + 0.5) / count))) > horizon
    ]
    return sorted([*completed, *prior]) if prior else completed


class _Distribution:
    """One bucket's Kaplan-Meier survival curve: ``P(length > lengths[i]) = -drops[i]``."""

    __slots__ = ("drops", "lengths", "tail")

    def __init__(self, completed: Sequence[int], running: list[int]) -> None:
        running = sorted(running)
        self.lengths: list[int] = []
        self.drops: list[float] = []  # minus the survival, so that it ascends (for bisect)
        survival = 1.0
        index = 0
        while index < len(completed):
            length = completed[index]
            ended = bisect.bisect_right(completed, length, lo=index) - index
            at_risk = len(completed) - index + len(running) - bisect.bisect_left(running, length)
            survival *= 1.0 - ended / at_risk
            self.lengths.append(length)
            self.drops.append(-survival)
            index += ended
        longest = max(completed[-1] if completed else 0, running[-1] + 1 if running else 0)
        self.tail = longest * 1.25  # past everything seen: a quarter more than the longest

    def survival(self, generated: int) -> float:
        """``P(length > generated)``."""
        index = bisect.bisect_right(self.lengths, generated) - 1
        return -self.drops[index] if index >= 0 else 1.0


class Remaining:
    """One request's remaining output as a distribution, in :data:`SEGMENTS` equal shares.

    :meth:`bound` ``(j)`` is the quantile ``j / SEGMENTS`` of the lengths still possible, less
    what was generated: each share between two consecutive bounds holds an equal part of the
    probability. Without data every bound is the prior. Bounds are computed when asked for:
    the projection rarely needs more than the first few of each running request.
    """

    __slots__ = (
        "_bounds",
        "_cap",
        "_distribution",
        "_fixed",
        "_generated",
        "_mean",
        "_start",
        "_survival",
    )

    def __init__(
        self,
        distribution: _Distribution,
        generated: int,
        cap: float,
        fixed: float | None = None,
    ) -> None:
        self._distribution = distribution
        self._generated = generated
        self._cap = cap
        self._fixed = fixed  # every bound, when nothing is learned
        self._start = start = bisect.bisect_right(distribution.lengths, generated)
        self._survival = -distribution.drops[start - 1] if start else 1.0
        self._mean: float | None = None
        # The bounds asked for so far: a census hands one object to every running request
        # that stands at the same count, and the plan's sweep asks each of them in turn.
        self._bounds: list[float | None] = [None] * (SEGMENTS + 1)

    def bound(self, share: int) -> float:
        """Remaining tokens at the quantile ``share / SEGMENTS`` (at least one)."""
        known = self._bounds[share]
        if known is None:
            known = self._bounds[share] = self._bound(share)
        return known

    def _bound(self, share: int) -> float:
        if self._fixed is not None:
            return self._fixed
        distribution = self._distribution
        if share == 0:  # the shortest length still possible
            index = self._start
        else:
            left = self._survival * (1.0 - share / SEGMENTS)
            index = bisect.bisect_left(distribution.drops, -left - 1e-12, lo=self._start)
        if index < len(distribution.lengths):
            length = float(distribution.lengths[index])
        else:
            length = distribution.tail
            if length < self._generated * 1.25 + 1:
                length = self._generated * 1.25 + 1
        if length > self._cap:
            length = self._cap
        left_tokens = length - self._generated
        return left_tokens if left_tokens > 1.0 else 1.0

    def bounds(self) -> list[float]:
        """Every bound, ``0`` to ``SEGMENTS``."""
        return [self.bound(share) for share in range(SEGMENTS + 1)]

    def mean_bound(self) -> float:
        """The mean of :meth:`bounds` (computed once: a census hands out one object per
        route, ``max_tokens`` and count generated)."""
        if self._mean is None:
            bounds = self.bounds()
            self._mean = sum(bounds) / len(bounds)
        return self._mean
