"""The TTFT projection (pure): seats freed by running requests, and the prefill pipeline."""

from __future__ import annotations

import math
from typing import Any, cast

import pytest

from narwhal.admission.margin import Overruns, SafetyMargin
from narwhal.admission.plan import Plan
from narwhal.admission.predictor import Projection, Ticks, project
from narwhal.admission.queue import Waiter
from narwhal.config import EngineConfig
from narwhal.scheduling.engines import Engine, Slot
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.lengths import OutputLengths
from narwhal.scheduling.profiles import PROFILES

H100 = PROFILES["h100-llama3-8b"]


def _engine(
    decode_limit: int, *, decoding: int = 0, context: int = 0, prefill_limit: int = 4
) -> Engine:
    forecast = PrefillForecast(
        H100, prefill_limit=prefill_limit, decoding=decoding, decode_context=context
    )
    engine = Engine(
        EngineConfig(name="a", url="http://127.0.0.1:1"),
        client=cast(Any, None),
        prefill_limit=prefill_limit,
        decode_limit=decode_limit,
        forecast=forecast,
    )
    engine.poll_succeeded(0.0)
    return engine


def _running(engine: Engine, count: int, *, generated: int = 0) -> None:
    for _ in range(count):
        slot = Slot(engine, 1000, 0.0, phase="decode", generated_tokens=generated)
        engine.slots[slot] = None


def _waiter(tokens: int = 1000) -> Waiter:
    return Waiter(tokens, False, "chat", None, enqueued_at=0.0)


def _uniform_lengths(top: int = 400) -> OutputLengths:
    lengths = OutputLengths()
    for tokens in range(1, top + 1):
        lengths.learn("chat", None, tokens)
    return lengths


def _project(
    engine: Engine,
    ahead: list[Waiter] | None = None,
    request: Waiter | None = None,
    lengths: OutputLengths | None = None,
    **options: Any,
) -> Projection:
    settings = {"now": 0.0, "elapsed_s": 0.0, "overhead_s": 0.0, **options}
    projection = project(
        [engine], ahead or [], request or _waiter(), lengths or OutputLengths(), **settings
    )
    assert projection is not None
    return projection


def test_a_free_seat_means_no_wait_for_one() -> None:
    projection = _project(_engine(decode_limit=8), overhead_s=0.005)
    assert projection.wait_s == 0.0
    assert projection.ttft_s == pytest.approx(H100.prefill_ms(1000) / 1000 + 0.005)


def test_with_many_running_the_first_seat_frees_long_before_a_typical_end() -> None:
    # 100 requests decode, output lengths uniform over 1..400: the first of them ends after a
    # few tokens, not after the median's 200.
    engine = _engine(decode_limit=100, decoding=100, context=100_000)
    _running(engine, 100)
    projection = _project(engine, lengths=_uniform_lengths())
    assert 0 < projection.wait_s <= 10 * engine.forecast.tpot_s()


def test_each_request_ahead_takes_the_next_seat() -> None:
    engine = _engine(decode_limit=100, decoding=100, context=100_000)
    _running(engine, 100)
    lengths = _uniform_lengths()
    alone = _project(engine, lengths=lengths)
    behind = _project(engine, [_waiter() for _ in range(50)], lengths=lengths)
    tpot = engine.forecast.tpot_s()
    # The 51st end of 100 uniform lengths over 1..400: about a 51/101 share of 400 tokens,
    # and the steps until then also run the prompts of the 50 placed before it.
    ahead = 50 * engine.forecast.compute_s(1000)
    assert behind.wait_s == pytest.approx(51 / 101 * 400 * tpot + ahead, rel=0.1)
    assert behind.wait_s > 10 * alone.wait_s


