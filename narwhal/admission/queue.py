"""The admission queue: a bounded memory channel to one dispatcher, beside a record of who waits.

A request that passed admission is enqueued with ``send_nowait`` (a full queue is an immediate
429) and waits for the dispatcher's decision under two cancel scopes: the admission wait, which
:meth:`AdmissionQueue.wait_for_placement` opens, inside the request deadline, which the caller
opened when the request arrived. The dispatcher, a task in the app's nursery,
takes requests in arrival order and places each as soon as an engine has a free prefill slot
and decode headroom, choosing the engine with the earliest predicted first token. When no
engine is eligible at all, every queued request that cannot be served gets its 503 at once.

A channel cannot be inspected, and the TTFT projection needs the work ahead, so the queue also
keeps an ordered record of the live, unplaced requests (the one the dispatcher holds included).
``queue_limit`` counts that record: a request that leaves (its client went away, its wait ran
out) stops counting at once, even while its entry still sits in the channel.

Placement honours the engines' context length (:mod:`narwhal.admission.context`): a request
goes only to an engine whose context holds its prompt, and a prompt longer than every eligible
engine's context does not queue at all: it is placed at once on the engine with the longest
context, which refuses it with its own 400 (or serves it, if the prompt was sized too long).
Waiting could not change that answer, and such a request at the head of the queue would hold up
everyone behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from narwhal.admission.context import beyond_context, placed_size, too_short
from narwhal.errors import CapacityRejection, Expired, NarwhalError, Unavailable
from narwhal.scheduling.engines import Engine, EnginePool, Slot

__all__ = ["AdmissionQueue", "QueueStatistics", "Waiter"]


@attrs.define(eq=False)
class Waiter:
    """One request waiting for placement.

    Attributes:
        prompt_tokens: the sized prompt.
        need_token_ids: only engines that provide token IDs may take it.
        enqueued_at: Trio clock time of enqueueing.
        decided: set once the dispatcher placed or refused the request.
        slot: the placement, until the request takes it.
        failure: the refusal, if the dispatcher refused.
        withdrawn: the request left the queue (placed, expired or cancelled).
    """

    prompt_tokens: int
    need_token_ids: bool
    route: str = "chat"
    max_tokens: int | None = None
    enqueued_at: float = attrs.field(factory=trio.current_time)
    decided: trio.Event = attrs.field(factory=trio.Event)
    slot: Slot | None = None
    failure: NarwhalError | None = None
    withdrawn: bool = False


@attrs.frozen
class QueueStatistics:
    """A snapshot of the admission queue.

    ``placed_over_context`` counts the placements of prompts longer than every eligible
    engine's context (placed at once, for the engine to refuse).
    """

    depth: int
    limit: int
    enqueued: int
    placed: int
    refused_unavailable: int
    placed_over_context: int


class AdmissionQueue:
    """The queue and its dispatcher.

    Args:
        pool: the engines to place on.
        limit: ``admission.queue_limit``.
    """

    def __init__(self, pool: EnginePool, limit: int) -> None:
        self.pool = pool
        self.limit = limit
        # Withdrawn entries stay in the channel until the dispatcher drops them; the slack keeps
        # them from blocking live ones. The record, not the channel, enforces the limit.
        self._send, self._receive = trio.open_memory_channel[Waiter](2 * limit)
        self._waiting: dict[Waiter, None] = {}
        self._enqueued = 0
        self._placed = 0
        self._unavailable = 0
        self._placed_over = 0

    # -- the request's side ---------------------------------------------------------------------

    def waiting(self) -> list[Waiter]:
        """The live, unplaced requests, in arrival order."""
        return list(self._waiting)

    def place_now(self, waiter: Waiter) -> Slot | None:
        """Place at once when nobody waits and an engine has room: the queue's order holds.

        Saves the hop through the dispatcher on an unloaded router. A prompt longer than every
        eligible engine's context is placed at once whoever waits.
        """
        slot = self._over_context(waiter)
        if slot is None and not self._waiting:
            engine = self._best(waiter)
            slot = None if engine is None else _take(engine, waiter)
        if slot is not None:
            self._enqueued += 1
            self._placed += 1
        return slot

    def _best(self, waiter: Waiter) -> Engine | None:
        """The engine to place ``waiter`` on now, among those whose context holds its prompt."""
        return self.pool.best(
            waiter.prompt_tokens,
            exclude=too_short(self.pool, waiter.prompt_tokens),
            need_token_ids=waiter.need_token_ids,
        )

    def _over_context(self, waiter: Waiter) -> Slot | None:
        """A place for a prompt longer than every eligible engine's context, else ``None``."""
        engine = beyond_context(self.pool, waiter.prompt_tokens, waiter.need_token_ids)
        if engine is None:
            return None
        self._placed_over += 1
        return _take(engine, waiter, placed_size(engine, waiter.prompt_tokens))

    @asynccontextmanager
    async def placement(self, waiter: Waiter, wait_s: float) -> AsyncIterator[Slot]:
        """The request's slot while the block runs, given back at exit however it ends.

        Places at once when nobody waits and an engine has room, else queues and waits at most
        ``wait_s`` for the dispatcher.

        Raises:
            CapacityRejection: the queue is full.
            Expired: ``admission_wait_expired``.
            Unavailable: no engine is eligible.
        """
        slot = self.place_now(waiter)
        if slot is None:
            self.enqueue(waiter)
            slot = await self.wait_for_placement(waiter, wait_s)
        with slot:
            yield slot

    def enqueue(self, waiter: Waiter) -> None:
        """Join the queue without waiting.

        Raises:
            CapacityRejection: the queue is full (429 ``admission_queue_full``).
        """
        if len(self._waiting) >= self.limit:
            raise _queue_full()
        try:
            self._send.send_nowait(waiter)
        except trio.WouldBlock:
            raise _queue_full() from None
        self._waiting[waiter] = None
        self._enqueued += 1

    async def wait_for_placement(self, waiter: Waiter, wait_s: float) -> Slot:
        """Wait at most ``wait_s`` for the dispatcher's decision; return the placement.

        Whatever ends the wait (expiry, refusal, cancellation), the waiter leaves the queue and
        a placement it did not take is given back.

        Raises:
            Expired: ``admission_wait_expired``, at exactly ``wait_s`` after enqueueing.
            Unavailable: no engine is eligible.
        """
        try:
            with trio.move_on_at(waiter.enqueued_at + wait_s):
                await waiter.decided.wait()
            if waiter.slot is not None:
                slot, waiter.slot = waiter.slot, None
                return slot
            if waiter.failure is not None:
                raise waiter.failure
            raise Expired(
                f"No engine could take the request within the admission wait of {wait_s:g} s.",
                code="admission_wait_expired",
            )
        finally:
            self.withdraw(waiter)

    def withdraw(self, waiter: Waiter) -> None:
        """Leave the queue (idempotent); give back a placement that was not taken."""
        if waiter.withdrawn:
            return
        waiter.withdrawn = True
        self._waiting.pop(waiter, None)
        if waiter.slot is not None:
            waiter.slot.release()
            waiter.slot = None
        self.pool.notify()  # the dispatcher may be holding this one

    # -- the dispatcher -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Place queued requests in order, forever (run it in the app's nursery)."""
        task_status.started()
        async for waiter in self._receive:
            while not (waiter.withdrawn or waiter.decided.is_set()):
                if not self.pool.any_eligible(need_token_ids=waiter.need_token_ids):
                    self._refuse_unservable()
                    break
                # The engine that held its prompt may have left: it may be over context now.
                slot = self._over_context(waiter)
                if slot is None:
                    engine = self._best(waiter)
                    slot = None if engine is None else _take(engine, waiter)
                if slot is not None:
                    self._decide(waiter, slot=slot)
                    self._placed += 1
                    break
                await self.pool.wait_changed()

    def _decide(
        self, waiter: Waiter, *, slot: Slot | None = None, failure: NarwhalError | None = None
    ) -> None:
        self._waiting.pop(waiter, None)
        waiter.slot = slot
        waiter.failure = failure
        waiter.decided.set()

    def _refuse_unservable(self) -> None:
        for waiter in list(self._waiting):
            if not self.pool.any_eligible(need_token_ids=waiter.need_token_ids):
                self._unavailable += 1
                self._decide(
                    waiter,
                    failure=Unavailable(
                        "No engine is eligible to serve this request; retry shortly."
                    ),
                )

    def close(self) -> None:
        """Stop the dispatcher (shutdown)."""
        self._send.close()

    def statistics(self) -> QueueStatistics:
        """A frozen snapshot."""
        return QueueStatistics(
            depth=len(self._waiting),
            limit=self.limit,
            enqueued=self._enqueued,
            placed=self._placed,
            refused_unavailable=self._unavailable,
            placed_over_context=self._placed_over,
        )


def _take(engine: Engine, waiter: Waiter, tokens: int | None = None) -> Slot:
    size = waiter.prompt_tokens if tokens is None else tokens
    return Slot.take(engine, size, route=waiter.route, max_tokens=waiter.max_tokens)


def _queue_full() -> CapacityRejection:
    return CapacityRejection(
        "The admission queue is full; retry shortly.", code="admission_queue_full"
    )
