"""Traces: parsing, the bundled files, truncating and scaling the time axis (pure)."""

from __future__ import annotations

import pytest

from narwhal.bench.trace import (
    TraceRequest,
    load_trace,
    mean_rate,
    parse_trace,
    scale_to_rate,
    span_s,
    truncate,
)

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:50.5000000,200,20
2023-11-16 18:15:46.0000000,100,10
2023-11-16 18:15:52.0000000,300,30
2023-11-16 18:15:54.0000000,400,40
"""


def test_rows_are_sorted_and_timed_from_the_first_arrival() -> None:
    rows = parse_trace(CSV)
    assert [(row.index, row.prompt_tokens, row.output_tokens) for row in rows] == [
        (0, 100, 10),
        (1, 200, 20),
        (2, 300, 30),
        (3, 400, 40),
    ]
    assert [row.arrival_s for row in rows] == pytest.approx([0.0, 4.5, 6.0, 8.0])


def test_mean_rate_counts_gaps_over_the_span() -> None:
    rows = parse_trace(CSV)
    assert span_s(rows) == pytest.approx(8.0)
    assert mean_rate(rows) == pytest.approx(3 / 8)  # three gaps fill eight seconds
    assert mean_rate(rows[:1]) == 0.0


def test_scaling_keeps_the_shape_and_sets_the_rate() -> None:
    rows = parse_trace(CSV)
    scaled = scale_to_rate(rows, 3.0)
    assert mean_rate(scaled) == pytest.approx(3.0)
    assert [row.arrival_s for row in scaled] == pytest.approx([0.0, 0.5625, 0.75, 1.0])
    assert [row.prompt_tokens for row in scaled] == [100, 200, 300, 400]
    assert [row.index for row in scaled] == [0, 1, 2, 3]


def test_scaling_refuses_what_cannot_be_scaled() -> None:
    rows = parse_trace(CSV)
    with pytest.raises(ValueError, match="> 0"):
        scale_to_rate(rows, 0.0)
    with pytest.raises(ValueError, match="two arrivals"):
        scale_to_rate(rows[:1], 1.0)


def test_truncate_keeps_the_first_seconds_of_trace_time() -> None:
    rows = parse_trace(CSV)
    assert [row.index for row in truncate(rows, 6.0)] == [0, 1]


def test_bad_traces_name_the_problem() -> None:
    with pytest.raises(ValueError, match="GeneratedTokens"):
        parse_trace("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n")
    with pytest.raises(ValueError, match="line 2"):
        parse_trace("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(ValueError, match="unknown trace"):
        load_trace("nope")


def test_the_bundled_conversation_trace() -> None:
    rows = load_trace("conv")
    assert len(rows) == 19366
    assert rows[0] == TraceRequest(0, 0.0, 374, 44)
    assert span_s(rows) == pytest.approx(3501.7, abs=0.1)
    assert mean_rate(rows) == pytest.approx(5.53, abs=0.01)
    assert load_trace("azure2023_code.csv")[0].index == 0
