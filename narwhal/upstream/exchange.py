"""One request's conversation with the engines, up to and after response headers.

Before headers, Narwhal may still change its mind: a connection error, an engine 5xx, an in-band
error frame, a token-ID violation or a malformed event is retried once on a different eligible
engine, else the client gets a 502 (docs: Request lifecycle). Events read before the
decision are held and flushed right after the headers.

The module holds no deadlines: the caller opens the request's cancel scopes around these calls.
"""

from __future__ import annotations

import logging
from typing import Literal

import attrs
import trio

from narwhal.errors import (
    EngineError,
    EngineResponseError,
    Unavailable,
    UpstreamFailure,
)
from narwhal.protocol.chunks import Exposure
from narwhal.protocol.requests import CompletionRequest
from narwhal.scheduling.engines import Engine, EnginePool
from narwhal.upstream.client import ChunkEvent, ErrorFrameEvent, UpstreamStream
from narwhal.upstream.dialects import upstream_body

__all__ = ["Exchange", "Measurements", "open_exchange"]

log = logging.getLogger(__name__)

Phase = Literal["prefill", "decode", "released"]


@attrs.define
class Slot:
    """The request's place on its engine: prefill until the first output event, then decode."""

    engine: Engine
    phase: Phase = "prefill"

    def __attrs_post_init__(self) -> None:
        self.engine.prefill += 1

    def to_decode(self) -> None:
        """Exchange the prefill slot for a decode slot."""
        if self.phase == "prefill":
            self.engine.prefill -= 1
            self.engine.decode += 1
            self.phase = "decode"

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        if self.phase == "prefill":
            self.engine.prefill -= 1
        elif self.phase == "decode":
            self.engine.decode -= 1
        self.phase = "released"


@attrs.define
class Measurements:
    """What a request taught us: TTFT, inter-token gaps, output tokens (by ID where known)."""

    arrival: float
    first_output_at: float | None = None
    last_output_at: float | None = None
    output_tokens: int = 0
    output_events: int = 0
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
                self.slot.to_decode()
            elif measured.last_output_at is not None:
                measured.gaps.append(now - measured.last_output_at)
            measured.last_output_at = now
            measured.output_events += 1
        self.measurements.output_tokens += facts.token_ids
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


async def open_exchange(pool: EnginePool, request: CompletionRequest, arrival: float) -> Exchange:
    """Place ``request``, open its upstream stream, and read until headers may go out.

    Raises:
        Unavailable: no engine is eligible.
        EngineRejectedRequest: the engine refused the request (4xx); not retried.
        UpstreamFailure: both attempts failed (502).
    """
    tried: list[Engine] = []
    failure: UpstreamFailure | None = None
    for _ in range(2):
        engine = pool.choose(exclude=tried, need_token_ids=request.wants_token_ids)
        if engine is None:
            break
        tried.append(engine)
        try:
            return await _attempt(engine, request, arrival)
        except (EngineError, EngineResponseError) as exc:
            log.warning("attempt on engine %s failed: %s", engine.name, exc.message)
            engine.failed += 1
            failure = exc
    if failure is None:
        raise Unavailable("No engine is eligible to serve this request; retry shortly.")
    if isinstance(failure, EngineResponseError):
        raise failure
    raise EngineError(f"The engines failed to answer: {failure.message}")


async def _attempt(engine: Engine, request: CompletionRequest, arrival: float) -> Exchange:
    token_ids = engine.provides_token_ids
    body, exposure = upstream_body(request, token_ids=token_ids)
    slot = Slot(engine)
    try:
        stream = await engine.client.open_stream(request.route, body, ids_required=token_ids)
    except BaseException:
        slot.release()
        raise
    exchange = Exchange(request, engine, stream, exposure, slot, Measurements(arrival))
    try:
        await exchange.read_until_headers()
    except BaseException:
        await exchange.aclose()
        raise
    return exchange
