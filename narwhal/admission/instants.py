"""Requests that arrive in one instant are decided in turn, each knowing those behind it.

Traffic that comes in ticks (a batch client, a scheduler firing at the top of each second)
brings many requests at once. The engine prefills them first come, first served, but the first
of them share a prefill step with those behind them and get their first tokens when that step
ends: later with every prompt that joins it. A request decided the moment it arrives cannot
know the requests behind it; one decided once the router has read the rest of its instant can
(:func:`~narwhal.admission.predictor.project`, ``behind``).

So in predictive and shadow modes each sized request takes its turn in its instant (the Trio
clock's time when it reaches admission, :meth:`Instants.arrive`) before admission decides on it:

* it lets the router's other tasks run (Trio checkpoints, no wait on the clock) until one
  whole pass of the event loop brings no other request of its instant, or, once it has
  company, :data:`_QUIET` passes in a row (a tick's requests reach admission over a few passes,
  each read and sized in its own task);
* then it waits for the requests of its instant that arrived before it to be decided and
  queued (or placed), so that the queue's plan holds them when it is projected.

Its turn ends (:meth:`Turn.done`) once it is queued or placed, and however it ends before: a
request cancelled or refused while it waits or decides gives its turn up, and the requests
behind it never wait on it.

A request that finds its instant empty reads on only while ticks are expected (the router's
learned share of instants that held several requests, :class:`~narwhal.admission.predictor.
Ticks`, is above 0): real traffic's arrival times differ by microseconds at least, no two share
an instant, and its requests take their turns at once, at no cost. A request that finds others
of its instant before it always reads on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from narwhal.admission.queue import Waiter

__all__ = ["Instants", "Turn"]

_QUIET = 3
"""Passes of the event loop in a row without another request of a tick before its requests
are decided (the benchmark's ticks reach admission one pass apart, a long body a few more)."""


class _Instant:
    """The requests that arrived at one time, in order, and whose turn it is."""

    __slots__ = ("at", "finished", "lot", "next", "waiters")

    def __init__(self, at: float) -> None:
        self.at = at
        self.waiters: list[Waiter] = []
        self.next = 0  # the first whose turn has not ended
        self.finished: set[int] = set()
        self.lot = trio.lowlevel.ParkingLot()


class Turn:
    """One request's turn in its instant (:meth:`Instants.arrive`)."""

    __slots__ = ("_index", "_instant", "_over")

    def __init__(self, instant: _Instant, index: int) -> None:
        self._instant = instant
        self._index = index
        self._over = False

    @property
    def behind(self) -> list[Waiter]:
        """The requests of its instant that arrived after it, so far, in order."""
        return self._instant.waiters[self._index + 1 :]

    @property
    def alone(self) -> bool:
        """Whether it is the only request of its instant, so far."""
        return len(self._instant.waiters) == 1

    def done(self) -> None:
        """End the turn (idempotent): the next request of the instant may be decided."""
        if self._over:
            return
        self._over = True
        instant = self._instant
        instant.finished.add(self._index)
        while instant.next in instant.finished:
            instant.finished.discard(instant.next)
            instant.next += 1
        instant.lot.unpark_all()


class Instants:
    """The requests of the current instant, decided in the order they arrived."""

    __slots__ = ("_current",)

    def __init__(self) -> None:
        self._current: _Instant | None = None

    async def arrive(self, waiter: Waiter, *, expect_company: bool = True) -> Turn:
        """Join the current instant and wait for this request's turn.

        ``expect_company`` false (no instant has held several requests lately): a request that
        finds its instant empty takes its turn at once, without letting the event loop run;
        one that finds others of its instant before it reads on and waits all the same.

        The caller must end the turn (:meth:`Turn.done`) however it goes on, in a ``finally``:
        a cancellation while waiting ends it here.
        """
        now = trio.current_time()
        instant = self._current
        if instant is None or instant.at != now:
            instant = self._current = _Instant(now)
        index = len(instant.waiters)
        instant.waiters.append(waiter)
        turn = Turn(instant, index)
        if not index and not expect_company:
            return turn  # its turn is its own at once: nothing to wait for
        try:
            # The rest of the instant is read meanwhile: one whole pass without another of
            # its requests when it is alone, _QUIET in a row once it has company.
            await trio.lowlevel.checkpoint()
            seen, quiet = len(instant.waiters), 0
            while quiet < (_QUIET if seen > 1 else 1):
                await trio.lowlevel.checkpoint()
                quiet = quiet + 1 if seen == len(instant.waiters) else 0
                seen = len(instant.waiters)
            while instant.next < index:
                await instant.lot.park()
        except BaseException:
            turn.done()
            raise
        return turn
