"""One request's conversation with the engines, up to and after response headers.

Before headers, Narwhal may still change its mind: a connection error, an engine 5xx, an in-band
error frame, a token-ID violation or a malformed event is retried once on a different eligible
engine, else the client gets a 502 (docs: Request lifecycle). Events read before the
decision are held and flushed right after the headers.

The module holds no deadlines: the caller opens the request's cancel scopes around these calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from narwhal.errors import (
    EngineError,
    EngineResponseError,
    EngineUnreachable,
    UpstreamFailure,
)
from narwhal.protocol.chunks import Exposure
from narwhal.protocol.requests import CompletionRequest
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.upstream.client import ChunkEvent, ErrorFrameEvent, UpstreamStream
from narwhal.upstream.dialects import upstream_body

__all__ = ["Exchange", "Measurements", "open_exchange"]

log = logging.getLogger(__name__)


@attrs.define
class Measurements:
    """What a request taught us: TTFT, inter-token gaps, output tokens (by ID where known).

    ``predicted_ttft`` is the forecast at placement (from arrival).
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
    gaps: list[float] = attrs.field(factory=list)

    @property
    def ttft(self) -> float | None:
        """Arrival to the first output event."""
        return None if self.first_output_at is None else self.first_output_at - self.arrival


@attrs.define(eq=False)
class Exchange:
    """An open upstream stream on the engine that will answer, with its held events."""

    request: CompletionRequest
    engine: Engine
    stream: UpstreamStream
    exposure: Exposure
    slot: Slot
    measurements: Measurements
    held: list[ChunkEvent] = attrs.field(factory=list)
    finished: bool = False

    def observe(self, event: ChunkEvent) -> None:
        """Record what a chunk tells us: the first output (prefill -> decode), gaps, tokens."""
        facts = event.facts
        if facts.output:
            now = trio.current_time()
            measured = self.measurements
            if measured.first_output_at is None:
                measured.first_output_at = now
                measured.predicted_ttft = self.slot.predicted_first_token_at - measured.arrival
                self.slot.to_decode()
                if measured.on_first_output is not None:
                    measured.on_first_output(now - measured.arrival)
            elif measured.last_output_at is not None:
                gap = now - measured.last_output_at
                measured.gaps.append(gap)
                self.slot.observe_gap(gap, facts.token_ids)
            measured.last_output_at = now
            measured.output_events += 1
        self.measurements.output_tokens += facts.token_ids
        self.slot.generated(facts.token_ids or int(facts.output))
        if facts.usage:
            usage = event.chunk["usage"]
            if isinstance(usage, dict):
                prompt = usage.get("prompt_tokens")
                if type(prompt) is int and prompt > 0:
                    self.measurements.prompt_tokens_reported = prompt
                completion = usage.get("completion_tokens")
                if type(completion) is int and completion >= 0:
                    self.measurements.completion_tokens_reported = completion
        if facts.finish:
            self.finished = True

    async def next_chunk(self) -> ChunkEvent | None:
        """The next chunk, observed; ``None`` at the end of a complete stream.

        Raises:
            EngineError: an in-band error frame, or the body ended before any choice finished.
            EngineResponseError: a malformed event or a token-ID violation.
        """
        event = await self.stream.next_event()
        if isinstance(event, ChunkEvent):
            self.observe(event)
            return event
        if isinstance(event, ErrorFrameEvent):
            raise EngineError(f"engine {self.engine.name} reported an error: {event.message()}")
        if not event.clean and not self.finished:
            raise EngineError(f"engine {self.engine.name} ended its stream before finishing")
        return None

    async def read_until_headers(self) -> None:
        """Read and hold events until one justifies sending response headers.

        Raises:
            EngineError: an error frame, or the stream ended before any output or finish.
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

    async def aclose(self) -> None:
        """Close the upstream stream and give the slot back, even under cancellation."""
        self.slot.release()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await self.stream.aclose()

    def record_outcome(self, *, ok: bool) -> None:
        """Count the exchange in the engine's statistics."""
        if ok:
            self.engine.completed += 1
        else:
            self.engine.failed += 1


async def open_exchange(
    pool: EnginePool,
    request: CompletionRequest,
    slot: Slot,
    arrival: float,
    *,
    on_first_output: Callable[[float], None] | None = None,
) -> Exchange:
    """Open ``request``'s upstream stream on its placement and read until headers may go out.

    ``on_first_output`` is called with the TTFT when the first output event arrives.

    Before headers, a failed attempt is retried once, on a different eligible engine with a free
    prefill slot now; without one, or when the retry fails too, the answer is a 502.

    Raises:
        EngineRejectedRequest: the engine refused the request (4xx); not retried.
        UpstreamFailure: both attempts failed, or the first did and no other engine had room.
    """
    tried: list[Engine] = []
    failure: UpstreamFailure | None = None
    next_slot: Slot | None = slot
    while next_slot is not None:
        engine = next_slot.engine
        tried.append(engine)
        try:
            return await _attempt(next_slot, request, Measurements(arrival, on_first_output))
        except (EngineError, EngineResponseError) as exc:
            log.warning("attempt on engine %s failed: %s", engine.name, exc.message)
            engine.failed += 1
            if isinstance(exc, EngineUnreachable):
                engine.mark_unreachable(exc.message)
            failure = exc
        if len(tried) == 2:
            break
        other = pool.best(
            next_slot.prompt_tokens, exclude=tried, need_token_ids=request.wants_token_ids
        )
        next_slot = (
            None
            if other is None
            else Slot.take(other, slot.prompt_tokens, route=slot.route, max_tokens=slot.max_tokens)
        )
    assert failure is not None
    if isinstance(failure, EngineResponseError):
        raise failure
    raise EngineError(f"The engines failed to answer: {failure.message}")


async def _attempt(slot: Slot, request: CompletionRequest, measurements: Measurements) -> Exchange:
    engine = slot.engine
    token_ids = engine.provides_token_ids
    body, exposure = upstream_body(request, token_ids=token_ids)
    try:
        stream = await engine.client.open_stream(request.route, body, ids_required=token_ids)
    except BaseException:
        slot.release()
        raise
    exchange = Exchange(request, engine, stream, exposure, slot, measurements)
    try:
        await exchange.read_until_headers()
    except BaseException:
        await exchange.aclose()
        raise
    return exchange
