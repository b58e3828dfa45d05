"""A relay worker: its clients' connections and the engines' streams, under a controller.

A worker parses, validates and sizes each request, relays its stream (or assembles one
response) and checks its token IDs, exactly as the single-process router does: the request
path (:mod:`narwhal.web.completions`) is the same code. What must be one per pool it asks of
its admission controller (:mod:`narwhal.workers.controller`) through :class:`WorkerRouter`:
the request's ticket, its retention slot, its admission and placement, and what it taught.
Those are messages per request; what the stream teaches its slot per read (gaps, tokens) is
gathered and sent every :data:`PROGRESS_S`, never per token.

The worker's engines (:class:`MirrorEngine`) carry the configured clients and mirror the
controller's view of each engine (eligible, token accounting, context length, circuit), which
the controller sends whenever it changes; what a request learns of an engine's health goes to
the controller, whose health and circuit are the pool's. Every route but the completions and
``/health`` is answered by the controller's own app, so ``/ready``, ``/metrics`` and ``/admin``
show the pool's one truth whichever worker answers.

A worker that loses its controller admits nothing more (503 ``router_draining``) and drains:
:attr:`WorkerRouter.lost` is set, for the server to end.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import orjson
import trio
from quart_trio import QuartTrio

from narwhal.admission.accounting import Accounting, TerminalClass, Ticket
from narwhal.admission.queue import Waiter
from narwhal.config import Config
from narwhal.errors import NarwhalError, RequestTooLarge, Unavailable
from narwhal.router import Placed, RouterBase, build_engines, refuse_unless_active, sizer_for
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.scheduling.health import Failure
from narwhal.web.metrics import GAP_BUCKETS, bucket_counts
from narwhal.workers.wire import Channel, ChannelClosed, Message

if TYPE_CHECKING:
    from narwhal.upstream.exchange import Exchange
    from narwhal.upstream.whole import WholeExchange

__all__ = [
    "CONNECT_S",
    "PROGRESS_S",
    "MirrorEngine",
    "WorkerRouter",
    "connect_unix",
    "create_worker_app",
]

log = logging.getLogger(__name__)

PROGRESS_S = 0.05
"""How often a worker sends what its streams taught their slots since the last time."""

CONNECT_S = 10.0
"""How long a worker starting tries to reach its controller."""


# -- errors across the channel ----------------------------------------------------------------

_ERROR_KINDS: dict[tuple[int, str, str | None], type[NarwhalError]] = {}


def decode_error(encoded: Message) -> NarwhalError:
    """The controller's error (:func:`~narwhal.workers.controller.encode_error`), to answer and
    count here exactly as there."""
    status, kind, counted = int(encoded["status"]), str(encoded["type"]), encoded["counted"]
    cls = _ERROR_KINDS.get((status, kind, counted))
    if cls is None:
        cls = type(
            "ControllerError",
            (NarwhalError,),
            {"status": status, "type": kind, "counted_as": counted},
        )
        _ERROR_KINDS[status, kind, counted] = cls
    return cls(
        str(encoded["message"]),
        param=encoded["param"],
        code=str(encoded["code"]),
        headers=dict(encoded["headers"]),
    )


def _lost() -> Unavailable:
    return Unavailable(
        "This relay worker lost its admission controller and admits no requests; retry.",
        code="router_draining",
    )


# -- the mirrors --------------------------------------------------------------------------------


@attrs.define(eq=False)
class MirrorEngine(Engine):
    """An engine as a worker sees it: its client, and the controller's view of its state.

    Its health reports go to the controller; an answer after a reported failure is told too
    (it closes the failure count), a healthy answer after another is not.
    """

    router: WorkerRouter | None = None
    mirrored_eligible: bool = False
    circuit_open: bool = False
    _failure_told: bool = attrs.field(default=False, init=False)

    @property
    def eligible(self) -> bool:
        return self.mirrored_eligible

    def mirror(self, eligible: bool, accounting: Any, context: int | None, opened: bool) -> None:
        """Take the controller's view; a circuit that opened fails the attempts waiting
        here at once, as the controller's own would."""
        self.mirrored_eligible = eligible
        self.token_accounting = accounting
        self.model_card = None if context is None else {"max_model_len": context}
        if opened and not self.circuit_open:
            for attempt in self.attempts:
                attempt.cancel()
        self.circuit_open = opened

    def request_answered(self, now: float) -> None:
        if self._failure_told and self.router is not None:
            self._failure_told = False
            self.router.tell({"t": "health", "e": self.name, "ok": True})

    def request_failed(self, now: float, failure: Failure) -> None:
        if self.router is not None:
            self._failure_told = True
            self.router.tell(
                {
                    "t": "health",
                    "e": self.name,
                    "ok": False,
                    "kind": failure.kind,
                    "detail": failure.detail,
                }
            )

    def record_outcome(self, *, ok: bool) -> None:
        if self.router is not None:
            self.router.tell({"t": "outcome", "e": self.name, "ok": ok})


