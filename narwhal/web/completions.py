"""The completion routes: from arrival to the last byte.

A request reads top to bottom: count it offered; read the body within the byte limit; validate
it (:mod:`narwhal.protocol.requests`); place it and open its upstream stream, retrying once
before headers (:mod:`narwhal.upstream.exchange`); then relay the stream or assemble one
response.

The routes are plain ASGI (:func:`serve_completion`): one coroutine holds the request from its
first byte to its last, and every resource is taken and given back by one construct, nested in
the order they are taken: the router's hold on the request (which a shutdown may cut) and its
ticket in the books, the HTTP retention slot, the queue place and engine slot, the upstream
stream. No path, however it fails, can leak one of them. The request deadline is a cancel scope
opened here and nowhere else; the client going away cancels the request's scope at once, and
is counted ``cancelled``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
import trio

from narwhal.admission.accounting import Ticket
from narwhal.admission.queue import Waiter
from narwhal.errors import (
    Expired,
    InvalidRequest,
    NarwhalError,
    RequestTimeout,
    Unavailable,
    UnsupportedOption,
    UpstreamFailure,
)
from narwhal.logs import request_context
from narwhal.protocol.assembly import Assembler
from narwhal.protocol.chunks import expose, only_hidden_ids
from narwhal.protocol.requests import CompletionRequest, Route, parse_request
from narwhal.protocol.sse import encode_data, encode_done
from narwhal.router import LiveRequest, Placed, RouterBase
from narwhal.upstream.client import ChunkEvent
from narwhal.upstream.dialects import response_shape, streams_upstream
from narwhal.upstream.exchange import Exchange, open_exchange
from narwhal.upstream.whole import open_whole
from narwhal.web.client import Client, ClientGone, Receive, Send

__all__ = ["parse_deadline_headers", "serve_completion"]

log = logging.getLogger(__name__)

DEADLINE_HEADERS = ("x-narwhal-deadline-ms", "x-envoy-expected-rq-timeout-ms")


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


async def serve_completion(
    router: RouterBase, route: Route, scope: dict[str, Any], receive: Receive, send: Send
) -> None:
    """Serve one completion request (both routes) over ASGI; count it exactly once.

    Never raises: every outcome is an answer to the client (or nothing, when it went away) and
    one terminal class in the books.
    """
    client = Client(scope, receive, send)
    arrival = trio.current_time()
    with (
        request_context(client.request_id),  # every log line about it carries the id
        router.hold(client.request_id) as live,
        router.offer(client.request_id) as ticket,
    ):
        try:
            with live.scope:
                await _serve(router, route, client, live, ticket, arrival)
            if live.scope.cancelled_caught and ticket.finished is None:
                if not live.cut:
                    ticket.finish("cancelled")
                    return
                raise Unavailable(
                    "This router is shutting down; the request was ended. Retry on another.",
                    code="shutdown",
                )
        except NarwhalError as exc:
            _fail(ticket, exc)
            if isinstance(exc, UpstreamFailure):
                log.warning("request %s failed: %s", client.request_id, exc.message)
            await client.send_error(exc)
        except ClientGone:
            if ticket.finished is None:
                ticket.finish("cancelled")
        except Exception:
            log.exception("request %s failed inside the router", client.request_id)
            if ticket.finished is None:
                ticket.finish("failed", "internal_error")
            await client.send_error(NarwhalError("Internal router error."))


def _fail(ticket: Ticket, error: NarwhalError) -> None:
    if ticket.finished is None and error.counted_as is not None:
        ticket.finish(error.counted_as, error.code)  # type: ignore[arg-type]


async def _serve(
    router: RouterBase,
    route: Route,
    client: Client,
    live: LiveRequest,
    ticket: Ticket,
    arrival: float,
) -> None:
    config = router.config
    serving = config.serving
    router.check_state()
    async with router.retain(ticket):
        # The body is read under the body timeout and the default deadline; the headers may
        # only shorten the deadline, and are checked after the size limit (413 comes first).
        deadline = arrival + serving.request_deadline_s
        with trio.move_on_at(min(deadline, arrival + serving.body_timeout_s)) as reading:
            raw = await client.read_body(serving.max_request_bytes)
        if reading.cancelled_caught:
            if trio.current_time() >= deadline:
                raise _deadline_expired()
            router.count_client_timeout("body")
            raise RequestTimeout(
                f"The request body did not arrive within {serving.body_timeout_s:g} s."
            )
        deadline = arrival + parse_deadline_headers(client.headers, serving.request_deadline_s)
        parsed = parse_request(raw, route, serving.model)
        del raw  # the parsed request is what is kept: the bytes would double every prompt held
        with trio.move_on_at(deadline) as timer:
            await _watched(router, client, live, ticket, parsed, arrival)
        if timer.cancelled_caught and ticket.finished is None:
            raise _deadline_expired()


def _deadline_expired() -> Expired:
    return Expired(
        "The request deadline passed before the answer was complete.",
        code="request_deadline_expired",
    )


async def _watched(
    router: RouterBase,
    client: Client,
    live: LiveRequest,
    ticket: Ticket,
    parsed: CompletionRequest,
    arrival: float,
) -> None:
    """Answer ``parsed``; the client going away cancels the request (told by the server, or
    seen by a task that watches for it)."""
    with client.noticing_disconnect(live.scope) as noticed:
        if noticed:
            await _answer(router, client, ticket, parsed, arrival)
            return
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.watch, live.scope)
            try:
                await _answer(router, client, ticket, parsed, arrival)
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The watcher never fails: the group holds the answer's own exception. Raise it as is,
        # so that the caller's handlers (and cancel scopes) see it.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _answer(
    router: RouterBase,
    client: Client,
    ticket: Ticket,
    parsed: CompletionRequest,
    arrival: float,
) -> None:
    need_ids = parsed.wants_token_ids
    if need_ids and not router.pool.any_provides_token_ids():
        raise UnsupportedOption(
            "`return_token_ids` was requested but no engine behind this router provides token IDs.",
            param="return_token_ids",
        )
    tokens = router.sizer.prompt_tokens(parsed)
    ticket.sized = True
    waiter = Waiter(tokens, need_ids, parsed.route, parsed.max_output_tokens)
    async with router.placement(ticket, waiter, arrival) as placed:
        headers = {"x-request-id": client.request_id}
        if not streams_upstream(parsed):
            await _answer_whole(router, client, ticket, parsed, placed, arrival, headers)
            return
        async with open_exchange(
            router.pool, parsed, placed.slot, arrival, headers=headers, on_first_output=placed.teach
        ) as exchange:
            try:
                if parsed.stream:
                    await _relay(client, ticket, exchange)
                else:
                    body = await _assemble(exchange, parsed)
                    ticket.finish("completed")
                    with contextlib.suppress(ClientGone):
                        await client.respond(200, orjson.dumps(body))
            except UpstreamFailure:
                exchange.record_outcome(ok=False)
                raise
            exchange.record_outcome(ok=True)
            router.learn(exchange, placed)


async def _answer_whole(
    router: RouterBase,
    client: Client,
    ticket: Ticket,
    parsed: CompletionRequest,
    placed: Placed,
    arrival: float,
    headers: dict[str, str],
) -> None:
    """A non-streaming request that a stream would answer differently: it goes to the engine
    as sent, and the engine's answer comes back as it is (:mod:`narwhal.upstream.whole`)."""
    async with open_whole(router.pool, parsed, placed.slot, arrival, headers=headers) as whole:
        ticket.finish("completed")
        whole.record_outcome(ok=True)
        with contextlib.suppress(ClientGone):
            await client.respond(whole.answer.status, whole.answer.raw)
        router.learn(whole, placed)


