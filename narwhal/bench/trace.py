"""Request traces: load the bundled Azure 2023 traces and rescale them (pure, no I/O but reading).

A trace is a list of :class:`TraceRequest`: when the request arrives (seconds from the first
row), its prompt length and its output length, in tokens. The bundled traces
(``narwhal/data/traces/``, see ``ATTRIBUTION.md`` there) have the columns ``TIMESTAMP``,
``ContextTokens`` and ``GeneratedTokens``.

Synthetic traces made from the bundled ones with a seed (:mod:`narwhal.bench.synthetic`:
``bursty``, ``long``) load by name too; :data:`TRACE_NAMES` lists every name.

Replaying a trace at a chosen load keeps its shape (the bursts, the order, the lengths) and
scales only the time axis: :func:`scale_to_rate` compresses or stretches every inter-arrival
gap by the same factor so that the mean rate becomes the one asked for.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from datetime import datetime
from importlib import resources

import attrs

__all__ = [
    "TRACES",
    "TRACE_NAMES",
    "TraceRequest",
    "load_trace",
    "mean_rate",
    "parse_trace",
    "scale_to_rate",
    "span_s",
    "truncate",
]

TRACES = {"conv": "azure2023_conv.csv", "code": "azure2023_code.csv"}
"""The bundled traces by short name."""

TRACE_NAMES = ("conv", "code", "bursty", "long")
"""Every name :func:`load_trace` accepts besides the file names: the bundled traces, then the
synthetic ones (:data:`narwhal.bench.synthetic.SYNTHETIC`)."""


@attrs.frozen(slots=True)
class TraceRequest:
    """One row of a trace.

    Attributes:
        index: the row's position in the trace (0-based).
        arrival_s: seconds from the first row's arrival.
        prompt_tokens: the prompt's length.
        output_tokens: the generated length.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def parse_trace(text: str) -> list[TraceRequest]:
    """Parse a trace's CSV text; arrivals become seconds from the first row, in order.

    Raises:
        ValueError: a column is missing or a value does not parse.
    """
    reader = csv.DictReader(io.StringIO(text))
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"trace lacks the column(s) {', '.join(sorted(missing))}")
    rows: list[tuple[float, int, int]] = []
    for line, row in enumerate(reader, start=2):
        try:
            at = _timestamp(row["TIMESTAMP"])
            rows.append((at, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
        except ValueError as exc:
            raise ValueError(f"trace line {line}: {exc}") from None
    rows.sort(key=lambda row: row[0])
    if not rows:
        return []
    start = rows[0][0]
    return [
        TraceRequest(index, at - start, prompt, output)
        for index, (at, prompt, output) in enumerate(rows)
    ]


def _timestamp(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, one more than Python parses.
    head, _, fraction = text.strip().partition(".")
    seconds = datetime.fromisoformat(head).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def load_trace(name: str, *, seed: int = 0) -> list[TraceRequest]:
    """A trace by name: a bundled one by short name (``conv``, ``code``) or file name, or a
    synthetic one (``bursty``, ``long``: :mod:`narwhal.bench.synthetic`) built with ``seed``
    (the bundled ones ignore it).

    Raises:
        ValueError: no such trace.
    """
    from narwhal.bench import synthetic  # it builds on this module

    made = synthetic.SYNTHETIC.get(name)
    if made is not None:
        return synthetic.build(name, load_trace(made.base), seed=seed)
    filename = TRACES.get(name, name)
    if filename not in TRACES.values():
        known = ", ".join(TRACE_NAMES)
        raise ValueError(f"unknown trace {name!r} (known: {known})")
    text = resources.files("narwhal").joinpath("data", "traces", filename).read_text()
    return parse_trace(text)


def span_s(trace: Sequence[TraceRequest]) -> float:
    """Seconds from the first arrival to the last (0 for fewer than two rows)."""
    return trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 0.0


def mean_rate(trace: Sequence[TraceRequest]) -> float:
    """Mean arrival rate, requests per second: ``(n - 1) / span`` (0 when undefined).

    ``n - 1`` gaps fill the span, so a trace scaled to rate ``r`` replays ``n`` requests in
    ``(n - 1) / r`` seconds.
    """
    span = span_s(trace)
    return (len(trace) - 1) / span if span > 0 else 0.0


def truncate(trace: Iterable[TraceRequest], duration_s: float) -> list[TraceRequest]:
    """The rows arriving within the first ``duration_s`` seconds of the trace (trace time)."""
    return [row for row in trace if row.arrival_s < duration_s]


def scale_to_rate(trace: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """The same rows with every arrival time scaled so that the mean rate is ``rate``.

    Raises:
        ValueError: ``rate`` is not positive, or the trace has no span to scale.
    """
    if not rate > 0:
        raise ValueError(f"the rate must be > 0, got {rate!r}")
    current = mean_rate(trace)
    if current <= 0:
        raise ValueError("a trace needs two arrivals at different times to be scaled")
    factor = current / rate
    first = trace[0].arrival_s
    return [attrs.evolve(row, arrival_s=(row.arrival_s - first) * factor) for row in trace]