class MirrorPool(EnginePool):
    """A worker's engines; a retry's slot comes from the controller."""

    def __init__(self, router: WorkerRouter, engines: list[MirrorEngine]) -> None:
        super().__init__(engines)
        self.router = router
        self.by_name = {engine.name: engine for engine in engines}
        self.mirrored_token_ids = False

    def any_provides_token_ids(self) -> bool:
        return self.mirrored_token_ids

    async def retake(
        self, failed: Slot, *, exclude: Any = (), need_token_ids: bool = False
    ) -> Slot | None:
        if not isinstance(failed, RemoteSlot):
            raise TypeError("a relay worker's slots are the controller's")
        router = self.router
        answer = await router.ask(
            {
                "t": "retake",
                "id": failed.request_key,
                "exclude": [engine.name for engine in exclude],
                "ids": need_token_ids,
            }
        )
        if answer.get("none"):
            return None
        return router.slot(
            failed.request_key,
            answer,
            failed.prompt_tokens,
            failed.route,
            failed.max_tokens,
            failed.arrival,
        )


@attrs.define(eq=False, hash=False)
class RemoteSlot(Slot):
    """A slot the controller holds for one of this worker's requests.

    What the stream teaches it (gaps, tokens) is gathered and sent every
    :data:`PROGRESS_S`; its first output and its release are told at once, with what was
    gathered since.
    """

    request_key: str = ""  # its request's key on the channel
    number: int = 0
    arrival: float = 0.0
    router: WorkerRouter | None = None
    _gap_s: float = attrs.field(default=0.0, init=False)
    _gap_tokens: int = attrs.field(default=0, init=False)
    _generated: int = attrs.field(default=0, init=False)
    _at: float = attrs.field(default=0.0, init=False)

    def observe_gap(self, gap_s: float, tokens: int, *, now: float | None = None) -> None:
        self._gap_s += gap_s
        self._gap_tokens += max(1, tokens)
        self._mark(now)

    def generated(self, tokens: int, *, now: float | None = None) -> None:
        self.generated_tokens += tokens
        self._generated += tokens
        self._mark(now)

    def _mark(self, now: float | None) -> None:
        self._at = (trio.current_time() if now is None else now) - self.arrival
        if self.router is not None:
            self.router.dirty[self] = None

    def progress(self) -> list[Any] | None:
        """What was gathered since the last time, ``[gap_s, gap_tokens, generated, at]``
        (``at`` from arrival), or ``None``; then nothing is."""
        if not (self._gap_tokens or self._generated):
            return None
        progress = [self._gap_s, self._gap_tokens, self._generated, self._at]
        self._gap_s, self._gap_tokens, self._generated = 0.0, 0, 0
        return progress

    @property
    def expected_first_token_at(self) -> float:
        return self.predicted_first_token_at

    def to_decode(self, *, observed: bool = True, now: float | None = None) -> None:
        if self.phase != "prefill":
            return
        self.phase = "decode"
        self.context_tokens = self.prompt_tokens
        generated, self._generated = self._generated, 0
        at = trio.current_time() if now is None else now
        if self.router is not None:
            self.router.tell(
                {
                    "t": "first",
                    "id": self.request_key,
                    "s": self.number,
                    "gen": generated,
                    "ttft": at - self.arrival,
                    "observed": observed,
                }
            )

    def failed(self, *, counted: bool = True) -> None:
        self._give_back(counted)

    def release(self) -> None:
        self._give_back(None)

    def _give_back(self, failed: bool | None) -> None:
        if self.phase == "released":
            return
        self.phase = "released"
        router = self.router
        if router is None:
            return
        router.dirty.pop(self, None)
        message: Message = {"t": "release", "id": self.request_key, "s": self.number}
        progress = self.progress()
        if progress is not None:
            message["p"] = progress
        if failed is not None:
            message["failed"] = failed
        router.tell(message)


