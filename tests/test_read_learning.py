"""What a stream teaches is learned once per network read, and learns what it learned per event.

The relay takes every chunk one read completed without an ``await``, and the slot, the
forecast and drift learn from them once, for the read (:meth:`Exchange.settle`): the gap
before its output events with all their tokens, the tokens generated, the step it ended.
The same stream observed one event at a time (each chunk its own read, as before) must teach
the same totals. MockClock: the virtual times are exact.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from narwhal.config import EngineConfig
from narwhal.protocol.chunks import ChunkFacts
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.profiles import get_profile
from narwhal.upstream.client import ChunkEvent, DoneEvent, UpstreamEvent
from narwhal.upstream.exchange import Exchange, Measurements
from narwhal.web.metrics import CountingHistogram

Read = tuple[float, list[ChunkEvent]]  # seconds after the previous read, its chunks


def chunk(*, tokens: int = 1, output: bool = True, finish: bool = False) -> ChunkEvent:
    facts = ChunkFacts(output, finish, False, False, tokens, tokens > 0)
    return ChunkEvent(b"{}", {}, facts)


USAGE = ChunkEvent(
    b"{}",
    {"usage": {"prompt_tokens": 100, "completion_tokens": 24}},
    ChunkFacts(False, False, True, True, 0, False),
)
ROLE = chunk(tokens=0, output=False)


class _Stream:
    """An upstream stream whose network reads complete the given chunks, at the given times."""

    request_id = "req-test"

    def __init__(self, reads: list[Read]) -> None:
        self._reads = list(reads)
        self._pending: list[ChunkEvent] = []

    def buffered(self) -> bool:
        return bool(self._pending)

    def next_ready(self) -> UpstreamEvent | None:
        return self._pending.pop(0) if self._pending else None

    async def next_event(self) -> UpstreamEvent:
        if not self._pending:
            if not self._reads:
                await trio.sleep(0.001)
                return DoneEvent(clean=True)
            delay, events = self._reads.pop(0)
            await trio.sleep(delay)
            self._pending = list(events)
        return self._pending.pop(0)


def per_event(reads: list[Read]) -> list[Read]:
    """The same chunks at the same times, each its own read (the others of a read at once)."""
    return [
        (delay if n == 0 else 0.0, [event])
        for delay, events in reads
        for n, event in enumerate(events)
    ]


def engine_of() -> Engine:
    engine = Engine(
        EngineConfig(name="e", url="http://e.test"),
        client=cast(Any, None),
        prefill_limit=4,
        decode_limit=64,
        forecast=PrefillForecast(get_profile("h100-llama3-8b")),
    )
    EnginePool([engine])
    engine.poll_succeeded(0.0)
    return engine


async def relay(
    reads: list[Read], *, client_s: float = 0.0
) -> tuple[Engine, Slot, Exchange, dict[str, float]]:
    """Relay ``reads`` as :func:`narwhal.web.completions._relay` does; what was learned.

    ``client_s``: how long each write to the client takes after an awaited chunk (a client
    that reads slowly)."""
    engine = engine_of()
    with trio.fail_after(60):
        slot = Slot.take(engine, 100, max_tokens=64)
        exchange = Exchange(
            cast(Any, None),
            engine,
            cast(Any, _Stream([(0.05, [ROLE]), *reads])),
            cast(Any, None),
            slot,
            Measurements(trio.current_time()),
        )
        while True:
            while exchange.next_ready() is not None:
                pass
            if await exchange.next_chunk() is None:
                break
            if client_s:
                await trio.sleep(client_s)
        exchange.settle()
        seen = {
            # Times from the arrival (the clock runs on between relays).
            "step_seen_at": engine.forecast.step_seen_at - exchange.measurements.arrival,
            "last_output_at": cast(float, exchange.measurements.last_output_at)
            - exchange.measurements.arrival,
            "decode_context": engine.forecast.decode_context,
            "decode_scale": engine.forecast.decode_scale,
        }
        slot.release()
    return engine, slot, exchange, seen


# A 2x slower decode than the profile, as reads of 1, 3, 1, 4 and 2 events (the last with
# the finish), then the usage chunk.
STEP_S = 2 * get_profile("h100-llama3-8b").decode_step_ms(1, 100) / 1000
READS: list[Read] = [
    (0.0, [chunk()]),  # the first output, with the role chunk's read
    (3 * STEP_S, [chunk(), chunk(), chunk()]),
    (STEP_S, [chunk()]),
    (4 * STEP_S, [chunk(), chunk(tokens=0, output=False), chunk(), chunk(tokens=2), chunk()]),
    (3 * STEP_S, [chunk(), chunk(finish=True), USAGE]),
]


def test_the_fake_stream_is_the_schedule() -> None:
    events = sum(len(events) for _, events in READS)
    assert len(per_event(READS)) == events
    assert sum(delay for delay, _ in per_event(READS)) == sum(delay for delay, _ in READS)


async def test_a_stream_read_at_once_learns_the_totals_it_learned_per_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, slot_a, exchange_a, seen_a = await relay(per_event(READS))
    _, slot_b, exchange_b, seen_b = await relay(READS)
    a, b = exchange_a.measurements, exchange_b.measurements
    # The request's own figures: TTFT, output events and tokens, usage, the last output.
    assert (a.output_events, a.output_tokens, a.usage_seen) == (
        b.output_events,
        b.output_tokens,
        b.usage_seen,
    )
    assert (a.output_events, a.output_tokens) == (11, 12)
    assert a.ttft == pytest.approx(b.ttft, abs=1e-12)  # the same instant (float sums apart)
    assert seen_a["last_output_at"] == pytest.approx(seen_b["last_output_at"], abs=1e-12)
    # What the slot and the forecast were told: the tokens generated, the context, the step.
    assert slot_a.generated_tokens == slot_b.generated_tokens == 12
    assert slot_a.context_tokens == slot_b.context_tokens == 100 + 12
    assert seen_a["decode_context"] == seen_b["decode_context"] == 100 + 12
    assert seen_a["step_seen_at"] == pytest.approx(seen_b["step_seen_at"], abs=1e-12)
    # Drift's sums: the gaps (per event, the events after the first of a read came zero
    # apart) and their tokens. (Their predictions follow the decode speed learned, below.)
    assert slot_a.gaps_observed_s == pytest.approx(slot_b.gaps_observed_s, abs=1e-12)
    assert slot_a.gaps_observed_s == pytest.approx(11 * STEP_S)
    assert slot_a.gap_tokens == slot_b.gap_tokens == 11  # the 2-token chunk counts 2
    # The histogram's gaps: the same count and sum.
    gaps_a = [gap for gap, events in a.gaps for _ in range(events)]
    assert len(gaps_a) == sum(events for _, events in b.gaps) == 10
    assert sum(gap for gap, _ in a.gaps) == pytest.approx(sum(gap for gap, _ in b.gaps))
    # Observed per event, the later events of a read were skipped (a zero gap teaches the
    # speed nothing) and the first took the read's whole gap for its own token; per read, the
    # gap is shared by every token it carried: the decode speed learned is the engine's.
    assert seen_b["decode_scale"] != seen_a["decode_scale"]


def one_chunk_per_read(reads: list[Read]) -> list[Read]:
    """Each read's output as one chunk of all its tokens (an engine's ``stream_interval``)."""
    merged: list[Read] = []
    for delay, events in reads:
        output = [event for event in events if event.facts.output]
        tokens = sum(event.facts.token_ids or 1 for event in output)
        finish = any(event.facts.finish for event in events)
        rest = [event for event in events if not event.facts.output and event.facts.usage]
        merged.append((delay, [chunk(tokens=tokens, finish=finish), *rest]))
    return merged


async def test_a_read_of_several_chunks_teaches_the_speed_as_one_chunk_of_their_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The gap before a read is the time its tokens took: as if the engine had sent them in one
    # chunk, which the per-event path learned exactly so.
    merged = one_chunk_per_read(READS)
    engine_a, slot_a, _, seen_a = await relay(per_event(merged))
    engine_b, slot_b, _, seen_b = await relay(READS)
    assert seen_b["decode_scale"] == pytest.approx(seen_a["decode_scale"], rel=1e-9)
    assert seen_b["decode_scale"] > 1.0  # a 2x slower decode: it learns towards it
    assert slot_a.gap_tokens == slot_b.gap_tokens
    assert slot_a.gaps_observed_s == pytest.approx(slot_b.gaps_observed_s)
    # Drift: the same predictions, up to the context the later events of a read add before
    # their tokens are predicted (a token's share of a 112-token context), the same ratio.
    assert slot_a.gaps_predicted_s == pytest.approx(slot_b.gaps_predicted_s, rel=1e-3)
    ratio_a, ratio_b = engine_a.drift.tpot.ratio, engine_b.drift.tpot.ratio
    assert ratio_a == pytest.approx(ratio_b, rel=1e-3) and ratio_a > 1.1  # one slow request


async def test_one_chunk_per_read_learns_exactly_as_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    reads = per_event(READS)
    spread = [(delay or STEP_S / 4, events) for delay, events in reads]  # no two at once
    engine_a, slot_a, _, seen_a = await relay(spread)
    # The same stream with each read's chunk observed the old way: one event, one update.
    engine = engine_of()
    slot = Slot.take(engine, 100, max_tokens=64)
    arrival = trio.current_time()
    await trio.sleep(0.05)
    last = None
    for delay, events in spread:
        await trio.sleep(delay)
        for event in events:
            facts = event.facts
            if facts.output:
                now = trio.current_time()
                if last is None:
                    slot.to_decode()
                else:
                    slot.observe_gap(now - last, facts.token_ids)
                last = now
            slot.generated(facts.token_ids or int(facts.output))
    exact = {"rel": 1e-12, "abs": 1e-12}  # the same arithmetic, on times summed apart
    assert engine.forecast.decode_scale == pytest.approx(seen_a["decode_scale"], **exact)
    assert engine.forecast.decode_context == seen_a["decode_context"]
    assert engine.forecast.step_seen_at - arrival == pytest.approx(seen_a["step_seen_at"], **exact)
    assert slot.gap_tokens == slot_a.gap_tokens
    assert slot.gaps_observed_s == pytest.approx(slot_a.gaps_observed_s, **exact)
    assert slot.gaps_predicted_s == pytest.approx(slot_a.gaps_predicted_s, **exact)
    slot.release()
    assert engine.drift.tpot.ratio == pytest.approx(engine_a.drift.tpot.ratio, **exact)


def test_the_gap_histogram_observed_in_bulk_is_prometheus_clients_histogram() -> None:
    buckets = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
    name, doc = "narwhal_inter_token_gap_seconds", "Time between two output events"
    plain_registry, counted_registry = CollectorRegistry(), CollectorRegistry()
    plain = Histogram(name, doc, buckets=buckets, registry=plain_registry)
    counted = CountingHistogram(name, doc, buckets)
    counted_registry.register(counted)
    for value in (0.0, 0.0, 0.0, 0.001, 0.003, 0.02, 1.0, 7.0):
        plain.observe(value)
    counted.observe(0.0, 3)
    for value in (0.001, 0.003, 0.02, 1.0, 7.0):
        counted.observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if not line.startswith(f"{name}_created ")]

    assert lines(counted_registry) == lines(plain_registry)
    assert f"{name}_created " in generate_latest(counted_registry).decode()


async def test_a_gap_the_relay_spent_writing_to_a_slow_client_teaches_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The engine has sent everything (each chunk already read when asked for), and the client
    # takes a second per chunk: the gaps are the client's, not the engine's. They are still
    # the gaps the router saw (the histogram), but neither the decode scale nor drift learns
    # from them; a chunk the relay waited for is learned from as ever.
    reads: list[Read] = [(0.0, [chunk()]), *((0.0, [chunk()]) for _ in range(8))]
    reads.append((STEP_S, [chunk(finish=True), USAGE]))  # the engine's own pace again
    _, slot, exchange, seen = await relay(reads, client_s=1.0)
    gaps = exchange.measurements.gaps
    assert [round(gap, 3) for gap, _ in gaps[:8]] == [1.0] * 8  # what the router saw
    # The last gap: a second away, then the engine's step: mostly the client's too.
    assert seen["decode_scale"] == 1.0
    assert slot.gap_tokens == 0  # drift was told of no gap


async def test_a_gap_the_relay_waited_for_teaches_as_ever(
    autojump_clock: trio.testing.MockClock,
) -> None:
    reads: list[Read] = [(0.0, [chunk()]), *((STEP_S, [chunk()]) for _ in range(8))]
    reads.append((STEP_S, [chunk(finish=True), USAGE]))
    _, slot, _, seen = await relay(reads)
    assert seen["decode_scale"] > 1.0  # twice the profiled step: it learned
    assert slot.gap_tokens > 0
