"""Non-streaming upstream calls, for requests whose answer a stream would change.

Narwhal streams from its engines, even for clients that did not ask for a stream, except where
that would change the answer (:func:`narwhal.upstream.dialects.as_sent`: ``prompt_logprobs``,
``echo``...). Such a non-streaming request goes to the engine as the client sent it, and the
engine's answer goes back as it came: its status and its bytes.

Everything around the call is what a stream has. The request is placed and holds its slot; the
call is cut when the engine's circuit opens; a failure before the answer arrived (nothing has
reached the client yet) is retried once on another engine (:func:`~narwhal.upstream.exchange.
with_one_retry`); an engine's 4xx is the client's error, in the normalised envelope; the caller's
cancel scopes (the deadline, the client going away) cancel the call, which closes its connection,
so the engine stops generating.

What cannot be measured is what a stream shows: no first token, no inter-token gap. The answer's
``usage`` gives the prompt's size (the sizing learns from it) and the output length (the length
model learns from it), and its arrival the end-to-end time. Token IDs are not asked for, so none
are validated. With no first token to see, the request is taken to have had it at its predicted
time: its prefill slot is exchanged for a decode slot then (or when the answer arrives, if
sooner), so that such requests do not hold an engine's prefill slots for their whole decode;
the engine's prefill forecast learns nothing from them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import trio

from narwhal.errors import EngineError
from narwhal.protocol.requests import CompletionRequest
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.upstream.client import WholeAnswer
from narwhal.upstream.dialects import plan_upstream
from narwhal.upstream.exchange import Measurements, with_one_retry
from narwhal.upstream.health import client_of

__all__ = ["WholeExchange", "open_whole"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class WholeExchange:
    """An engine's whole answer to a request sent as is, with what it taught.

    Attributes:
        finished: every choice of the answer has a ``finish_reason``.
    """

    request: CompletionRequest
    engine: Engine
    slot: Slot
    answer: WholeAnswer
    measurements: Measurements
    finished: bool

    def record_outcome(self, *, ok: bool) -> None:
        """Count the call in the engine's statistics."""
        self.engine.record_outcome(ok=ok)


@asynccontextmanager
async def open_whole(
    pool: EnginePool,
    request: CompletionRequest,
    slot: Slot,
    arrival: float,
    *,
    headers: Mapping[str, str] | None = None,
) -> AsyncIterator[WholeExchange]:
    """Send ``request`` as is on its placement and read the engine's whole answer.

    Used as ``async with open_whole(...) as whole``: a retry's slot is held until the block
    ends; ``slot`` stays the caller's to release (a failed attempt releases it at once).
    ``headers`` go to the engine with the request (the request id).

    Raises:
        EngineRejectedRequest: the engine refused the request (4xx); not retried.
        UpstreamFailure: both attempts failed, or the first did and no other engine had room.
    """
    async with AsyncExitStack() as held:

        async def attempt(attempt_slot: Slot) -> WholeExchange:
            return await _attempt(attempt_slot, request, arrival, headers)

        yield await with_one_retry(held, pool, request, slot, attempt, headers=headers)


async def _attempt(
    slot: Slot, request: CompletionRequest, arrival: float, headers: Mapping[str, str] | None
) -> WholeExchange:
    engine = slot.engine
    plan = plan_upstream(request, token_ids=False)
    if plan.stream:
        raise ValueError("open_whole serves requests that go upstream as sent, without stream")
    # The engine's circuit opening cancels this scope: the attempt fails at once, to be
    # retried on another engine, instead of waiting out the read timeout.
    with trio.CancelScope() as unresponsive:
        engine.attempts.add(unresponsive)
        try:
            answer = await _post_whole(slot, request, plan.body, headers)
            now = trio.current_time()
            engine.request_answered(now)
            measurements = Measurements(arrival, answered_at=now)
            usage = answer.body.get("usage")
            if usage is not None:
                measurements.count_usage(usage)
            choices = answer.body.get("choices")
            finished = (
                type(choices) is list
                and bool(choices)
                and all(type(c) is dict and c.get("finish_reason") is not None for c in choices)
            )
            log.debug(
                "request %s: engine %s answered whole (as sent for `%s`) in %.3f s",
                (headers or {}).get("x-request-id", "-"),
                engine.name,
                plan.as_sent,
                now - arrival,
            )
            return WholeExchange(request, engine, slot, answer, measurements, finished)
        finally:
            engine.attempts.discard(unresponsive)
    raise EngineError(f"engine {engine.name} stopped answering (its circuit opened)")


async def _post_whole(
    slot: Slot, request: CompletionRequest, body: bytes, headers: Mapping[str, str] | None
) -> WholeAnswer:
    """The engine's whole answer; meanwhile the slot moves to decode at the predicted first
    token (the engine prefills, then decodes, unseen)."""
    call = client_of(slot.engine).post_whole(request.route, body, headers=headers)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_decode_at_predicted_first_token, slot)
            try:
                answer = await call
            finally:
                nursery.cancel_scope.cancel()
            slot.to_decode(observed=False)  # answered sooner than predicted: prefilled by now
            return answer
    except BaseExceptionGroup as group:
        # The timer never fails: the group holds the call's own exception, raised as is for
        # the retry and the caller's handlers.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _decode_at_predicted_first_token(slot: Slot) -> None:
    await trio.sleep_until(slot.predicted_first_token_at)
    slot.to_decode(observed=False)