def test_a_seat_frees_later_by_the_prompts_the_steps_before_it_carry() -> None:
    # A full engine: the first seat frees when a running request ends, and the steps until
    # then also run the chunks of a long prompt in prefill now, as far as they carry it.
    lengths = _uniform_lengths()
    quiet = _engine(decode_limit=100, decoding=100, context=100_000)
    _running(quiet, 100)
    busy = _engine(decode_limit=100, decoding=100, context=100_000)
    _running(busy, 100)
    busy.forecast.place(30_000, now=0.0)  # in prefill, its seat among the 100
    calm = Plan([quiet], lengths, now=0.0).engines[0].next_seat()
    later = Plan([busy], lengths, now=0.0).engines[0].next_seat()
    steps = calm / quiet.forecast.decode_tpot_s()
    carried = min(busy.forecast.compute_s(30_000), steps * busy.forecast.step_compute_s())
    assert 0 < carried < busy.forecast.compute_s(30_000)  # the steps carry part of it
    # (its prompt will decode too: the batch's steps there are a little longer)
    decoded = steps * busy.forecast.decode_tpot_s()
    assert later == pytest.approx(decoded + carried)


def test_requests_that_already_ran_long_are_expected_to_run_longer() -> None:
    fresh = _engine(decode_limit=10, decoding=10, context=10_000)
    old = _engine(decode_limit=10, decoding=10, context=10_000)
    _running(fresh, 10, generated=0)
    _running(old, 10, generated=390)
    lengths = _uniform_lengths()
    # At most 10 tokens are left of 400 for the old ones.
    assert _project(old, lengths=lengths).wait_s < _project(fresh, lengths=lengths).wait_s


def test_prompts_that_fit_one_step_share_it() -> None:
    # Eight 1,000-token prompts fit in one step of 8,192 tokens beside 100 decodes: the eighth
    # waits for the chunks ahead of it and one decode step, not eight.
    engine = _engine(decode_limit=200, decoding=100, context=100_000, prefill_limit=8)
    projection = _project(engine, [_waiter() for _ in range(7)])
    step = H100.decode_step_ms(100, 100_000)
    assert projection.ttft_s * 1000 == pytest.approx(8 * H100.prefill_chunk_ms(0, 1000) + step)


def test_a_request_in_a_tick_expects_those_behind_it_to_join_its_step() -> None:
    # Engines learn how much of a prompt's step the prompts placed after it fill (here half);
    # a request that arrives in a tick expects as much: its step ends that much later.
    engine = _engine(decode_limit=8)
    engine.forecast.fill = 0.5
    alone = _project(engine)
    in_tick = _project(engine, joiners=1.0)
    room = (8192 - 1000) * H100.prefill_per_token_ms / 1000
    assert in_tick.own_prefill_s == pytest.approx(alone.own_prefill_s + 0.5 * room)
    assert in_tick.wait_s == alone.wait_s
    # With a chance of one in four that any come, a quarter of that.
    assert _project(engine, joiners=0.25).ttft_s == pytest.approx(alone.ttft_s + 0.125 * room)
    assert _project(engine, joiners=0.0) == alone


def test_the_head_of_a_tick_is_projected_at_the_end_of_the_step_the_tick_shares() -> None:
    # Four prompts arrive in one instant and share one step. With the fill learned from such
    # ticks (all of the room: 1.0), the first is projected when that step ends, as the
    # forecast revises it once the other three have joined; without, at its own prefill's end.
    engine = _engine(decode_limit=8)
    forecast = engine.forecast
    forecast.fill = 1.0
    sizes = [1000, 2400, 2400, 2392]  # 8,192 tokens: the step's whole budget
    head = _project(engine, request=_waiter(sizes[0]), joiners=1.0)
    key, _ = forecast.place(sizes[0], now=0.0)
    for tokens in sizes[1:]:
        forecast.place(tokens, now=0.0)
    revised = forecast.expected_first_token(key)
    assert revised is not None
    quadratic = H100.prefill_quadratic_ms * (sum(t * t for t in sizes[1:])) / 1000
    assert head.ttft_s == pytest.approx(revised - quadratic)  # the room is priced linearly
    assert _project(_engine(decode_limit=8), request=_waiter(sizes[0])).ttft_s < revised / 2