async def _assemble(exchange: Exchange, parsed: CompletionRequest) -> dict[str, Any]:
    """Consume the whole upstream stream into one response body, in the engine's own shape."""
    assembler = Assembler(
        parsed.route,
        expose_token_ids=parsed.wants_token_ids,
        prompt_tokens_estimate=exchange.slot.prompt_tokens,
        shape=response_shape(exchange.engine.config.dialect, parsed),
    )
    for event in exchange.take_held():
        assembler.feed(event.chunk)
    while True:
        while (ready := exchange.next_ready()) is not None:  # one read, observed as one
            assembler.feed(ready.chunk)
        chunk = await exchange.next_chunk()
        if chunk is None:
            break
        assembler.feed(chunk.chunk)
    return assembler.result()


async def _relay(client: Client, ticket: Ticket, exchange: Exchange) -> None:
    """Relay the upstream stream to the client, in the engine's shape.

    One task reads and writes: everything one network read completed goes out in one write, so
    a client slower than its engine gets frames gathered instead of one write per token. A
    failure after the headers is one in-band error event and ``data: [DONE]``, sent by the
    caller; what this relay held back (a finish chunk) goes out before it.
    """
    relay = _StreamRelay(exchange)
    await client.start_stream()  # its head leaves with the first write
    frames: list[bytes] = []  # gathered for the next write
    try:
        for event in exchange.take_held():
            relay.add(event, frames)
        while True:
            # Everything already received goes out with what came before it, in one write.
            while (ready := exchange.next_ready()) is not None:
                relay.add(ready, frames)
            if frames:
                writing, frames = frames, []
                await client.write(b"".join(writing))
            chunk = await exchange.next_chunk()
            if chunk is None:
                break
            relay.add(chunk, frames)
    except BaseException:
        # An error event goes after what was gathered and not yet written, and what the relay
        # held back (a deadline, a shutdown's cut, an engine failure: the caller sends it).
        relay.flush(frames)
        client.owed = b"".join(frames)
        raise
    ticket.finish("completed")
    relay.flush(frames)
    frames.append(encode_done())
    with contextlib.suppress(ClientGone):  # it has all it needs but the last bytes
        await client.end(b"".join(frames))