class _RemoteTicket(Ticket):
    """A ticket whose books are the controller's; ``key`` names its request on the channel
    (clients' request ids need not be unique)."""

    __slots__ = ("key",)

    def __init__(self, books: Accounting, key: str, request_id: str) -> None:
        super().__init__(books, request_id)
        self.key = key


class _RemoteBooks(Accounting):
    """The books are the controller's: a ticket's finish is told there."""

    def __init__(self, router: WorkerRouter) -> None:
        super().__init__()
        self.router = router

    def _record(self, ticket: Ticket, terminal: TerminalClass, reason: str) -> None:
        key = ticket.key if isinstance(ticket, _RemoteTicket) else ""
        self.router.tell(
            {"t": "finish", "id": key, "cls": terminal, "reason": reason, "sized": ticket.sized}
        )


# -- the worker's router -------------------------------------------------------------------------


class WorkerRouter(RouterBase):
    """A relay worker's stand-in for :class:`~narwhal.router.Router` (module doc).

    Args:
        config: the configuration (the controller's).
        connect: opens the stream to the controller (:func:`connect_unix`).
        transports: optional in-process transports by engine name (tests).
    """

    def __init__(
        self,
        config: Config,
        connect: Callable[[], Awaitable[trio.abc.Stream]],
        *,
        transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        super().__init__(config)
        self._connect = connect
        engines = build_engines(config, MirrorEngine, transports, router=self)
        self.pool = self.mirrors = MirrorPool(self, engines)
        self.sizer = sizer_for(config)
        self.channel: Channel | None = None
        self.books = _RemoteBooks(self)
        self.dirty: dict[RemoteSlot, None] = {}
        self.state = "draining"  # until the controller says
        self.state_reason: str | None = None
        self._draining = False
        self._told = trio.Event()
        self.lost = trio.Event()
        self._keys = 0

    # -- the channel ----------------------------------------------------------------------------

    def tell(self, message: Message) -> None:
        """Send ``message`` to the controller (dropped once it is gone)."""
        if self.channel is not None:
            self.channel.send(message)

    async def ask(self, message: Message) -> Message:
        """Call the controller.

        Raises:
            Unavailable: the controller is gone (503 ``router_draining``).
        """
        if self.channel is None:
            raise _lost()
        try:
            return await self.channel.call(message)
        except ChannelClosed:
            raise _lost() from None

    def _handle(self, message: Message) -> None:
        if message.get("t") != "state":
            log.error("the controller sent an unknown message %r", message.get("t"))
            return
        self.state = str(message["state"])
        self.state_reason = message["reason"]
        self.mirrors.mirrored_token_ids = bool(message["ids"])
        for name, eligible, accounting, context, opened in message["engines"]:
            engine = self.mirrors.by_name.get(name)
            if engine is not None:
                engine.mirror(bool(eligible), accounting, context, bool(opened))
        self._told.set()

    async def start(self, nursery: trio.Nursery) -> None:
        """Reach the controller, wait for its state, and run the channel in ``nursery``."""
        stream = await self._connect()
        self.channel = channel = Channel(stream, name="the admission controller")
        await nursery.start(self._run, channel)
        channel.send({"t": "hello", "pid": os.getpid()})
        with trio.move_on_after(CONNECT_S) as waited:
            await self._told.wait()
        if waited.cancelled_caught:
            raise RuntimeError("the admission controller did not send its state")
        nursery.start_soon(self._send_progress)

    async def _run(
        self, channel: Channel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await channel.run(self._handle, task_status=task_status)
            if not self._draining:
                log.warning("relay worker %d lost its admission controller; draining", os.getpid())
        finally:  # ended, or cancelled (the worker stops)
            self._draining = True
            self.lost.set()

    async def _send_progress(self) -> None:
        while True:
            await trio.sleep(PROGRESS_S)
            if not self.dirty:
                continue
            updates = []
            for slot in self.dirty:
                progress = slot.progress()
                if progress is not None:
                    updates.append([slot.request_key, slot.number, *progress])
            self.dirty.clear()
            if updates:
                self.tell({"t": "progress", "u": updates})

    def slot(
        self,
        key: str,
        answer: Message,
        tokens: int,
        route: str,
        max_tokens: int | None,
        arrival: float,
    ) -> RemoteSlot:
        """The slot the controller's ``answer`` placed for a request of ``tokens`` prompt
        tokens that arrived at ``arrival``."""
        return RemoteSlot(
            self.mirrors.by_name[str(answer["e"])],
            tokens,
            trio.current_time(),
            route,
            max_tokens,
            arrival + float(answer["ttft"]),
            request_key=key,
            number=int(answer["s"]),
            arrival=arrival,
            router=self,
        )

    # -- what every request passes through ------------------------------------------------------

    def check_state(self) -> None:
        if self._draining:
            refuse_unless_active("draining")
        refuse_unless_active(self.state)

    def offer(self, request_id: str) -> Ticket:
        self._keys += 1
        key = f"{self._keys:x}"
        self.tell({"t": "offer", "id": key, "rid": request_id})
        return _RemoteTicket(self.books, key, request_id)

    @asynccontextmanager
    async def retain(self, ticket: Ticket) -> AsyncIterator[None]:
        key = _key(ticket)
        try:
            answer = await self.ask({"t": "retain", "id": key})
            if "err" in answer:
                raise decode_error(answer["err"])
            yield
        finally:
            self.tell({"t": "unretain", "id": key})

    @asynccontextmanager
    async def placement(
        self, ticket: Ticket, waiter: Waiter, arrival: float
    ) -> AsyncIterator[Placed]:
        key = _key(ticket)
        slot: RemoteSlot | None = None
        refused = False
        try:
            answer = await self.ask(
                {
                    "t": "place",
                    "id": key,
                    "tokens": waiter.prompt_tokens,
                    "ids": waiter.need_token_ids,
                    "route": waiter.route,
                    "max": waiter.max_tokens,
                    "elapsed": trio.current_time() - arrival,
                }
            )
            if "err" in answer:
                refused = True
                raise decode_error(answer["err"])
            slot = self.slot(
                key,
                answer,
                waiter.prompt_tokens,
                waiter.route,
                waiter.max_tokens,
                arrival,
            )
            yield Placed(slot)
        finally:
            if slot is not None:
                slot.release()
            elif not refused:  # cancelled while waiting: the placement leaves the queue
                self.tell({"t": "release", "id": key, "s": 0})

    def learn(self, exchange: Exchange | WholeExchange, placed: Placed) -> None:
        measured = exchange.measurements
        counts, total = bucket_counts(GAP_BUCKETS, _gap_observations(measured.gaps))
        request = exchange.request
        self.tell(
            {
                "t": "learn",
                "id": placed.slot.request_key if isinstance(placed.slot, RemoteSlot) else "",
                "e": exchange.engine.name,
                "ttft": measured.ttft,
                "pred": measured.predicted_ttft,
                "gaps": counts,
                "gap_sum": total,
                "produced": measured.output_tokens or measured.completion_tokens_reported,
                "finished": exchange.finished,
                "route": request.route,
                "max": request.max_output_tokens,
            }
        )
        if measured.prompt_tokens_reported:
            self.sizer.learn(exchange.engine.name, request, measured.prompt_tokens_reported)

    def count_client_timeout(self, kind: str) -> None:
        self.tell({"t": "timeout", "kind": kind})

    # -- the other routes, and shutdown --------------------------------------------------------

    def forwards(self, scope: Mapping[str, Any]) -> bool:
        return bool(scope["type"] == "http" and scope["path"] != "/health")

    async def forward(
        self,
        scope: Mapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        body = bytearray()
        while True:
            event = await receive()
            if event["type"] != "http.request":
                return  # the client went away
            body += event.get("body", b"")
            limit = self.config.serving.max_request_bytes  # as the app's own routes read it
            if len(body) > limit:
                too_large = RequestTooLarge.over(limit)
                await _answer(send, too_large.http_status, orjson.dumps(too_large.envelope()))
                return
            if not event.get("more_body", False):
                break
        try:
            answer = await self.ask(
                {
                    "t": "asgi",
                    "method": scope["method"],
                    "path": scope["path"],
                    "query": bytes(scope.get("query_string", b"")).decode("latin-1"),
                    "headers": [
                        [bytes(name).decode("latin-1"), bytes(value).decode("latin-1")]
                        for name, value in scope.get("headers", ())
                    ],
                    "client": list(scope["client"]) if scope.get("client") else None,
                    "server": list(scope["server"]) if scope.get("server") else None,
                    "body": bytes(body).decode("latin-1"),
                }
            )
        except Unavailable as exc:
            await _answer(send, exc.http_status, orjson.dumps(exc.envelope()))
            return
        await send(
            {
                "type": "http.response.start",
                "status": int(answer["status"]),
                "headers": [
                    (name.encode("latin-1"), value.encode("latin-1"))
                    for name, value in answer["headers"]
                ],
            }
        )
        await send({"type": "http.response.body", "body": str(answer["body"]).encode("latin-1")})

    def begin_drain(self) -> None:
        self._draining = True

    async def aclose(self) -> None:
        self._draining = True  # the channel's end is ours, not a lost controller
        if self.channel is not None:
            self.channel.close()
        for engine in self.pool:
            await engine.client.aclose()


def _key(ticket: Ticket) -> str:
    if not isinstance(ticket, _RemoteTicket):
        raise TypeError("a relay worker's tickets are its controller's")
    return ticket.key


def _gap_observations(gaps: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The inter-token gap observations of a request's reads (as :meth:`Router.learn`)."""
    observations: list[tuple[float, int]] = []
    together = 0
    for gap, events in gaps:
        observations.append((gap, 1))
        together += events - 1
    if together:
        observations.append((0.0, together))
    return observations


async def _answer(send: Callable[[Any], Awaitable[None]], status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def connect_unix(path: str, *, within_s: float = CONNECT_S) -> trio.abc.Stream:
    """A stream to the controller's Unix socket ``path``, retried for ``within_s`` while the
    controller starts.

    Raises:
        OSError: it could not be reached in time.
    """
    deadline = trio.current_time() + within_s
    while True:
        try:
            return await trio.open_unix_socket(path)
        except OSError:
            if trio.current_time() >= deadline:
                raise
            await trio.sleep(0.05)


def create_worker_app(
    config: Config,
    socket_path: str,
    *,
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
) -> QuartTrio:
    """The app of a relay worker whose controller listens on ``socket_path``."""
    from narwhal.web.app import create_app

    async def connect() -> trio.abc.Stream:
        return await connect_unix(socket_path)

    return create_app(config, router=WorkerRouter(config, connect, transports=transports))
