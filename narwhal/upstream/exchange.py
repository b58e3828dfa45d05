"""One request's conversation with the engines, up to and after response headers.

Before headers, Narwhal may still change its mind: a connection error, an engine 5xx, an in-band
error frame (but one whose ``code`` is a 4xx), a token-ID violation or a malformed event is
retried once on a different eligible engine, else the client gets a 502 that tells it not to
retry (``x-should-retry: false``: Narwhal's own retry is spent; docs: Request lifecycle). Events
read before the decision are held and flushed right after the headers. An engine's 503 (it
refuses new work, as vLLM's queue limits do) is retried the same way, but not counted against the
engine (:class:`~narwhal.errors.EngineBusy`).

The engine's 4xx, as an HTTP answer or as an in-band error frame whose ``code`` is a 4xx status
(vLLM checks some parameters only once the stream has begun), is the client's error: it is
raised as :class:`~narwhal.errors.EngineRejectedRequest` whenever it comes, never retried, and
never counted against the engine.

The module holds no deadlines: the caller opens the request's cancel scopes around these calls.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TypeVar

import attrs
import trio

from narwhal.admission.context import too_short
from narwhal.errors import (
    EngineAttemptsFailed,
    EngineBusy,
    EngineError,
    EngineRejectedRequest,
    EngineResponseError,
    UpstreamFailure,
)
from narwhal.protocol.chunks import Exposure
from narwhal.protocol.requests import CompletionRequest
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.upstream.client import ChunkEvent, ErrorFrameEvent, UpstreamStream
from narwhal.upstream.dialects import plan_upstream
from narwhal.upstream.health import open_stream, record_failure

__all__ = [
    "AFTER_COMPLETE_S",
    "Exchange",
    "Measurements",
    "open_exchange",
    "with_one_retry",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

AFTER_COMPLETE_S = 0.25
"""How long the end of a complete answer (``[DONE]``) is waited for before it is ended anyway.

Engines send ``[DONE]`` right after the usage chunk; waiting for it lets the connection go back
to the pool. An engine that idles instead holds its connection (and a pool slot) no longer."""


@attrs.define
class Measurements:
    """What a request taught us: TTFT, inter-token gaps, output tokens (by ID where known).

    ``predicted_ttft`` is the forecast at placement (from arrival). ``gaps`` holds one entry
    per network read that carried output after the first: ``(gap, events)``, the time since
    the last output and how many output events came with it (the first of them ``gap`` after
    the last output, the others with it, zero apart).
    """

    arrival: float
    on_first_output: Callable[[float], None] | None = None  # called with the TTFT
    first_output_at: float | None = None
    last_output_at: float | None = None
    output_tokens: int = 0
    output_events: int = 0
    predicted_ttft: float | None = None
    prompt_tokens_reported: int | None = None
    completion_tokens_reported: int | None = None
    usage_seen: bool = False
    gaps: list[tuple[float, int]] = attrs.field(factory=list)
    answered_at: float | None = None  # a non-streaming answer's arrival (no first token seen)

    @property
    def ttft(self) -> float | None:
        """Arrival to the first output event."""
        return None if self.first_output_at is None else self.first_output_at - self.arrival

    @property
    def end_to_end(self) -> float | None:
        """Arrival to a non-streaming answer (:mod:`narwhal.upstream.whole`)."""
        return None if self.answered_at is None else self.answered_at - self.arrival

    def count_usage(self, usage: object) -> None:
        """Take the prompt and output sizes an engine's usage object reports."""
        self.usage_seen = True
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens")
            if type(prompt) is int and prompt > 0:
                self.prompt_tokens_reported = prompt
            completion = usage.get("completion_tokens")
            if type(completion) is int and completion >= 0:
                self.completion_tokens_reported = completion


