"""One placement rule for the dispatcher and the projection (narwhal.admission.plan).

Each queued request goes, in order, to the engine where its first token would come earliest,
waiting for that engine when it is full; a request behind it whose own engine has room goes
ahead; the TTFT projection replays exactly that.
"""

from __future__ import annotations

import random
from typing import Any, cast

import attrs
import pytest
import trio
import trio.testing

from narwhal.admission.plan import Plan
from narwhal.admission.predictor import project
from narwhal.admission.queue import AdmissionQueue, Waiter
from narwhal.config import EngineConfig
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.lengths import OutputLengths
from narwhal.scheduling.profiles import PROFILES

H100 = PROFILES["h100-llama3-8b"]
SLOW = 20.0  # the slow engine's compute is 20 times its profile's


def _engine(name: str, *, scale: float = 1.0, context: int | None = None) -> Engine:
    forecast = PrefillForecast(H100, prefill_limit=1, scale=scale)
    engine = Engine(
        EngineConfig(name=name, url="http://127.0.0.1:1"),
        client=cast(Any, None),
        prefill_limit=1,
        decode_limit=64,
        forecast=forecast,
    )
    if context is not None:
        engine.model_card = {"id": "m", "max_model_len": context}
    engine.poll_succeeded(0.0)
    return engine


def _pool() -> tuple[EnginePool, Engine, Engine]:
    fast, slow = _engine("fast"), _engine("slow", scale=SLOW)
    return EnginePool([fast, slow]), fast, slow


def _waiter(tokens: int = 4000) -> Waiter:
    return Waiter(tokens, False, "chat", 64, enqueued_at=trio.current_time())


def _busy(engine: Engine, tokens: int = 1000) -> Slot:
    """A request in prefill on ``engine``: its one prefill slot is taken."""
    return Slot.take(engine, tokens, max_tokens=64)


def _placed_on(waiter: Waiter) -> str | None:
    return None if waiter.slot is None else waiter.slot.engine.name


async def test_a_request_waits_for_the_engine_where_its_first_token_comes_earliest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, fast, slow = _pool()
    queue = AdmissionQueue(pool, 16)
    held = _busy(fast)
    ahead, behind = _waiter(), _waiter()
    queue.enqueue(ahead)
    queue.enqueue(behind)
    look_again_at = queue.dispatch()
    # The slow engine is free, but its 4,000-token prefill takes 20 times the fast one's:
    # both wait for the fast engine's prefill slot, expected at the busy request's first token.
    assert _placed_on(ahead) is None and _placed_on(behind) is None
    assert not slow.slots
    assert look_again_at == pytest.approx(held.expected_first_token_at)
    held.to_decode()
    queue.dispatch()
    assert _placed_on(ahead) == "fast" and _placed_on(behind) is None


async def test_a_request_behind_goes_ahead_when_its_own_engine_has_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fast, slow = _engine("fast", context=8192), _engine("slow", scale=SLOW, context=32768)
    queue = AdmissionQueue(EnginePool([fast, slow]), 16)
    _busy(fast)
    ahead, long_prompt = _waiter(), _waiter(16_000)  # only the slow engine holds 16,000 tokens
    queue.enqueue(ahead)
    queue.enqueue(long_prompt)
    queue.dispatch()
    assert _placed_on(ahead) is None
    assert _placed_on(long_prompt) == "slow"


