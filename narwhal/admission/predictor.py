"""Predictive admission: project a request's time to first token before admitting it (pure).

The projection is what the request would see if admitted now: the time it already spent in the
router, plus the wait for the engines to finish the prefills ahead of it (those running and
those queued before it, placed first come, first served on the engine that would give each the
earliest first token), plus its own prefill there, plus ``frontend_overhead_s``. Each engine's
prefill pipeline is its :class:`~narwhal.scheduling.forecast.PrefillForecast`.

Two refusals follow (docs: Errors and refusals): when even the prompt alone, on the fastest
idle eligible engine, cannot meet the budget, waiting cannot help (429
``prompt_exceeds_ttft_budget``); when the projection is strictly over the budget, the client is
told when to come back (429 ``ttft_budget_exceeded`` with the overrun as ``Retry-After``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from narwhal.errors import PredictiveRefusal
from narwhal.scheduling.engines import Engine

__all__ = ["Projection", "check_budget", "project"]


@attrs.frozen
class Projection:
    """A projected time to first token, and its parts (seconds)."""

    ttft_s: float
    wait_s: float
    own_prefill_s: float
    prompt_alone_s: float
    engine: str


def project(
    engines: Iterable[Engine],
    ahead: Sequence[tuple[int, bool]],
    prompt_tokens: int,
    *,
    need_token_ids: bool,
    now: float,
    elapsed_s: float,
    overhead_s: float,
) -> Projection | None:
    """Project the TTFT of a request arriving now; ``None`` when no engine could serve it.

    Args:
        engines: the pool.
        ahead: ``(prompt_tokens, need_token_ids)`` of each queued request, in order.
        prompt_tokens: this request's prompt.
        need_token_ids: this request may only go to engines providing IDs.
        now: the Trio clock.
        elapsed_s: time this request already spent in the router.
        overhead_s: ``admission.frontend_overhead_s``.
    """
    eligible = [engine for engine in engines if engine.eligible]
    free = {engine: engine.forecast.free_at for engine in eligible}
    for tokens, needs_ids in ahead:
        choice = _earliest(eligible, free, tokens, needs_ids, now)
        if choice is not None:
            engine = choice[0]
            free[engine] = engine.forecast.pipeline_after(tokens, now, free[engine])
    choice = _earliest(eligible, free, prompt_tokens, need_token_ids, now)
    if choice is None:
        return None
    engine, first_token_at = choice
    start = max(now, free[engine])
    alone = min(
        e.forecast.standalone_s(prompt_tokens)
        for e in eligible
        if e.provides_token_ids or not need_token_ids
    )
    return Projection(
        ttft_s=elapsed_s + (first_token_at - now) + overhead_s,
        wait_s=start - now,
        own_prefill_s=first_token_at - start,
        prompt_alone_s=alone + overhead_s,
        engine=engine.name,
    )


def _earliest(
    engines: Sequence[Engine],
    free: dict[Engine, float],
    tokens: int,
    need_token_ids: bool,
    now: float,
) -> tuple[Engine, float] | None:
    best: tuple[Engine, float] | None = None
    for engine in engines:
        if need_token_ids and not engine.provides_token_ids:
            continue
        at = engine.forecast.predict(tokens, now, free[engine])
        if best is None or at < best[1]:
            best = (engine, at)
    return best


def check_budget(projection: Projection, budget_s: float) -> None:
    """Refuse a projection over budget.

    Raises:
        PredictiveRefusal: ``prompt_exceeds_ttft_budget`` when the prompt alone is over the
            budget; ``ttft_budget_exceeded`` when the projection is strictly over it.
    """
    if projection.prompt_alone_s > budget_s:
        raise PredictiveRefusal.prompt_too_long(projection.prompt_alone_s, budget_s)
    if projection.ttft_s > budget_s:
        raise PredictiveRefusal.over_budget(projection.ttft_s - budget_s)
