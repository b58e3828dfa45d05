"""Requests of one instant are decided in turn, each knowing those behind it
(narwhal.admission.instants)."""

from __future__ import annotations

import trio
import trio.testing

from narwhal.admission.instants import Instants, Turn
from narwhal.admission.queue import Waiter


def _waiters(count: int) -> list[Waiter]:
    return [Waiter(1000 + n, False, "chat", None, enqueued_at=0.0) for n in range(count)]


def _numbers(waiters: list[Waiter], some: list[Waiter]) -> list[int]:
    return [next(n for n, w in enumerate(waiters) if w is waiter) for waiter in some]


async def test_a_tick_is_decided_in_arrival_order_each_knowing_those_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Four requests of one instant reach admission one pass of the event loop apart (each is
    # read in its own task); each is decided after those before it, knowing all behind it.
    instants = Instants()
    waiters = _waiters(4)
    decided: list[tuple[int, list[int], float]] = []

    async def request(number: int) -> None:
        for _ in range(number):
            await trio.lowlevel.checkpoint()
        turn = await instants.arrive(waiters[number])
        try:
            decided.append((number, _numbers(waiters, turn.behind), trio.current_time()))
        finally:
            turn.done()

    async with trio.open_nursery() as nursery:
        for number in range(4):
            nursery.start_soon(request, number)
    assert decided == [(0, [1, 2, 3], 0.0), (1, [2, 3], 0.0), (2, [3], 0.0), (3, [], 0.0)]


async def test_a_request_alone_in_its_instant_waits_for_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    instants = Instants()
    first, second = _waiters(2)
    turn = await instants.arrive(first)
    assert turn.behind == []
    turn.done()
    await trio.sleep(1.0)  # a later instant: a new tick
    turn = await instants.arrive(second)
    assert turn.behind == []
    assert trio.current_time() == 1.0
    turn.done()


async def test_a_request_that_gives_up_its_turn_does_not_hold_those_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The first of a tick holds its turn (deciding), the second is cancelled while it waits
    # for its turn: once the first is done, the third is decided, and nobody waits on the
    # cancelled one.
    instants = Instants()
    waiters = _waiters(3)
    turns: dict[int, Turn] = {}
    third_decided = trio.Event()

    async def request(number: int) -> None:
        for _ in range(number):
            await trio.lowlevel.checkpoint()
        turn = await instants.arrive(waiters[number])
        try:
            turns[number] = turn
            if number == 2:
                third_decided.set()
            else:
                await trio.sleep(1.0)  # the first holds its turn a while
        finally:
            turn.done()

    async def cancellable(scope: trio.CancelScope) -> None:
        with scope:
            await request(1)

    second = trio.CancelScope()
    with trio.fail_after(10):  # a turn never given up would hold the third for ever
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, 0)
            nursery.start_soon(cancellable, second)
            nursery.start_soon(request, 2)
            await trio.sleep(0.5)
            assert set(turns) == {0}  # the others wait for the first
            second.cancel()
            await third_decided.wait()
            assert trio.current_time() == 1.0  # as soon as the first is done
            assert set(turns) == {0, 2}


async def test_a_request_takes_its_turn_at_once_while_no_tick_is_expected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # No tick seen lately: the first of an instant does not let the event loop run (real
    # traffic pays nothing); a second of the same instant still reads on and waits its turn.
    instants = Instants()
    first, second = _waiters(2)
    ran: list[str] = []
    later: list[Turn] = []

    async def other() -> None:
        ran.append("other")

    async def arrive_second() -> None:
        later.append(await instants.arrive(second, expect_company=False))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        turn = await instants.arrive(first, expect_company=False)
        assert ran == []  # the event loop did not run
        nursery.start_soon(arrive_second)
        await trio.testing.wait_all_tasks_blocked()
        assert later == [] and turn.behind == [second]  # it waits for the first's turn
        turn.done()
    assert len(later) == 1 and later[0].behind == []
    assert trio.current_time() == 0.0
