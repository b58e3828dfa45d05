"""The completion routes: from arrival to the last byte.

A request reads top to bottom: count it offered; read the body within the byte limit; validate
it (:mod:`narwhal.protocol.requests`); place it and open its upstream stream, retrying once
before headers (:mod:`narwhal.upstream.exchange`); then relay the stream or assemble one
response. The request deadline is a cancel scope around each wait, opened here and nowhere
else. Every path ends by finishing the request's :class:`~narwhal.admission.accounting.Ticket`
exactly once.

The upstream stream lives in the request's own task: Quart-Trio runs the handler and then
iterates the response body in the same task of the per-request nursery, which it cancels when
the client disconnects. A disconnect therefore raises ``Cancelled`` (or closes the body
generator) wherever the request is waiting, and the ``finally`` clauses close the upstream.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, cast

import attrs
import orjson
import trio
from quart import Response, request

from narwhal.admission.accounting import TerminalClass, Ticket
from narwhal.admission.predictor import check_budget, project
from narwhal.admission.queue import Waiter
from narwhal.errors import (
    Expired,
    InvalidRequest,
    NarwhalError,
    Unavailable,
    UnsupportedOption,
    UpstreamFailure,
)
from narwhal.protocol.assembly import Assembler
from narwhal.protocol.chunks import expose
from narwhal.protocol.requests import CompletionRequest, Route, parse_request
from narwhal.protocol.sse import encode_data, encode_done
from narwhal.router import Router
from narwhal.upstream.client import ChunkEvent
from narwhal.upstream.exchange import Exchange, open_exchange
from narwhal.web.body import read_body
from narwhal.web.responses import error_response, json_response

__all__ = ["RelayBody", "handle_completion", "parse_deadline_headers"]

log = logging.getLogger(__name__)

DEADLINE_HEADERS = ("x-narwhal-deadline-ms", "x-envoy-expected-rq-timeout-ms")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_RELAY_BUFFER = 256  # frames between the pump and the writer (backpressure beyond)


def parse_deadline_headers(headers: Any, default_s: float) -> float:
    """The effective deadline in seconds: the smallest of the default and both headers.

    Raises:
        InvalidRequest: a header is not an integer number of milliseconds >= 1.
    """
    seconds = default_s
    for name in DEADLINE_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        text = value.strip()
        if not text.isascii() or not text.isdigit() or int(text) < 1:
            raise InvalidRequest(
                f"`{name}` must be an integer number of milliseconds, at least 1; got {value!r}.",
                param=name,
            )
        seconds = min(seconds, int(text) / 1000)
    return seconds


@attrs.define(eq=False)
class _Life:
    """What one request holds, released exactly once however it ends.

    The ticket is finished once (the conservation law), the retention slot given back once,
    and the upstream exchange, once opened, closed once.
    """

    router: Router
    ticket: Ticket
    arrival: float
    retained: bool = False
    exchange: Exchange | None = None
    handed_over: bool = False  # a streaming body now owns the release

    def finish(self, terminal: TerminalClass, reason: str | None = None) -> None:
        if self.ticket.finished is None:
            self.ticket.finish(terminal, reason)

    def fail(self, error: NarwhalError) -> None:
        self.finish(cast(TerminalClass, error.counted_as), error.code)

    async def close(self, *, default: TerminalClass = "cancelled") -> None:
        """Release everything; an unfinished ticket is counted as ``default``."""
        self.finish(default)
        if self.exchange is not None:
            exchange, self.exchange = self.exchange, None
            await exchange.aclose()
        if self.retained:
            self.retained = False
            self.router.retention.release()


async def handle_completion(router: Router, route: Route) -> Response:
    """Serve one completion request (both routes); count it exactly once."""
    life = _Life(router, router.accounting.offer(), trio.current_time())
    try:
        router.check_state()
        router.retention.acquire()
        life.retained = True
        return await _serve(life, route)
    except NarwhalError as exc:
        life.fail(exc)
        return error_response(exc)
    except Exception:
        log.exception("request failed inside the router")
        life.finish("failed", "internal_error")
        return error_response(NarwhalError("Internal router error."))
    finally:
        if not life.handed_over:
            with trio.CancelScope(shield=True):
                await life.close()


async def _serve(life: _Life, route: Route) -> Response:
    router = life.router
    config = router.config
    admission = config.admission
    # The body is read under the default deadline; the headers may only shorten it, and are
    # checked after the size limit (413 comes first).
    deadline = life.arrival + config.serving.request_deadline_s
    with trio.move_on_at(deadline) as scope:
        raw = await read_body(request, config.serving.max_request_bytes)
        deadline = life.arrival + parse_deadline_headers(
            request.headers, config.serving.request_deadline_s
        )
        scope.deadline = deadline
        parsed = parse_request(raw, route, config.serving.model)
        need_ids = parsed.wants_token_ids
        if need_ids and not router.pool.any_provides_token_ids():
            raise UnsupportedOption(
                "`return_token_ids` was requested but no engine behind this router provides "
                "token IDs.",
                param="return_token_ids",
            )
        tokens = router.sizer.prompt_tokens(parsed)
        life.ticket.sized = True
        projection = None
        budget = admission.ttft_budget_s
        if admission.mode == "predictive":
            now = trio.current_time()
            projection = project(
                router.pool,
                router.queue.waiting(),
                Waiter(tokens, need_ids, route, parsed.max_output_tokens),
                router.lengths,
                now=now,
                elapsed_s=now - life.arrival,
                overhead_s=admission.frontend_overhead_s,
                margin=router.margin.factor,
            )
            if projection is None:
                raise _no_engine()
            check_budget(projection, budget)
        elif not router.pool.any_eligible(need_token_ids=need_ids):
            raise _no_engine()
        waiter = Waiter(tokens, need_ids, route, parsed.max_output_tokens)
        slot = router.queue.place_now(waiter)
        if slot is None:
            router.queue.enqueue(waiter)
            slot = await router.queue.wait_for_placement(waiter, admission.admission_wait_s)
        router.metrics.queue_wait.observe(trio.current_time() - waiter.enqueued_at)
        teach = None
        if projection is not None:  # the margin learns how the projection fared
            teach = partial(router.margin.observe, projection.typical_s, budget_s=budget)
        life.exchange = exchange = await open_exchange(
            router.pool, parsed, slot, life.arrival, on_first_output=teach
        )
        if parsed.stream:
            life.handed_over = True
            response = Response(
                RelayBody(life, exchange, deadline),
                status=200,
                content_type="text/event-stream",
                headers=SSE_HEADERS,
            )
            response.timeout = None
            return response
        try:
            body = await _assemble(exchange, parsed)
        except UpstreamFailure:
            exchange.record_outcome(ok=False)
            raise
        exchange.record_outcome(ok=True)
        _learn(router, exchange)
        life.finish("completed")
        return json_response(body)
    raise Expired(
        "The request deadline passed before the response could start.",
        code="request_deadline_expired",
    )


def _no_engine() -> Unavailable:
    return Unavailable("No engine is eligible to serve this request; retry shortly.")


async def _assemble(exchange: Exchange, parsed: CompletionRequest) -> dict[str, Any]:
    """Consume the whole upstream stream into one response body."""
    assembler = Assembler(
        parsed.route,
        expose_token_ids=parsed.wants_token_ids,
        prompt_tokens_estimate=exchange.slot.prompt_tokens,
    )
    for event in exchange.take_held():
        assembler.feed(event.chunk)
    while (chunk := await exchange.next_chunk()) is not None:
        assembler.feed(chunk.chunk)
    return assembler.result()


class RelayBody:
    """A streamed response: the relay of one request's upstream stream to its client.

    :class:`~narwhal.web.app.NarwhalHTTPConnection` serves it with :meth:`respond`: the
    request's nursery holds a *pump* task, which reads the upstream stream under the request
    deadline (an explicit cancel scope) and turns chunks into client frames, and the writer,
    which sends whatever frames are ready in one write. When the client is slower than the
    engine, frames gather and go out together instead of one write per token.

    Whatever ends the response (the last byte, an in-band error, the client leaving, even
    before the first byte), what the request holds is released exactly once.
    """

    def __init__(self, life: _Life, exchange: Exchange, deadline: float) -> None:
        self._life = life
        self._exchange = exchange
        self._deadline = deadline

    def __aiter__(self) -> RelayBody:
        return self

    async def __anext__(self) -> bytes:
        raise RuntimeError("a relay is served by NarwhalHTTPConnection, not iterated")

    async def respond(self, send: Any, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the whole response through the ASGI ``send``."""
        frames_in, frames_out = trio.open_memory_channel[bytes](_RELAY_BUFFER)
        first_sent = trio.Event()
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, frames_in, first_sent)
                async with frames_out:
                    async for frame in frames_out:
                        batch = [frame]
                        while True:
                            try:
                                batch.append(frames_out.receive_nowait())
                            except (trio.WouldBlock, trio.EndOfChannel):
                                break
                        body = batch[0] if len(batch) == 1 else b"".join(batch)
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        first_sent.set()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Release what the request holds (idempotent; the client may never have read)."""
        with trio.CancelScope(shield=True):
            await self._life.close()

    async def _pump(self, frames: trio.MemorySendChannel[bytes], first_sent: trio.Event) -> None:
        life, exchange = self._life, self._exchange
        relay = _StreamRelay(exchange)

        async def emit(items: list[bytes]) -> None:
            # An idle writer sends at once; a busy one (its last write still going out) finds
            # the frames gathered when it comes back.
            writer_idle = frames.statistics().tasks_waiting_receive > 0
            for item in items:
                try:
                    frames.send_nowait(item)
                except trio.WouldBlock:
                    await frames.send(item)
            if writer_idle:
                await trio.lowlevel.checkpoint()

        async with frames:
            try:
                with trio.move_on_at(self._deadline) as deadline:
                    for event in exchange.take_held():
                        await emit(relay.frames(event))
                    # The first output goes out before anything else is read: that is the TTFT.
                    await first_sent.wait()
                    while (chunk := await exchange.next_chunk()) is not None:
                        await emit(relay.frames(chunk))
                    await emit([*relay.finish(), encode_done()])
                if deadline.cancelled_caught:
                    raise Expired(
                        "The request deadline passed while the response was streaming.",
                        code="request_deadline_expired",
                    )
                exchange.record_outcome(ok=True)
                life.finish("completed")
                _learn(life.router, exchange)
            except NarwhalError as exc:
                if isinstance(exc, UpstreamFailure):
                    exchange.record_outcome(ok=False)
                log.info("stream ended in-band: %s", exc.message)
                life.fail(exc)
                await emit(
                    [*relay.finish(), encode_data(orjson.dumps(exc.envelope())), encode_done()]
                )
            except Exception:
                log.exception("relay failed")
                life.finish("failed", "internal_error")
                failure = UpstreamFailure(
                    "The router failed while relaying the stream.", code="internal_error"
                )
                await emit([encode_data(orjson.dumps(failure.envelope())), encode_done()])
            finally:
                await self.aclose()


class _StreamRelay:
    """Turns upstream chunks into client frames, in the engine's shape.

    A chunk is forwarded byte for byte unless a repair touched it. When the router forced the
    usage chunk, it is dropped, and its ``system_fingerprint`` moves to the finish chunk, which
    is held back one event for that: that is where vLLM puts it without ``include_usage``.
    """

    __slots__ = ("_held_finish", "exchange")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self._held_finish: dict[str, Any] | None = None

    def frames(self, event: ChunkEvent) -> list[bytes]:
        exposure = self.exchange.exposure
        chunk = event.chunk
        facts = event.facts
        out: list[bytes] = []
        if facts.usage_only and exposure.drop_usage_chunk:
            if self._held_finish is not None:
                fingerprint = chunk.get("system_fingerprint")
                if fingerprint is not None and "system_fingerprint" not in self._held_finish:
                    self._held_finish["system_fingerprint"] = fingerprint
            return self.finish()
        out.extend(self.finish())
        changed = expose(chunk, self.exchange.request.route, exposure)
        if facts.finish and exposure.drop_usage_chunk:
            self._held_finish = chunk
            return out
        out.append(encode_data(orjson.dumps(chunk)) if changed else encode_data(event.raw))
        return out

    def finish(self) -> list[bytes]:
        """Flush the held finish chunk, if any."""
        if self._held_finish is None:
            return []
        chunk, self._held_finish = self._held_finish, None
        return [encode_data(orjson.dumps(chunk))]


def _learn(router: Router, exchange: Exchange) -> None:
    """Feed a completed request's measurements back: metrics and the prompt-size ratio."""
    measured = exchange.measurements
    metrics = router.metrics
    ttft = measured.ttft
    if ttft is not None:
        metrics.ttft.observe(ttft)
        if measured.predicted_ttft:
            metrics.predicted_ttft_error_ratio.observe(ttft / measured.predicted_ttft)
    for gap in measured.gaps:
        metrics.inter_token_gap.observe(gap)
    produced = measured.output_tokens or measured.completion_tokens_reported
    if produced is not None and exchange.finished:
        request = exchange.request
        router.lengths.learn(request.route, request.max_output_tokens, produced)
    if measured.prompt_tokens_reported:
        router.sizer.learn(exchange.engine.name, exchange.request, measured.prompt_tokens_reported)
