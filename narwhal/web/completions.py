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
from collections.abc import AsyncIterator
from typing import Any, cast

import orjson
import trio
from quart import Response, request

from narwhal.admission.accounting import TerminalClass, Ticket
from narwhal.admission.sizing import estimate_prompt_tokens
from narwhal.errors import (
    Expired,
    InvalidRequest,
    NarwhalError,
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

__all__ = ["handle_completion", "parse_deadline_headers"]

log = logging.getLogger(__name__)

DEADLINE_HEADERS = ("x-narwhal-deadline-ms", "x-envoy-expected-rq-timeout-ms")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


async def handle_completion(router: Router, route: Route) -> Response:
    """Serve one completion request (both routes); count it exactly once."""
    arrival = trio.current_time()
    ticket = router.accounting.offer()
    try:
        return await _serve(router, route, ticket, arrival)
    except NarwhalError as exc:
        if ticket.finished is None:
            ticket.finish(cast(TerminalClass, exc.counted_as), exc.code)
        return error_response(exc)
    except Exception:
        log.exception("request failed inside the router")
        if ticket.finished is None:
            ticket.finish("failed", "internal_error")
        return error_response(NarwhalError("Internal router error."))
    except BaseException:
        if ticket.finished is None:
            ticket.finish("cancelled")
        raise


async def _serve(router: Router, route: Route, ticket: Ticket, arrival: float) -> Response:
    config = router.config
    # The body is read under the default deadline; the headers may only shorten it, and are
    # checked after the size limit (413 comes first).
    deadline = arrival + config.serving.request_deadline_s
    with trio.move_on_at(deadline) as scope:
        raw = await read_body(request, config.serving.max_request_bytes)
        deadline = arrival + parse_deadline_headers(
            request.headers, config.serving.request_deadline_s
        )
        scope.deadline = deadline
        parsed = parse_request(raw, route, config.serving.model)
        if parsed.wants_token_ids and not router.pool.any_provides_token_ids():
            raise UnsupportedOption(
                "`return_token_ids` was requested but no engine behind this router provides "
                "token IDs.",
                param="return_token_ids",
            )
        ticket.sized = True
        exchange = await open_exchange(router.pool, parsed, arrival)
        if parsed.stream:
            # From here the body generator owns the exchange, and closes it.
            response = Response(
                _relay(router, exchange, ticket, deadline),
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
        finally:
            await exchange.aclose()
        exchange.record_outcome(ok=True)
        _record_measurements(router, exchange)
        ticket.finish("completed")
        return json_response(body)
    raise Expired(
        "The request deadline passed before the response could start.",
        code="request_deadline_expired",
    )


async def _assemble(exchange: Exchange, parsed: CompletionRequest) -> dict[str, Any]:
    """Consume the whole upstream stream into one response body."""
    assembler = Assembler(
        parsed.route,
        expose_token_ids=parsed.wants_token_ids,
        prompt_tokens_estimate=estimate_prompt_tokens(parsed),
    )
    for event in exchange.take_held():
        assembler.feed(event.chunk)
    while (chunk := await exchange.next_chunk()) is not None:
        assembler.feed(chunk.chunk)
    return assembler.result()


async def _relay(
    router: Router, exchange: Exchange, ticket: Ticket, deadline: float
) -> AsyncIterator[bytes]:
    """The streaming body: held events, then each event as it arrives.

    No cancel scope is held across a ``yield``: the deadline is re-entered around each read.
    """
    relay = _StreamRelay(exchange)
    stream = exchange.stream
    out: list[bytes] = []  # frames decoded from one read go out in one write
    try:
        for event in exchange.take_held():
            out.extend(relay.frames(event))
        while True:
            if out and not stream.has_pending():
                yield b"".join(out)
                out.clear()
            with trio.move_on_at(deadline) as scope:
                chunk = await exchange.next_chunk()
            if scope.cancelled_caught:
                raise Expired(
                    "The request deadline passed while the response was streaming.",
                    code="request_deadline_expired",
                )
            if chunk is None:
                out.extend(relay.finish())
                out.append(encode_done())
                yield b"".join(out)
                break
            out.extend(relay.frames(chunk))
        exchange.record_outcome(ok=True)
        ticket.finish("completed")
        _record_measurements(router, exchange)
    except NarwhalError as exc:
        if isinstance(exc, UpstreamFailure):
            exchange.record_outcome(ok=False)
        log.info("stream ended in-band: %s", exc.message)
        if ticket.finished is None:
            ticket.finish(cast(TerminalClass, exc.counted_as), exc.code)
        out.extend(relay.finish())
        out.append(encode_data(orjson.dumps(exc.envelope())))
        out.append(encode_done())
        yield b"".join(out)
    except Exception:
        log.exception("relay failed")
        if ticket.finished is None:
            ticket.finish("failed", "internal_error")
        failure = UpstreamFailure(
            "The router failed while relaying the stream.", code="internal_error"
        )
        yield encode_data(orjson.dumps(failure.envelope()))
        yield encode_done()
    finally:
        if ticket.finished is None:
            ticket.finish("cancelled")
        await exchange.aclose()


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


def _record_measurements(router: Router, exchange: Exchange) -> None:
    measured = exchange.measurements
    ttft = measured.ttft
    if ttft is not None:
        router.metrics.ttft.observe(ttft)
    for gap in measured.gaps:
        router.metrics.inter_token_gap.observe(gap)
