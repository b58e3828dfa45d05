"""Synthetic traces: bursty ticks and long prompts, seeded, built from the bundled traces."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from narwhal.bench.synthetic import (
    LONG_MAX_TOKENS,
    LONG_MIN_TOKENS,
    LONG_OUTPUT_ROOM,
    SYNTHETIC,
    bursty,
    long_prompts,
    tick_sizes,
)
from narwhal.bench.trace import TRACE_NAMES, TRACES, TraceRequest, load_trace, mean_rate


@pytest.fixture(scope="module")
def conv() -> list[TraceRequest]:
    return load_trace("conv")


def test_every_name_loads_and_the_synthetic_ones_are_named() -> None:
    assert TRACE_NAMES == (*TRACES, *SYNTHETIC)
    with pytest.raises(ValueError, match="known: conv, code, bursty, long"):
        load_trace("nope")


@pytest.mark.parametrize("name", ["bursty", "long"])
def test_the_same_seed_gives_the_same_trace_and_another_seed_another(name: str) -> None:
    first = load_trace(name, seed=3)
    assert load_trace(name, seed=3) == first
    assert load_trace(name, seed=4) != first
    assert load_trace(name) == load_trace(name, seed=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_bursty_arrives_in_ticks_of_10_to_30(conv: list[TraceRequest], seed: int) -> None:
    rows = load_trace("bursty", seed=seed)
    ticks = Counter(row.arrival_s for row in rows)
    assert min(ticks.values()) >= 10 and max(ticks.values()) <= 30
    assert set(ticks.values()) == set(range(10, 31))  # every size occurs on 19,366 rows
    # The rows stay in order and each tick is a run of consecutive rows.
    assert [row.index for row in rows] == list(range(len(conv)))
    assert [row.arrival_s for row in rows] == sorted(row.arrival_s for row in rows)
    # The same requests (the size mix), the same mean rate and span.
    sizes = [(row.prompt_tokens, row.output_tokens) for row in rows]
    assert sizes == [(row.prompt_tokens, row.output_tokens) for row in conv]
    assert mean_rate(rows) == pytest.approx(mean_rate(conv), rel=0.01)
    assert rows[-1].arrival_s == pytest.approx(conv[-1].arrival_s)


def test_tick_sizes_add_up_and_stay_within_bounds() -> None:
    rng = random.Random(0)
    for count in (10, 11, 29, 30, 31, 39, 40, 41, 59, 60, 61, 1000):
        sizes = tick_sizes(count, rng)
        assert sum(sizes) == count
        assert all(10 <= size <= 30 for size in sizes), (count, sizes)
    assert tick_sizes(7, rng) == [7] and tick_sizes(0, rng) == []
    with pytest.raises(ValueError):
        tick_sizes(100, rng, (10, 18))


def test_bursty_on_the_code_trace_too() -> None:
    code = load_trace("code")
    rows = bursty(code, seed=0)
    assert max(Counter(row.arrival_s for row in rows).values()) <= 30
    assert mean_rate(rows) == pytest.approx(mean_rate(code), rel=0.01)


@pytest.mark.parametrize("seed", [0, 1])
def test_long_prompts_have_a_heavy_tail_up_to_128k(conv: list[TraceRequest], seed: int) -> None:
    rows = load_trace("long", seed=seed)
    assert len(rows) == len(conv)
    assert max(row.prompt_tokens for row in rows) + LONG_OUTPUT_ROOM <= LONG_MAX_TOKENS
    assert max(row.prompt_tokens for row in conv) < 16_384  # the original has no tail
    over_64k = sum(1 for row in rows if row.prompt_tokens >= 65_536)
    changed = [new for new, old in zip(rows, conv, strict=True) if new != old]
    # About 5 % are made long, a quarter of those 64k or more (log-uniform over 8k..128k).
    assert 0.04 < len(changed) / len(conv) < 0.06
    assert 0.15 < over_64k / len(changed) < 0.35
    assert all(row.prompt_tokens >= LONG_MIN_TOKENS for row in changed)
    # Only prompts change: arrivals and outputs are the trace's own.
    assert [(row.arrival_s, row.output_tokens) for row in rows] == [
        (row.arrival_s, row.output_tokens) for row in conv
    ]


def test_a_long_prompt_never_shrinks_nor_leaves_no_room_for_its_output() -> None:
    rows = [TraceRequest(k, float(k), 100_000 if k % 2 else 10, 40_000) for k in range(40)]
    made = long_prompts(rows, seed=0, share=1.0)
    for new, old in zip(made, rows, strict=True):
        assert new.prompt_tokens >= old.prompt_tokens
        ceiling = max(old.prompt_tokens, LONG_MAX_TOKENS - max(old.output_tokens, 2048))
        assert new.prompt_tokens <= ceiling
    assert long_prompts(rows, seed=0, share=0.0) == rows
    with pytest.raises(ValueError, match="share"):
        long_prompts(rows, seed=0, share=1.5)
