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

from collections.abc import Iterable

from narwhal.scheduling.engines import Engine

__all__ = ["beyond_context", "fits", "placed_size", "too_short"]


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
    candidates = [
        engine
        for engine in engines
        if engine.eligible and (engine.provides_token_ids or not need_token_ids)
    ]
    if not candidates or any(fits(engine, tokens) for engine in candidates):
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


def placed_size(engine: Engine, tokens: int) -> int:
    """A prompt's size for placement on ``engine``: at most its context (all it can prefill)."""
    limit = engine.max_model_len
    return tokens if limit is None else min(tokens, limit)