class _StreamRelay:
    """Turns upstream chunks into client frames, in the engine's shape.

    A chunk is forwarded byte for byte unless a repair touched it. When the router forced the
    usage chunk, it is dropped, and its ``system_fingerprint`` moves to the finish chunk, which
    is held back one event for that: that is where vLLM puts it without ``include_usage``. When
    the router asked for token IDs the client did not want, a chat chunk left with nothing but
    them is dropped: vLLM sends it only because IDs were asked for (its IDs are still counted).
    """

    __slots__ = ("_held_finish", "chat", "exposure", "route")

    def __init__(self, exchange: Exchange) -> None:
        self.exposure = exchange.exposure
        self.route = exchange.request.route
        self.chat = self.route == "chat"
        self._held_finish: dict[str, Any] | None = None

    def add(self, event: ChunkEvent, out: list[bytes]) -> None:
        """Append the frames ``event`` gives (none, one, or the held finish and one) to
        ``out``. Runs once per relayed chunk: kept to the fewest calls."""
        exposure = self.exposure
        facts = event.facts
        chunk = event.chunk
        if facts.usage_only and exposure.drop_usage_chunk:
            if self._held_finish is not None:
                fingerprint = chunk.get("system_fingerprint")
                if fingerprint is not None and "system_fingerprint" not in self._held_finish:
                    self._held_finish["system_fingerprint"] = fingerprint
            self.flush(out)
            return
        if (
            exposure.hide_token_ids
            and facts.has_token_ids
            and not (facts.output or facts.finish)
            and self.chat
            and only_hidden_ids(chunk)
        ):
            self.flush(out)  # the engine sends it only because the router asked for IDs
            return
        if self._held_finish is not None:
            self.flush(out)
        changed = expose(chunk, self.route, exposure)
        if facts.finish and exposure.drop_usage_chunk:
            self._held_finish = chunk
            return
        out.append(encode_data(orjson.dumps(chunk) if changed else event.raw))

    def flush(self, out: list[bytes]) -> None:
        """Append the held finish chunk, if any, to ``out``."""
        if self._held_finish is not None:
            chunk, self._held_finish = self._held_finish, None
            out.append(encode_data(orjson.dumps(chunk)))
