"""The Trio shell of the continuous-batching model: a step loop over a :class:`Batcher`.

One system task per Trio run (started by the first request of the run) plans a step, sleeps its
cost (:meth:`StepTiming.step_s` times the slowdown in force when the step starts), completes it
and wakes the streams whose awaited output step has come. With nothing to do it waits on an
event, never on a timer, so ``MockClock(autojump_threshold=0)`` can jump. An engine used in a
second Trio run forgets the requests of the first (their streams died with it) and starts a new
task there.

A :class:`StepLedger` set on the loop (:meth:`narwhal.sim.SimEngine.watch_steps`) is told of every
request submitted (with its ``X-Request-Id``, when it came with one) and of every step when it has
run (its start and its engine time), before its sequences advance: the benchmark's account of the
engine time each request was given (in virtual time the benchmark's own; in a ``narwhal sim
--ledger`` process :class:`narwhal.sim.ledger.SimLedger`). Unset (the default) it costs one test
per step and per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio

from narwhal.sim.batching import Batcher, BatchSeq, BatchStep
from narwhal.sim.timing import StepTiming

__all__ = ["StepLedger", "StepLoop"]


class StepLedger(Protocol):
    """What a step loop tells an observer of the engine time it spends (see the module doc)."""

    def submitted(self, seq: BatchSeq, request_id: str | None) -> None:
        """``seq`` joined the loop's queue (called in the submitting task); ``request_id`` is
        the ``X-Request-Id`` its request came with (``None``: none)."""
        ...

    def stepped(self, step: BatchStep, start: float, duration_s: float) -> None:
        """``step`` ran from Trio time ``start`` for ``duration_s`` seconds of engine time (its
        cost, scale, jitter and slowdown); its sequences have not advanced yet."""
        ...


class StepLoop:
    """Runs a :class:`Batcher` in Trio time.

    Attributes:
        timing: the step costs' scale and jitter.
        batcher: the scheduler state.
        pace: the slowdown in force, asked as each step starts (it multiplies the step's time).
        ledger: told of every request and step (None: nobody is).
    """

    def __init__(
        self,
        timing: StepTiming,
        *,
        kv_capacity_tokens: int | None,
        name: str,
        pace: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.timing = timing
        if kv_capacity_tokens is None:
            self.batcher = Batcher(timing.profile)
        else:
            self.batcher = Batcher(timing.profile, kv_capacity_tokens)
        self.pace = pace
        self.ledger: StepLedger | None = None
        self._name = name
        self._run: trio.lowlevel.TrioToken | None = None
        self._wake: trio.Event | None = None
        self._waiters: dict[int, tuple[int, trio.Event]] = {}

    def submit(
        self, prompt_tokens: int, output_tokens: int, request_id: str | None = None
    ) -> BatchSeq:
        """Queue a request for the batch (and start the loop if this run has none yet);
        ``request_id`` tags it for the ledger."""
        self._attach()
        seq = self.batcher.submit(prompt_tokens, output_tokens)
        if self.ledger is not None:
            self.ledger.submitted(seq, request_id)
        if self._wake is not None:
            self._wake.set()
        return seq

    def abort(self, seq: BatchSeq) -> None:
        """Take ``seq`` out of the batch or the queue; a stream waiting on it wakes."""
        self.batcher.abort(seq)
        waiter = self._waiters.pop(seq.id, None)
        if waiter is not None:
            waiter[1].set()

    async def wait_for(self, seq: BatchSeq, step: int) -> None:
        """Return once ``seq`` has completed output step ``step`` (or left the batcher)."""
        if seq.emitted >= step or seq.done:
            return
        self._attach()
        event = trio.Event()
        self._waiters[seq.id] = (step, event)
        try:
            await event.wait()
        finally:
            if self._waiters.get(seq.id, (0, None))[1] is event:
                del self._waiters[seq.id]

    def _attach(self) -> None:
        try:
            run = trio.lowlevel.current_trio_token()
        except RuntimeError:  # outside Trio: the loop starts when someone waits
            return
        if run is self._run:
            return
        if self._run is not None:
            self.batcher.clear()
            self._waiters.clear()
        self._run = run
        self._wake = trio.Event()
        trio.lowlevel.spawn_system_task(self._loop, run, name=f"narwhal.sim steps {self._name}")

    async def _loop(self, run: trio.lowlevel.TrioToken) -> None:
        batcher = self.batcher
        while self._run is run:
            step = batcher.next_step()
            if step is None:
                self._wake = wake = trio.Event()
                await wake.wait()
                continue
            duration = self.timing.step_s(step.cost_ms, step.index) * self.pace()
            start = trio.current_time()
            await trio.sleep(duration)
            if self.ledger is not None:
                self.ledger.stepped(step, start, duration)
            waiters = self._waiters
            for seq in batcher.complete(step):
                waiter = waiters.get(seq.id)
                if waiter is not None and seq.emitted >= waiter[0]:
                    del waiters[seq.id]
                    waiter[1].set()