async def test_the_projection_replays_the_dispatchers_choices(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, fast, _slow = _pool()
    queue = AdmissionQueue(pool, 16)
    _busy(fast)
    queued = [_waiter() for _ in range(6)]
    for waiter in queued:
        queue.enqueue(waiter)
    queue.dispatch()
    newcomer = _waiter()
    projection = project(
        pool,
        queue.waiting(),
        newcomer,
        OutputLengths(),
        now=trio.current_time(),
        elapsed_s=0.0,
        overhead_s=0.0,
    )
    assert projection is not None
    # The replay puts the newcomer where the dispatcher, walking the same plan, would.
    plan = queue.plan()
    for waiter in queue.waiting():
        plan.place(waiter)
    chosen = plan.choose(newcomer)
    assert chosen is not None and projection.engine == chosen.engine.name
    # Six requests queue for the fast engine, one prefill at a time, and the newcomer after
    # them: all of that is still sooner than one prefill on the slow engine.
    one_fast = H100.prefill_ms(4000) / 1000
    one_slow = SLOW * H100.prefill_ms(4000) / 1000
    assert 6 * one_fast < one_slow
    placed = [_placed_on(waiter) for waiter in queued]
    assert placed == [None] * 6
    assert projection.engine == "fast"


async def test_an_engine_that_stays_busy_past_its_expected_time_loses_the_request(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    pool, fast, _slow = _pool()
    queue = AdmissionQueue(pool, 16)
    held = _busy(fast)  # it never gets its first token
    await nursery.start(queue.run)
    waiter = _waiter()
    queue.enqueue(waiter)
    with trio.fail_after(60):
        await waiter.decided.wait()
    assert _placed_on(waiter) == "slow"
    # A first token already late is expected as late again, so the longer the fast engine
    # overruns, the later the dispatcher expects it, and the request goes to the slow engine
    # soon after waiting for the fast one would take longer than the slow one's prefill.
    expected = held.expected_first_token_at
    own_fast = H100.prefill_ms(4000) / 1000
    breakeven = expected + (SLOW - 1) * own_fast
    assert breakeven < trio.current_time() < breakeven + 0.1 + (breakeven - expected)
    queue.close()


async def test_an_engine_that_frees_sooner_than_planned_takes_the_waiting_request(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    # A slow engine that is free keeps the dispatcher walking the plan; nobody goes there.
    a, b, slow = _engine("a"), _engine("b"), _engine("slow", scale=SLOW)
    pool = EnginePool([a, b, slow])
    queue = AdmissionQueue(pool, 16)
    _busy(a, 4000)  # its prefill slot frees at its first token, in about 0.15 s
    late = _busy(b, 8000)  # expected to keep its slot more than twice as long
    walks = 0
    walk = queue.plan

    def counted() -> Plan:
        nonlocal walks
        walks += 1
        return walk()

    queue.plan = counted  # type: ignore[method-assign]
    await nursery.start(queue.run)
    waiter = _waiter()
    queue.enqueue(waiter)
    await trio.testing.wait_all_tasks_blocked()
    assert waiter.planned is not None and waiter.planned.engine is a
    await trio.sleep(0.05)
    # The slow engine is free and the plan knew it: no reason to walk the plan again.
    assert walks == 1
    late.to_decode()  # b's first token came long before it was expected: b has room now
    freed_at = trio.current_time()
    with trio.fail_after(1):
        await waiter.decided.wait()
    # Not at a's planned time, nor at the plan's next refresh: the dispatcher saw that b had
    # room that the plan did not expect, walked the plan again and placed the request there.
    assert _placed_on(waiter) == "b"
    assert trio.current_time() == pytest.approx(freed_at + 0.005)
    queue.close()


async def test_a_drifting_engine_counts_its_time_as_longer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first, second = _engine("first"), _engine("second")
    queue = AdmissionQueue(EnginePool([first, second]), 16)
    plan = queue.plan()
    assert (chosen := plan.choose(_waiter())) is not None and chosen.engine is first  # a tie
    for _ in range(20):  # its first tokens come at twice their predicted time
        first.observe_ttft(0.2, 0.1)
    assert first.placement_penalty > 1.5
    slot = queue.place_now(_waiter())
    assert slot is not None and slot.engine is second


async def test_the_queue_tells_how_far_its_waiters_overran_their_projected_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, _fast, _slow = _pool()
    queue = AdmissionQueue(pool, 16)
    assert queue.overrun(trio.current_time(), 0.1) == 0.0
    late, short, unprojected = _waiter(), _waiter(), _waiter()
    late.projected_wait_s, short.projected_wait_s = 1.0, 0.05
    for waiter in (late, short, unprojected):
        queue.enqueue(waiter)
    await trio.sleep(1.5)
    # Only waits projected at the floor or above count: 1.5 s waited for a 1 s projection.
    assert queue.overrun(trio.current_time(), 0.1) == pytest.approx(1.5)


async def test_a_request_that_leaves_the_queue_lets_go_of_the_plan(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, fast, _slow = _pool()
    queue = AdmissionQueue(pool, 16)
    held = _busy(fast)
    placed, withdrawn = _waiter(), _waiter()
    queue.enqueue(placed)
    queue.enqueue(withdrawn)
    queue.dispatch()
    assert placed.planned is not None and withdrawn.planned is not None
    held.to_decode()
    queue.dispatch()
    queue.withdraw(withdrawn)
    # Running requests keep their waiter for as long as they stream: it must not pin a plan.
    assert placed.slot is not None and placed.planned is None
    assert withdrawn.planned is None


async def test_a_newcomer_does_not_take_the_room_a_waiting_request_is_planned_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, fast, _slow = _pool()
    queue = AdmissionQueue(pool, 16)
    held = _busy(fast)
    waiting = _waiter()
    queue.enqueue(waiting)
    queue.dispatch()
    assert waiting.planned is not None and waiting.planned.engine is fast
    held.to_decode()  # the fast engine has room: the dispatcher will place the waiting one
    assert queue.place_now(_waiter()) is None
    queue.dispatch()
    assert _placed_on(waiting) == "fast"


async def test_an_engine_given_more_than_its_batch_holds_teaches_nothing_of_its_speed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Three requests on an engine whose batch holds two: it queues one itself, and the times it
    # is seen to take are that queue's, which the forecast does not model.
    small = attrs.evolve(H100, max_num_seqs=2)
    engine = Engine(
        EngineConfig(name="small", url="http://127.0.0.1:1"),
        client=cast(Any, None),
        prefill_limit=4,
        decode_limit=8,
        forecast=PrefillForecast(small, prefill_limit=4),
    )
    engine.poll_succeeded(0.0)
    slots = [Slot.take(engine, 100, max_tokens=64) for _ in range(3)]
    assert engine.overcommitted
    await trio.sleep(10.0)  # ten times any predicted first token
    for slot in slots:
        slot.to_decode()
        slot.observe_gap(1.0, 1)  # a second per token: far slower than predicted
    assert engine.forecast.decode_scale == 1.0
    assert engine.forecast.scale == 1.0 and engine.forecast.latency_s == 0.0
    assert engine.drift.ttft.samples == 0
    slots[0].release()
    assert not engine.overcommitted
    slots[1].observe_gap(1.0, 1)  # two left: the batch holds them, the gap teaches
    assert engine.forecast.decode_scale > 1.0


async def test_the_walk_skips_only_engines_that_cannot_win(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Plan.choose asks an engine's forecast only when its earliest possible first token could
    # still beat the best found: on loaded pools of unequal engines, it must choose exactly as
    # asking every engine would.
    rng = random.Random(7)
    for _ in range(20):
        engines = [_engine(f"e{n}", scale=rng.choice([0.5, 1.0, 1.0, 3.0])) for n in range(4)]
        for engine in engines:
            for _ in range(rng.randrange(0, 40)):
                slot = Slot.take(engine, rng.randrange(50, 6000), max_tokens=64)
                if rng.random() < 0.8:
                    slot.to_decode()
        lengths = OutputLengths()
        waiters = [_waiter(rng.randrange(20, 8000)) for _ in range(30)]
        plan = Plan(engines, lengths, now=trio.current_time(), tpot_target_s=0.1)
        for waiter in waiters:
            chosen = plan.choose(waiter)
            every = [
                (p.tpot_with(waiter.prompt_tokens) > 0.1, p.first_token(waiter.prompt_tokens), n)
                for n, p in enumerate(plan.engines)
            ]
            assert chosen is plan.engines[min(every)[2]]
            plan.place(waiter)


async def test_the_dispatcher_refuses_only_what_no_eligible_engine_can_serve() -> None:
    # Neither engine provides token IDs: a request that needs them is refused at the next
    # pass, while one that does not waits for its engine.
    pool, fast, slow = _pool()
    _busy(fast), _busy(slow)
    queue = AdmissionQueue(pool, 8, OutputLengths())
    needs = Waiter(4000, True, "chat", 64, enqueued_at=trio.current_time())
    plain = _waiter()
    queue.enqueue(needs)
    queue.enqueue(plain)
    queue.dispatch()
    assert needs.decided.is_set() and needs.slot is None
    assert needs.failure is not None and "No engine is eligible" in needs.failure.message
    assert not plain.decided.is_set()
    assert queue.statistics().refused_unavailable == 1
    # Once an engine provides token IDs, such a request waits like any other.
    fast.token_accounting = "token_ids"
    again = Waiter(4000, True, "chat", 64, enqueued_at=trio.current_time())
    queue.enqueue(again)
    queue.dispatch()
    assert not again.decided.is_set()
    assert queue.statistics().refused_unavailable == 1