@attrs.define(eq=False)
class Exchange:
    """An open upstream stream on the engine that will answer, with its held events.

    Each chunk is observed as it is taken (:meth:`observe`); what the chunks of one network
    read teach the slot and its engine's forecast (the gap before them, the tokens they
    carried, the step they ended) is applied once, for the read, by :meth:`settle`, which
    :meth:`next_ready` and :meth:`next_chunk` call when a read is next.
    """

    request: CompletionRequest
    engine: Engine
    stream: UpstreamStream
    exposure: Exposure
    slot: Slot
    measurements: Measurements
    held: list[ChunkEvent] = attrs.field(factory=list)
    finished: bool = False
    # The read being observed, until settled: when its first chunk was taken (``None``: no
    # chunk since the last settle), the gap before its output events, their count (each
    # after a previous output) and tokens (at least one each), and the tokens it generated.
    _read_at: float | None = None
    _gap_s: float = 0.0
    _gap_events: int = 0
    _gap_tokens: int = 0
    _asked_at: float = -math.inf  # when the relay last asked for a chunk that needs a read
    _gap_held: bool = False  # the gap was mostly the relay's time away (a slow client's)
    _generated: int = 0

    def observe(self, event: ChunkEvent) -> None:
        """Record what a chunk tells us: the first output (prefill -> decode), gaps, tokens.

        Runs once per chunk, kept to counting: the slot and the forecast learn once per
        read (:meth:`settle`). The first output event is the exception: the slot turns to
        decode (and the TTFT is taught) at once.
        """
        facts = event.facts
        tokens = facts.token_ids
        measured = self.measurements
        now = self._read_at
        if now is None:
            now = self._read_at = trio.current_time()
        if facts.output:
            if measured.first_output_at is None:
                self._first_output(now)
            else:
                if not self._gap_events:
                    last = measured.last_output_at
                    self._gap_s = gap = 0.0 if last is None else now - last
                    # The relay was away (writing to a client that reads slowly) for most of
                    # the gap: the engine's pace is hidden in it, and it teaches nothing.
                    self._gap_held = last is not None and self._asked_at - last > gap / 2
                self._gap_events += 1
                self._gap_tokens += tokens or 1
            measured.last_output_at = now
            measured.output_events += 1
            self._generated += tokens or 1
        else:
            self._generated += tokens
        measured.output_tokens += tokens
        if facts.usage:
            measured.count_usage(event.chunk["usage"])
        if facts.finish:
            self.finished = True

    def _first_output(self, now: float) -> None:
        measured = self.measurements
        measured.first_output_at = now
        measured.predicted_ttft = self.slot.predicted_first_token_at - measured.arrival
        if self._generated:  # tokens before the first output were generated in prefill
            self.slot.generated(self._generated, now=now)
            self._generated = 0
        self.slot.to_decode()
        if measured.on_first_output is not None:
            measured.on_first_output(now - measured.arrival)

    def settle(self) -> None:
        """Teach the slot (and through it the forecast and drift) what the chunks observed
        since the last settle taught: their output events' gap and tokens, and the tokens
        generated, at the time the read's first chunk was taken. Idempotent."""
        now = self._read_at
        if now is None:
            return
        self._read_at = None
        slot = self.slot
        if self._gap_events:
            self.measurements.gaps.append((self._gap_s, self._gap_events))
            if not self._gap_held:
                slot.observe_gap(self._gap_s, self._gap_tokens, now=now)
            self._gap_events = self._gap_tokens = 0
        if self._generated:
            slot.generated(self._generated, now=now)
            self._generated = 0

    async def next_chunk(self) -> ChunkEvent | None:
        """The next chunk, observed; ``None`` at the end of a complete stream.

        Once the answer is complete (a choice finished and the usage chunk arrived), the rest
        of the stream (``[DONE]``) is waited for only :data:`AFTER_COMPLETE_S`: an engine that
        then idles, breaks or sends garbage has still answered in full.

        Raises:
            EngineRejectedRequest: an in-band error frame whose ``code`` is a 4xx status.
            EngineError: any other in-band error frame, or the body ended before any choice
                finished.
            EngineResponseError: a malformed event or a token-ID violation.
        """
        self.settle()
        if self.complete:
            return await self._after_complete()
        self._asked_at = trio.current_time()
        event = await self.stream.next_event()
        if isinstance(event, ChunkEvent):
            self.observe(event)
            return event
        if isinstance(event, ErrorFrameEvent):
            raise self._frame_error(event)
        if not event.clean and not self.finished:
            raise EngineError(f"engine {self.engine.name} ended its stream before finishing")
        return None

    def next_ready(self) -> ChunkEvent | None:
        """The next chunk, observed, when no read is needed for it; ``None`` when a read, the
        end of the stream or the wait after a complete answer is next (:meth:`next_chunk`).

        The relay's fast path: a network read often completes many events, and this takes
        each without an ``await``. The chunks it takes are observed as one read with the
        chunk taken before them: when it returns ``None``, the read is settled
        (:meth:`settle`).

        Raises:
            EngineRejectedRequest: an in-band error frame whose ``code`` is a 4xx status.
            EngineError: any other in-band error frame.
            EngineResponseError: a malformed event or a token-ID violation.
        """
        if self.complete:
            self.settle()
            return None
        try:
            event = self.stream.next_ready()
        except BaseException:
            self.settle()  # what came before the malformed event still teaches
            raise
        if event is None:
            self.settle()
            return None
        if isinstance(event, ErrorFrameEvent):
            self.settle()
            raise self._frame_error(event)
        self.observe(event)
        return event

    def _frame_error(self, event: ErrorFrameEvent) -> EngineError | EngineRejectedRequest:
        rejected = event.rejection()
        if rejected is not None:
            log.info(
                "request %s: engine %s refused the request in-band (%d): %s",
                self.stream.request_id,
                self.engine.name,
                rejected.http_status,
                rejected.message,
            )
            return rejected
        return EngineError(f"engine {self.engine.name} reported an error: {event.message()}")

    @property
    def complete(self) -> bool:
        """Everything a client needs has arrived: the finish and the (forced) usage chunk."""
        return self.finished and self.measurements.usage_seen

    async def _after_complete(self) -> ChunkEvent | None:
        if self.stream.buffered():
            # Nearly always: the end came in the read that completed the answer. Taking it
            # waits for nothing, so no deadline is set up for it (the drain that follows
            # [DONE] keeps its own).
            return await self._take_after_complete()
        with trio.move_on_after(AFTER_COMPLETE_S):
            return await self._take_after_complete()
        log.info("engine %s idled after a complete answer; ending it", self.engine.name)
        return None

    async def _take_after_complete(self) -> ChunkEvent | None:
        try:
            event = await self.stream.next_event()
        except UpstreamFailure as exc:
            log.info(
                "engine %s broke its stream after a complete answer: %s",
                self.engine.name,
                exc.message,
            )
            return None
        if isinstance(event, ChunkEvent):
            self.observe(event)
            return event
        return None

    async def read_until_headers(self) -> None:
        """Read and hold events until one justifies sending response headers.

        Raises:
            EngineRejectedRequest: an in-band error frame whose ``code`` is a 4xx status.
            EngineError: another error frame, or the stream ended before any output or finish.
            EngineResponseError: a malformed event or a token-ID violation.
        """
        while True:
            event = await self.next_chunk()
            if event is None:
                raise EngineError(f"engine {self.engine.name} ended its stream without output")
            self.held.append(event)
            facts = event.facts
            if facts.output or facts.finish or facts.usage:
                return

    def take_held(self) -> list[ChunkEvent]:
        """The held events, once."""
        held, self.held = self.held, []
        return held

    def record_outcome(self, *, ok: bool) -> None:
        """Count the exchange in the engine's statistics."""
        self.engine.record_outcome(ok=ok)


