"""Synthetic traces built from the bundled ones, seeded (pure: no I/O, no clock).

Both keep every row of the trace they start from, in order, and change one thing:

* :func:`bursty`: the arrivals. Consecutive rows are grouped into *ticks* of 10 to 30 requests
  (sizes drawn from the seed) that arrive at the same instant, each tick at its first row's
  original time, the times then stretched so the last tick comes at the original last arrival:
  the span, so the mean rate (:func:`~narwhal.bench.trace.mean_rate`), is the original's exactly,
  and so is the size mix (the rows are the same).
* :func:`long_prompts`: the prompts. A seeded share of the rows gets a prompt drawn
  log-uniformly between 8k and 128k tokens (never shorter than it was, and leaving room in a 128k
  context for its output and for the ``max_tokens`` of 2,048 the admission replay asks), the
  others and every arrival stay as they were: a heavy tail (a quarter of the long ones are 64k or
  more) on the trace's own traffic.

:data:`SYNTHETIC` names them for :func:`narwhal.bench.trace.load_trace`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import attrs

from narwhal.bench.trace import TraceRequest

__all__ = [
    "LONG_MAX_TOKENS",
    "LONG_MIN_TOKENS",
    "LONG_OUTPUT_ROOM",
    "LONG_SHARE",
    "SYNTHETIC",
    "TICK_SIZES",
    "Synthetic",
    "build",
    "bursty",
    "long_prompts",
    "tick_sizes",
]

TICK_SIZES = (10, 30)
"""The fewest and the most requests of one tick of :func:`bursty` (both included)."""

LONG_SHARE = 0.05
"""The share of the rows :func:`long_prompts` makes long, by default."""

LONG_MIN_TOKENS = 8192
LONG_MAX_TOKENS = 131072
"""The range of a long prompt: ``LONG_MAX_TOKENS`` is the context it must fit in with
``LONG_OUTPUT_ROOM`` (or its own output, if longer)."""

LONG_OUTPUT_ROOM = 2048
"""Tokens a long prompt leaves in the context for the output: the admission replay's
``max_tokens``, which vLLM checks against the context with the prompt."""


class Synthetic(NamedTuple):
    """A named synthetic trace: the bundled trace it starts from and what is done to it."""

    base: str
    kind: str
    description: str


SYNTHETIC: Mapping[str, Synthetic] = MappingProxyType(
    {
        "bursty": Synthetic(
            "conv", "bursty", "the conversation trace in ticks of 10 to 30 simultaneous arrivals"
        ),
        "long": Synthetic(
            "conv", "long", "the conversation trace with 5 % of its prompts 8k to 128k tokens"
        ),
    }
)
"""The synthetic traces by name, each built from a bundled trace with the run's seed."""


def build(name: str, rows: Sequence[TraceRequest], *, seed: int) -> list[TraceRequest]:
    """The synthetic trace ``name`` (a key of :data:`SYNTHETIC`) made from its base's ``rows``."""
    kind = SYNTHETIC[name].kind
    return bursty(rows, seed=seed) if kind == "bursty" else long_prompts(rows, seed=seed)


def tick_sizes(count: int, rng: random.Random, sizes: tuple[int, int] = TICK_SIZES) -> list[int]:
    """Sizes of consecutive ticks, each within ``sizes``, adding up to ``count``.

    Each is drawn uniformly, except that a draw leaving fewer rows than a tick's least size takes
    less (the rest then makes the last tick). Fewer rows than the least size make one smaller
    tick, the only exception.

    Raises:
        ValueError: not ``1 <= low`` and ``2 * low - 1 <= high`` (a count above ``high`` could
            then have no split).
    """
    low, high = sizes
    if not 1 <= low <= 2 * low - 1 <= high:
        raise ValueError(f"tick sizes need 1 <= low and 2 * low - 1 <= high, got {sizes!r}")
    if count < low:
        return [count] if count else []
    result: list[int] = []
    left = count
    while left > high:
        # What is left after this tick must make one: at least ``low`` rows (``left - low`` is
        # at least ``high + 1 - low >= low``).
        size = min(rng.randint(low, high), left - low)
        result.append(size)
        left -= size
    result.append(left)
    return result


def bursty(
    rows: Sequence[TraceRequest], *, seed: int, sizes: tuple[int, int] = TICK_SIZES
) -> list[TraceRequest]:
    """``rows`` regrouped into ticks of simultaneous arrivals (see the module doc).

    Raises:
        ValueError: ``sizes`` is not a range :func:`tick_sizes` can split with.
    """
    if not rows:
        return []
    rng = random.Random(f"bursty|{seed}")
    groups = tick_sizes(len(rows), rng, sizes)
    first = rows[0].arrival_s
    starts: list[int] = []
    position = 0
    for size in groups:
        starts.append(position)
        position += size
    times = [rows[start].arrival_s - first for start in starts]
    span = rows[-1].arrival_s - first
    stretch = span / times[-1] if times[-1] > 0 else 1.0
    result: list[TraceRequest] = []
    for start, size, at in zip(starts, groups, times, strict=True):
        for row in rows[start : start + size]:
            result.append(attrs.evolve(row, arrival_s=at * stretch))
    return result


def long_prompts(
    rows: Sequence[TraceRequest],
    *,
    seed: int,
    share: float = LONG_SHARE,
    low: int = LONG_MIN_TOKENS,
    high: int = LONG_MAX_TOKENS,
    room: int = LONG_OUTPUT_ROOM,
) -> list[TraceRequest]:
    """``rows`` with a seeded ``share`` of the prompts made long (see the module doc).

    Raises:
        ValueError: ``share`` is not within 0..1, or not ``0 < low <= high``.
    """
    if not 0 <= share <= 1:
        raise ValueError(f"the share must be within 0..1, got {share!r}")
    if not 0 < low <= high:
        raise ValueError(f"long prompts need 0 < low <= high, got {low}, {high}")
    rng = random.Random(f"long|{seed}")
    span = math.log(high / low)
    result: list[TraceRequest] = []
    for row in rows:
        chosen = rng.random() < share
        drawn = round(low * math.exp(rng.random() * span))  # drawn for every row: stable
        if chosen:
            ceiling = max(row.prompt_tokens, high - max(row.output_tokens, room))
            prompt = min(max(row.prompt_tokens, drawn), ceiling)
            result.append(attrs.evolve(row, prompt_tokens=prompt))
        else:
            result.append(row)
    return result
