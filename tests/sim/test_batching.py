"""The continuous-batching scheduler: what each step holds and costs (pure, no event loop)."""

from __future__ import annotations

import attrs
import pytest

from narwhal.scheduling.profiles import get_profile
from narwhal.sim import Batcher
from narwhal.sim.batching import BatchSeq, BatchStep
from tests.sim.helpers import TOY


def layout(step: BatchStep) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Who decodes and which chunks a step holds, by sequence id."""
    return [s.id for s in step.decodes], [(c.seq.id, c.start, c.end) for c in step.chunks]


def run(batcher: Batcher) -> BatchStep:
    step = batcher.next_step()
    assert step is not None
    batcher.complete(step)
    return step


def test_a_lone_prompt_costs_exactly_its_prefill() -> None:
    h100 = get_profile("h100-llama3-8b")
    for tokens in (1024, 8192):
        batcher = Batcher(h100)
        seq = batcher.submit(tokens, 1)
        step = run(batcher)
        assert layout(step) == ([], [(0, 0, tokens)])
        assert step.cost_ms == pytest.approx(h100.prefill_ms(tokens), rel=1e-12)
        assert (seq.state, seq.emitted, batcher.idle) == ("finished", 1, True)


def test_a_long_prompt_is_prefilled_in_chunks_then_decodes() -> None:
    batcher = Batcher(TOY)
    seq = batcher.submit(100, 3)
    first = run(batcher)
    assert layout(first) == ([], [(0, 0, 64)])
    assert first.cost_ms == pytest.approx(TOY.prefill_ms(64))
    assert (seq.prefilled, seq.emitted) == (64, 0)  # no token before the prompt is done
    second = run(batcher)
    assert layout(second) == ([], [(0, 64, 100)])
    assert second.cost_ms == pytest.approx(TOY.prefill_base_ms + TOY.prefill_chunk_ms(64, 100))
    assert seq.emitted == 1  # the first token ends the step that completes the prefill
    third = run(batcher)
    assert layout(third) == ([0], []) and third.context_tokens == 101
    assert third.cost_ms == pytest.approx(TOY.decode_step_ms(1, 101))
    run(batcher)
    assert (seq.emitted, seq.state, batcher.next_step()) == (3, "finished", None)


def test_decodes_take_one_token_each_and_prefill_gets_the_rest_without_base() -> None:
    batcher = Batcher(TOY)
    a = batcher.submit(10, 5)
    run(batcher)  # a prefilled, emitted its first token
    b = batcher.submit(200, 5)
    step = run(batcher)
    assert layout(step) == ([a.id], [(b.id, 0, 63)])
    assert step.tokens == 64
    assert step.cost_ms == pytest.approx(TOY.decode_step_ms(1, 11) + TOY.prefill_chunk_ms(0, 63))


def test_prefill_is_fcfs_and_partial_prefills_finish_before_newcomers() -> None:
    batcher = Batcher(TOY)
    a, b = batcher.submit(50, 1), batcher.submit(50, 1)
    assert layout(run(batcher)) == ([], [(a.id, 0, 50), (b.id, 0, 14)])
    c = batcher.submit(10, 1)
    assert layout(run(batcher)) == ([], [(b.id, 14, 50), (c.id, 0, 10)])
    assert [s.state for s in (a, b, c)] == ["finished"] * 3


def test_ttft_grows_with_the_prefills_queued_ahead() -> None:
    batcher = Batcher(TOY)
    seqs = [batcher.submit(64, 1) for _ in range(4)]
    clock, first_tokens = 0.0, []
    while not batcher.idle:
        step = batcher.next_step()
        assert step is not None
        clock += step.cost_ms
        first_tokens += [(s.id, clock) for s in batcher.complete(step)]
    lone = TOY.prefill_ms(64)
    assert [seq for seq, _ in first_tokens] == [s.id for s in seqs]
    assert [at for _, at in first_tokens] == pytest.approx([lone, 2 * lone, 3 * lone, 4 * lone])


def test_the_decode_step_grows_with_the_batch() -> None:
    costs = {}
    for size in (1, 3):
        batcher = Batcher(TOY)
        for _ in range(size):
            batcher.submit(16, 4)
        run(batcher)  # every prompt in one step
        costs[size] = run(batcher).cost_ms
    assert costs[1] == pytest.approx(TOY.decode_step_ms(1, 17))
    assert costs[3] == pytest.approx(TOY.decode_step_ms(3, 3 * 17))
    assert costs[3] > costs[1]


def test_max_num_seqs_bounds_the_batch() -> None:
    batcher = Batcher(TOY)
    seqs = [batcher.submit(4, 3) for _ in range(5)]
    step = run(batcher)
    assert len(step.chunks) == 3
    stats = batcher.statistics()
    assert (stats.running, stats.waiting) == (3, 2)
    while not batcher.idle:
        assert batcher.statistics().running <= TOY.max_num_seqs
        run(batcher)
    assert all(s.state == "finished" for s in seqs)


def test_a_full_kv_cache_makes_requests_wait_in_fcfs_order() -> None:
    batcher = Batcher(TOY)  # 1000 tokens of KV
    a, b = batcher.submit(10, 390), batcher.submit(10, 390)
    c, d = batcher.submit(10, 390), batcher.submit(10, 10)  # d would fit, but c is ahead
    run(batcher)
    stats = batcher.statistics()
    assert (stats.running, stats.waiting, stats.kv_tokens) == (2, 2, 800)
    assert stats.kv_cache_usage == 0.8
    assert (c.state, d.state) == ("waiting", "waiting")
    batcher.abort(a)  # its KV is free at once
    assert batcher.statistics().kv_tokens == 400
    step = run(batcher)
    assert layout(step) == ([b.id], [(c.id, 0, 10), (d.id, 0, 10)])
    assert batcher.statistics().kv_tokens == 400 + 400 + 20


def test_reserved_kv_is_freed_when_a_request_finishes() -> None:
    batcher = Batcher(TOY, kv_capacity_tokens=30)
    a, b = batcher.submit(10, 10), batcher.submit(10, 10)
    run(batcher)
    assert (b.state, batcher.statistics().kv_tokens) == ("waiting", 20)
    while a.state != "finished":
        run(batcher)
    assert batcher.statistics().kv_tokens == 0
    run(batcher)
    assert b.state == "running"


def test_a_request_too_big_for_the_cache_runs_alone() -> None:
    batcher = Batcher(TOY, kv_capacity_tokens=50)
    small = batcher.submit(10, 10)
    big = batcher.submit(40, 40)
    run(batcher)
    assert big.state == "waiting"
    while small.state != "finished":
        run(batcher)
    run(batcher)
    assert big.state == "running"
    assert batcher.statistics().kv_cache_usage == 1.0


def test_aborts_leave_at_once_and_a_running_step_skips_them() -> None:
    batcher = Batcher(TOY)
    a, b = batcher.submit(10, 5), batcher.submit(10, 5)
    run(batcher)
    step = batcher.next_step()
    assert step is not None
    batcher.abort(a)
    batcher.abort(a)  # idempotent
    assert [s.id for s in batcher.complete(step)] == [b.id]
    assert (a.state, a.emitted, b.emitted) == ("aborted", 1, 2)
    prefilling = batcher.submit(100, 5)
    step = batcher.next_step()
    assert step is not None and layout(step)[1] == [(prefilling.id, 0, 63)]
    batcher.abort(prefilling)
    assert [s.id for s in batcher.complete(step)] == [b.id]
    assert prefilling.prefilled == 0
    waiting = batcher.submit(10, 5)
    batcher.abort(waiting)
    stats = batcher.statistics()
    assert (stats.running, stats.waiting, stats.kv_tokens, stats.steps) == (1, 0, 15, 3)


def test_no_output_still_takes_the_prefill_step_and_an_empty_prompt_a_step() -> None:
    batcher = Batcher(TOY)
    silent, empty = batcher.submit(8, 0), batcher.submit(0, 2)
    step = run(batcher)
    assert layout(step) == ([], [(silent.id, 0, 8), (empty.id, 0, 0)])
    assert (silent.state, silent.emitted, empty.emitted) == ("finished", 1, 1)
    run(batcher)
    assert empty.state == "finished" and batcher.next_step() is None


def test_clear_forgets_everything() -> None:
    batcher = Batcher(TOY)
    seqs = [batcher.submit(10, 500) for _ in range(3)]
    run(batcher)
    batcher.clear()
    assert batcher.idle and batcher.statistics().kv_tokens == 0
    assert all(s.state == "aborted" for s in seqs)


def test_sequence_and_profile_accounting() -> None:
    seq = BatchSeq(0, prompt_tokens=7, output_tokens=0)
    assert (seq.steps, seq.kv_tokens, seq.done) == (1, 7, False)
    assert Batcher(TOY).kv_capacity_tokens == 1000
    with pytest.raises(ValueError):
        Batcher(TOY, kv_capacity_tokens=0)
    assert Batcher(attrs.evolve(TOY, kv_capacity_tokens=5)).kv_capacity_tokens == 5