@asynccontextmanager
async def open_exchange(
    pool: EnginePool,
    request: CompletionRequest,
    slot: Slot,
    arrival: float,
    *,
    headers: Mapping[str, str] | None = None,
    on_first_output: Callable[[float], None] | None = None,
) -> AsyncIterator[Exchange]:
    """Open ``request``'s upstream stream on its placement and read until headers may go out.

    Used as ``async with open_exchange(...) as exchange``: on exit, however the block ends, the
    upstream stream is closed (the engine sees the client go away) and a retry's slot is given
    back. ``slot`` itself stays the caller's to release; a failed attempt releases it at once
    (releasing is idempotent) so that its engine's occupancy is true during the retry.

    ``headers`` go to the engine with the request (the request id); ``on_first_output`` is
    called with the TTFT when the first output event arrives.

    Before headers, a failed attempt is retried once, on a different eligible engine with a free
    prefill slot now; without one, or when the retry fails too, the answer is a 502 with
    ``x-should-retry: false``.

    Raises:
        EngineRejectedRequest: the engine refused the request (a 4xx answer, or an in-band
            error frame with a 4xx code); not retried, not an engine failure.
        UpstreamFailure: both attempts failed, or the first did and no other engine had room
            (:class:`~narwhal.errors.EngineAttemptsFailed`, or the last
            :class:`~narwhal.errors.EngineResponseError`).
    """
    async with AsyncExitStack() as held:

        async def attempt(attempt_slot: Slot) -> Exchange:
            measurements = Measurements(arrival, on_first_output)
            return await _attempt(held, attempt_slot, request, measurements, headers)

        exchange = await with_one_retry(held, pool, request, slot, attempt, headers=headers)
        try:
            yield exchange
        finally:
            exchange.settle()  # the last read teaches too, however the block ended