def test_ticks_tell_how_likely_more_requests_arrive_in_the_same_instant() -> None:
    ticks = Ticks()
    assert ticks.arrive(0.0) == 0.0  # nothing learned yet
    assert ticks.arrive(0.0) == 1.0  # a second one in the instant: a tick, more may follow
    assert ticks.arrive(1.0) == pytest.approx(0.05)  # the instant before held two
    assert ticks.arrive(2.0) == pytest.approx(0.05 * 0.95)  # and the one before that, one
    assert ticks.share == pytest.approx(0.05 * 0.95)


def test_a_prompt_past_the_step_budget_pays_another_step() -> None:
    engine = _engine(decode_limit=200, decoding=100, context=100_000)
    ahead = [_waiter(4000), _waiter(4000)]  # 8,000 tokens: the budget is 8,092
    projection = _project(engine, ahead, _waiter(1000))
    step = H100.decode_step_ms(100, 100_000)
    chunks = 2 * H100.prefill_chunk_ms(0, 4000) + H100.prefill_chunk_ms(0, 1000)
    # By its second step the two ahead of it have had their first tokens: they decode too.
    grown = H100.decode_step_ms(102, 108_000)
    assert projection.ttft_s * 1000 == pytest.approx(chunks + step + grown)


def test_a_prompt_waits_for_a_prefill_slot() -> None:
    # Four prefill slots: four 1,000-token prompts share a step; the fifth is placed when
    # their first tokens free the slots, and prefills in the step after.
    engine = _engine(decode_limit=200, decoding=100, context=100_000, prefill_limit=4)
    projection = _project(engine, [_waiter() for _ in range(4)])
    step = H100.decode_step_ms(100, 100_000)
    chunk = H100.prefill_chunk_ms(0, 1000)
    first_four_ms = 4 * chunk + step
    assert projection.wait_s * 1000 == pytest.approx(first_four_ms)
    # Its step runs beside the batch the four have joined.
    grown = H100.decode_step_ms(104, 104_000)
    assert projection.ttft_s * 1000 == pytest.approx(first_four_ms + chunk + grown)


def test_the_safety_margin_of_a_waiting_request_is_on_its_wait() -> None:
    engine = _engine(decode_limit=200, decoding=100, context=100_000, prefill_limit=4)
    ahead = [_waiter() for _ in range(4)]
    typical = _project(engine, ahead, overhead_s=0.005)
    margin = SafetyMargin(own=Overruns(1.1))
    cautious = _project(engine, ahead, overhead_s=0.005, margin=margin)
    assert cautious.typical_s == typical.ttft_s == typical.typical_s
    assert typical.wait_s > 0.1 and typical.own_prefill_s > 0
    # The four prompts ahead are compute; the decode step they prefill beside depends on the
    # running batch, and counts with the seats (prior 2). The wait's error holds the own
    # prefill's: no caution on it apart. The two parts' cautions add root-sum-square.
    compute = 4 * H100.prefill_chunk_ms(0, 1000) / 1000
    assert typical.seat_s == pytest.approx(typical.wait_s - compute)
    wait_caution = math.hypot(0.5 * compute, 1.0 * typical.seat_s)
    assert cautious.ttft_s == pytest.approx(typical.ttft_s + wait_caution)


def test_the_safety_margin_of_a_request_that_hardly_waits_is_on_both_apart() -> None:
    engine = _engine(decode_limit=200, decoding=100, context=100_000, prefill_limit=4)
    ahead = [_waiter()]  # one prompt ahead: a wait under 5 % of the budget
    typical = _project(engine, ahead, overhead_s=0.005)
    margin = SafetyMargin(own=Overruns(1.1))
    cautious = _project(engine, ahead, overhead_s=0.005, margin=margin)
    assert 0 < typical.wait_s < 0.1 and typical.own_prefill_s > 0
    wait_caution = math.hypot(0.5 * (typical.wait_s - typical.seat_s), 1.0 * typical.seat_s)
    own_caution = 0.1 * typical.own_prefill_s
    # The two cautions add as independent errors do (root-sum-square), not as a sum.
    caution = math.hypot(wait_caution, own_caution)
    assert cautious.ttft_s == pytest.approx(typical.ttft_s + caution)
    assert caution < wait_caution + own_caution


