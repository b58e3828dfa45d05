"""Prompts and the engines' context length (pure).

An engine refuses a prompt longer than its context (vLLM: a 400 naming ``max_model_len``,
answered before any prefill, under any load). Narwhal knows each engine's context length from
its model object (:attr:`~narwhal.scheduling.engines.Engine.max_model_len`; unknown until a
poll has read it, and then the prompt is taken to fit). Two rules follow (docs: Admission):

* a prompt is placed only on an engine whose context holds it, when one is eligible;
* a prompt longer than the context of every eligible engine that could serve it is the
  engine's to refuse, with its own 400: it is not refused by predictive admission, does not
  wait in the queue, and goes at once to the eligible engine with the longest context. Sizing
  may be an estimate, so the engine may serve it after all; its place there is sized at that
  engine's context length, the most it can prefill.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from narwhal.scheduling.engines import Engine

__all__ = ["Candidates", "beyond_context", "fits", "placed_size", "too_short"]


def fits(engine: Engine, tokens: int) -> bool:
    """Whether ``engine``'s context holds a prompt of ``tokens`` (an unknown context does)."""
    limit = engine.max_model_len
    return limit is None or tokens <= limit


def too_short(engines: Iterable[Engine], tokens: int) -> list[Engine]:
    """The engines whose context is known to be shorter than ``tokens``."""
    return [engine for engine in engines if not fits(engine, tokens)]


def beyond_context(engines: Iterable[Engine], tokens: int, need_token_ids: bool) -> Engine | None:
    """Where a prompt longer than every context goes, or ``None`` when it fits one.

    The candidates are the eligible engines (that provide token IDs, if the request needs
    them). ``None`` too when there is no candidate: that is the caller's 503.
    """
    return Candidates(engines).beyond(tokens, need_token_ids)


class Candidates:
    """The eligible engines a prompt may go to (all, or those that provide token IDs), and the
    longest context among them, taken once for a pass over many prompts: the dispatcher asks
    :meth:`beyond` for every waiting request, which then costs a comparison, not a look at
    every engine."""

    __slots__ = ("_by_need",)

    def __init__(self, engines: Iterable[Engine]) -> None:
        eligible = [engine for engine in engines if engine.eligible]
        with_ids = [engine for engine in eligible if engine.provides_token_ids]
        self._by_need = {
            False: (eligible, _longest(eligible)),
            True: (with_ids, _longest(with_ids)),
        }

    def any(self, need_token_ids: bool) -> bool:
        """Whether some engine could serve such a request."""
        return bool(self._by_need[need_token_ids][0])

    def beyond(self, tokens: int, need_token_ids: bool) -> Engine | None:
        """:func:`beyond_context` for one prompt."""
        candidates, longest = self._by_need[need_token_ids]
        if not candidates or tokens <= longest:
            return None
        # The longest context is the likeliest to serve it if the size was overestimated; then
        # the engine with room, then the least occupied.
        return max(
            candidates,
            key=lambda engine: (
                engine.max_model_len or 0,
                engine.can_place,
                -(engine.prefill + engine.decode),
            ),
        )


def _longest(engines: list[Engine]) -> float:
    """The longest context among ``engines`` (``inf`` when one is unknown: it fits anything)."""
    longest = 0.0
    for engine in engines:
        limit = engine.max_model_len
        if limit is None:
            return math.inf
        longest = max(longest, limit)
    return longest


def placed_size(engine: Engine, tokens: int) -> int:
    """A prompt's size for placement on ``engine``: at most its context (all it can prefill)."""
    limit = engine.max_model_len
    return tokens if limit is None else min(tokens, limit)