async def with_one_retry(
    held: AsyncExitStack,
    pool: EnginePool,
    request: CompletionRequest,
    slot: Slot,
    attempt: Callable[[Slot], Awaitable[_T]],
    *,
    headers: Mapping[str, str] | None = None,
) -> _T:
    """``attempt(slot)``, and once more on a different engine if it fails before the client has
    been sent anything: the retry policy of every upstream call (streams here, non-streaming
    answers in :mod:`narwhal.upstream.whole`).

    A failed attempt's slot is released at once (so that its engine's occupancy is true during
    the retry); the retry's slot (:meth:`EnginePool.retake`), taken on the eligible engine with
    a free prefill slot, a context that holds the prompt and the earliest predicted first
    token, joins ``held``.

    Raises:
        EngineRejectedRequest: the engine refused the request; not retried.
        UpstreamFailure: both attempts failed, or the first did and no other engine had room.
    """
    failures: list[tuple[Engine, UpstreamFailure]] = []
    attempt_slot = slot
    while True:
        engine = attempt_slot.engine
        try:
            return await attempt(attempt_slot)
        except (EngineError, EngineResponseError) as exc:
            log.warning(
                "request %s: attempt on engine %s failed: %s",
                (headers or {}).get("x-request-id", "-"),
                engine.name,
                exc.message,
            )
            record_failure(engine, exc)
            # An engine refusing work has not failed.
            attempt_slot.failed(counted=not isinstance(exc, EngineBusy))
            failures.append((engine, exc))
        other = None
        if len(failures) < 2:
            # Never an engine too short for the prompt (it would answer a 400 of its own).
            other = await pool.retake(
                slot,
                exclude=[*(engine for engine, _ in failures), *too_short(pool, slot.prompt_tokens)],
                need_token_ids=request.wants_token_ids,
            )
        if other is None:
            raise _give_up(failures)
        attempt_slot = held.enter_context(other)


def _give_up(failures: list[tuple[Engine, UpstreamFailure]]) -> UpstreamFailure:
    last = failures[-1][1]
    if isinstance(last, EngineResponseError):
        return last  # it says x-should-retry: false already
    if len(failures) == 1:
        return EngineAttemptsFailed(f"The engine failed to answer: {last.message}")
    told = "; ".join(failure.message for _, failure in failures)
    return EngineAttemptsFailed(f"Both engines tried failed to answer: {told}")


async def _attempt(
    held: AsyncExitStack,
    slot: Slot,
    request: CompletionRequest,
    measurements: Measurements,
    headers: Mapping[str, str] | None,
) -> Exchange:
    """One try on ``slot``'s engine; on success the open stream's close joins ``held``."""
    engine = slot.engine
    # The engine's circuit opening cancels this scope: the attempt fails at once, to be
    # retried on another engine, instead of waiting out the read timeout.
    with trio.CancelScope() as unresponsive:
        engine.attempts.add(unresponsive)
        try:
            async with AsyncExitStack() as attempt:
                stream, exposure = await _open(engine, request, headers)
                attempt.push_async_callback(_close_stream, stream)
                exchange = Exchange(request, engine, stream, exposure, slot, measurements)
                await exchange.read_until_headers()
                held.push_async_exit(attempt.pop_all())
                return exchange
        finally:
            engine.attempts.discard(unresponsive)
    raise EngineError(f"engine {engine.name} stopped answering (its circuit opened)")


async def _open(
    engine: Engine, request: CompletionRequest, headers: Mapping[str, str] | None
) -> tuple[UpstreamStream, Exposure]:
    """Send ``request`` to ``engine``: its open stream, and what to hide from the client.

    The engine's request body lives in this frame only: once the stream is open, nothing of
    the router holds it (:class:`~narwhal.upstream.transport.OneShotBody`), so a running
    stream does not keep its prompt in memory for its whole decode.
    """
    plan = plan_upstream(request, token_ids=engine.provides_token_ids)
    stream = await open_stream(
        engine, request.route, plan.body, ids_required=plan.token_ids, headers=headers
    )
    return stream, plan.exposure


async def _close_stream(stream: UpstreamStream) -> None:
    # Even under cancellation (a client gone), and never for long: the engine must learn. One
    # scope does both: a shield keeps the outer cancellations out, not its own deadline.
    with trio.CancelScope(shield=True, deadline=trio.current_time() + _CLOSE_S):
        await stream.aclose()


_CLOSE_S = 5.0
"""The longest closing an upstream stream may take (it returns the connection, or closes it)."""