def test_a_request_of_a_tick_is_judged_at_the_margins_tick_quantile() -> None:
    # Waits like this one have come from on time to 0.5 s late: a request decided with the
    # rest of its instant, while admission is not refusing, is judged at the 20th percentile
    # of that (under its typical first token); one alone at the median.
    engine = _engine(decode_limit=200, decoding=100, context=100_000, prefill_limit=4)
    ahead = [_waiter() for _ in range(4)]
    plain = _project(engine, ahead, overhead_s=0.005)
    margin = SafetyMargin()
    wait, own = plain.wait_s, plain.own_prefill_s
    for number in range(200):
        late = 0.5 * number / 200
        margin.observe(0.005, wait, own, 0.005 + wait + late + own, budget_s=2.0)
    alone = _project(engine, ahead, overhead_s=0.005, margin=margin)
    tick = _project(engine, ahead, overhead_s=0.005, margin=margin, company=True)
    assert tick.typical_s == alone.typical_s
    assert alone.ttft_s == pytest.approx(alone.typical_s)  # the median is the typical
    assert tick.ttft_s == pytest.approx(alone.typical_s - 0.3 * 0.5, abs=0.01)


def test_a_request_that_waits_for_nothing_gets_no_caution_on_a_wait() -> None:
    engine = _engine(decode_limit=8)
    margin = SafetyMargin(compute_late=Overruns(3.0), own=Overruns(1.0))
    projection = _project(engine, overhead_s=0.005, margin=margin)
    assert projection.wait_s == 0.0
    assert projection.ttft_s == projection.typical_s


def test_the_head_of_a_tick_knows_the_requests_behind_it_that_join_its_step() -> None:
    # Four prompts arrive in one instant and share one step: the first, knowing the three
    # behind it, is projected when that step ends, each of them adding its own compute to
    # it; nothing learned of ticks is needed for it.
    sizes = [1000, 2400, 2400, 2000]  # within one step's budget
    engine = _engine(decode_limit=8)
    plan = Plan([engine], OutputLengths(), now=0.0)
    before = plan.engines[0].backlog
    behind = [_waiter(tokens) for tokens in sizes[1:]]
    head = _project(engine, request=_waiter(sizes[0]), behind=behind, plan=plan)
    alone = _project(engine, request=_waiter(sizes[0]))
    joined = sum(H100.prefill_chunk_ms(0, tokens) for tokens in sizes[1:]) / 1000
    assert head.ttft_s == pytest.approx(alone.ttft_s + joined)
    assert plan.engines[0].backlog == before  # they were walked on a copy of the plan


def test_requests_behind_that_add_steps_delay_the_head_by_what_fits_in_its_step() -> None:
    # A long prompt behind fills the rest of the head's step and goes on in steps of its own:
    # the head waits for its step's room only, not for the long prompt's other steps.
    engine = _engine(decode_limit=8)
    head = _project(engine, request=_waiter(1000), behind=[_waiter(20_000)])
    alone = _project(engine, request=_waiter(1000))
    # The step's budget beside the one sequence placed (the head, which decodes next).
    room = H100.max_num_batched_tokens - 1 - 1000
    assert head.ttft_s == pytest.approx(alone.ttft_s + H100.prefill_per_token_ms * room / 1000)


def test_a_request_behind_whose_own_first_token_is_past_the_budget_is_not_walked() -> None:
    engine = _engine(decode_limit=8)
    alone = _project(engine, request=_waiter(1000))
    # 7,000 tokens behind it, in its step; with a budget under their own prefill, they are
    # taken to be refused and do not join it.
    joined = _project(engine, request=_waiter(1000), behind=[_waiter(7000)])
    refused = _project(engine, request=_waiter(1000), behind=[_waiter(7000)], budget_s=0.1)
    assert joined.ttft_s > alone.ttft_s
    assert refused.ttft_s == alone.ttft_s
