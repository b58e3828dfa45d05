"""The admission controller: one :class:`~narwhal.router.Router` for every relay worker.

The controller holds what must be one per pool (the queue, the limits, the forecasts and the
learning, the books, the lease, the health polls, the metrics) and the workers hold their
clients' connections and the engines' streams (:mod:`narwhal.workers.worker`). For every
request a worker holds, the controller holds the same resources the single-process router
would, in the same constructs: its ticket in the books, its HTTP retention slot, its queue
place and engine slots. Each comes back when the worker says so, and all of a worker's come
back when its connection ends, however it ends: a worker that dies has its open tickets
counted ``failed`` (reason ``worker_lost``) and its slots released, so the conservation law and
every limit hold across workers.

The messages (all per request, never per token; :mod:`narwhal.workers.wire`), from a worker:

==============  ======================================================================
``hello``       the worker's pid; answered with the state
``offer``       a request arrived: its ticket
``retain``      (call) the router's state and the retention limit, for the request
``unretain``    its retention slot back
``place``       (call) admission and placement; answered once placed, or with the error
``first``       a slot's first output event: prefill to decode, the TTFT taught
``progress``    batched, every :data:`~narwhal.workers.worker.PROGRESS_S`: gaps and tokens
``retake``      (call) an attempt failed before headers: a slot on another engine
``release``     a slot back (``s`` 0: the placement, waiting or placed), with its last
                progress
``health``      an engine answered again, or met a transport failure
``outcome``     a request placed on an engine ended, answered in full or failed there
``learn``       a completed request's measurements
``finish``      the request's terminal class
``timeout``     a client was too slow to send its headers or body
``asgi``        (call) any other route (``/ready``, ``/metrics``, ``/admin``...), answered by
                the controller's own app, so every worker shows the pool's one truth
==============  ======================================================================

and to every worker, whenever it changes (checked every :data:`STATE_S`), ``state``: the
router's state and each engine's eligibility, token accounting, context length and circuit.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import trio
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from narwhal.admission.accounting import Ticket
from narwhal.admission.context import too_short
from narwhal.admission.queue import Waiter
from narwhal.errors import NarwhalError, Unavailable
from narwhal.router import Placed, Router
from narwhal.scheduling.engines import Engine, Slot
from narwhal.scheduling.health import Failure
from narwhal.upstream.health import report_failure
from narwhal.workers.wire import Channel, Message

__all__ = ["STATE_S", "Controller", "encode_error", "open_controller_listener"]

log = logging.getLogger(__name__)

ASGIApp = Callable[..., Awaitable[None]]

STATE_S = 0.02
"""How often the controller checks whether the state it told its workers has changed."""


def encode_error(error: NarwhalError) -> Message:
    """What a worker needs to answer and count ``error`` as this process would."""
    return {
        "status": error.http_status,
        "type": error.type,
        "code": error.code,
        "param": error.param,
        "message": error.message,
        "headers": error.headers,
        "counted": error.counted_as,
    }


async def open_controller_listener(path: str) -> trio.SocketListener:
    """A listener on the Unix socket ``path`` (replacing a stale one), readable by its owner
    only."""
    import errno
    import os
    import stat

    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            if await _answers(path):
                raise OSError(errno.EADDRINUSE, f"a controller already listens on {path}")
            os.unlink(path)  # a stale one, left by a controller that died
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def _answers(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    try:
        stream = await trio.open_unix_socket(path)
    except OSError:
        return False
    await stream.aclose()
    return True


@attrs.define(eq=False)
class _Request:
    """What the controller holds for one request of a worker."""

    key: str
    ticket: Ticket
    arrival: float = 0.0  # by the controller's clock (the worker's elapsed time subtracted)
    retained: bool = False
    placing: trio.CancelScope | None = None  # the placement task, while it runs
    placed: Placed | None = None
    slots: dict[int, Slot] = attrs.field(factory=dict)  # 0: the placement; then retakes
    next_slot: int = 1

    @property
    def done(self) -> bool:
        return (
            self.ticket.finished is not None
            and not self.retained
            and self.placing is None
            and not self.slots
        )


class Controller:
    """Serves relay workers from ``router``; ``app`` answers their other routes.

    Args:
        router: the router that holds the pool's state (started by its app's lifespan).
        app: the ASGI app over ``router`` (:func:`narwhal.web.app.create_app`).
    """

    def __init__(self, router: Router, app: ASGIApp) -> None:
        self.router = router
        self.app = app
        self.workers: set[_Worker] = set()
        self._changed = trio.Event()
        router.metrics.registry.register(_WorkersCollector(self))

    @property
    def connected(self) -> int:
        """Workers connected now."""
        return len(self.workers)

    async def wait_connected(self, count: int) -> None:
        """Return once at least ``count`` workers are connected."""
        while self.connected < count:
            await self._changed.wait()

    async def wait_left(self) -> None:
        """Return once no worker is connected."""
        while self.connected:
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(
        self,
        listener: trio.abc.Listener[trio.abc.Stream],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept workers on ``listener`` and serve each until it goes, until cancelled."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(self.serve_worker, stream)

    async def serve_worker(self, stream: trio.abc.Stream) -> None:
        """Serve one worker until its connection ends; then give back all it held."""
        worker = _Worker(self, Channel(stream, name="a relay worker"))
        self.workers.add(worker)
        self._notify()
        try:
            await worker.run()
        finally:
            self.workers.discard(worker)
            self._notify()
            worker.lost()


class _Worker:
    """One worker's connection and the requests it holds."""

    def __init__(self, controller: Controller, channel: Channel) -> None:
        self.controller = controller
        self.router = controller.router
        self.channel = channel
        self.pid: int | None = None
        self.requests: dict[str, _Request] = {}
        self.nursery: trio.Nursery | None = None
        self._engines = {engine.name: engine for engine in self.router.pool}
        self._told: Message | None = None
        self._handlers: dict[str, Callable[[Message], None]] = {
            "hello": self._hello,
            "offer": self._offer,
            "retain": self._retain,
            "unretain": self._unretain,
            "place": self._place,
            "first": self._first,
            "progress": self._progress,
            "retake": self._retake,
            "release": self._release,
            "health": self._health,
            "outcome": self._outcome,
            "learn": self._learn,
            "finish": self._finish,
            "timeout": self._timeout,
            "asgi": self._asgi,
        }

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._tell_state)
            await self.channel.run(self._handle)
            nursery.cancel_scope.cancel()

    def _handle(self, message: Message) -> None:
        handler = self._handlers.get(message.get("t", ""))
        if handler is None:
            log.error("a relay worker sent an unknown message %r; closing", message.get("t"))
            self.channel.close()
            return
        try:
            handler(message)
        except (KeyError, TypeError, ValueError):
            log.exception("a relay worker sent a malformed %r message; closing", message.get("t"))
            self.channel.close()

    def lost(self) -> None:
        """The connection ended: whatever the worker held comes back, and its open requests
        are counted."""
        left = [request for request in self.requests.values() if not request.done]
        unfinished = 0
        for request in left:
            if request.placing is not None:
                request.placing.cancel()  # the placement task gives its slot back
            for slot in request.slots.values():
                slot.release()
            request.slots.clear()
            if request.retained:
                self.router.retention.release()
                request.retained = False
            if request.ticket.finished is None:
                request.ticket.finish("failed", "worker_lost")
                unfinished += 1
        self.requests.clear()
        if unfinished:
            log.warning(
                "relay worker %s went away holding %d requests; counted failed (worker_lost)",
                self.pid,
                unfinished,
            )

    def _forget_if_done(self, request: _Request) -> None:
        if request.done:
            self.requests.pop(request.key, None)

    # -- the state, told to the worker ---------------------------------------------------------

    def state(self) -> Message:
        router = self.router
        return {
            "t": "state",
            "state": router.state,
            "reason": router.state_reason,
            "ids": router.pool.any_provides_token_ids(),
            "engines": [
                [
                    engine.name,
                    engine.eligible,
                    engine.token_accounting,
                    engine.max_model_len,
                    engine.health.probe_at() is not None,  # its circuit is open
                ]
                for engine in router.pool
            ],
        }

    async def _tell_state(self) -> None:
        while True:
            state = self.state()
            if state != self._told:
                self._told = state
                self.channel.send(state)
            await trio.sleep(STATE_S)

    # -- the messages --------------------------------------------------------------------------

    def _hello(self, message: Message) -> None:
        self.pid = int(message["pid"])
        log.info("relay worker %d connected", self.pid)

    def _offer(self, message: Message) -> None:
        key = str(message["id"])
        if key in self.requests:
            raise ValueError(f"request key {key!r} offered twice")
        self.requests[key] = _Request(key, self.router.offer(str(message["rid"])))

    def _request(self, message: Message) -> _Request | None:
        return self.requests.get(str(message["id"]))

    def _retain(self, message: Message) -> None:
        request = self._request(message)
        if request is None:
            self.channel.answer(message, {"err": encode_error(_unknown())})
            return
        try:
            self.router.check_state()
            self.router.retention.acquire()
        except NarwhalError as exc:
            self.channel.answer(message, {"err": encode_error(exc)})
            return
        request.retained = True
        self.channel.answer(message, {})

    def _unretain(self, message: Message) -> None:
        request = self._request(message)
        if request is not None and request.retained:
            request.retained = False
            self.router.retention.release()
            self._forget_if_done(request)

    def _place(self, message: Message) -> None:
        request = self._request(message)
        if request is None or self.nursery is None:
            self.channel.answer(message, {"err": encode_error(_unknown())})
            return
        waiter = Waiter(
            int(message["tokens"]),
            bool(message["ids"]),
            message["route"],
            None if message["max"] is None else int(message["max"]),
        )
        request.ticket.sized = True
        request.arrival = trio.current_time() - float(message["elapsed"])
        request.placing = trio.CancelScope()
        self.nursery.start_soon(self._placement, request, waiter, message)

    async def _placement(self, request: _Request, waiter: Waiter, message: Message) -> None:
        """Admit and place the request, and hold its placement until the worker gives it
        back (or goes)."""
        scope = request.placing
        assert scope is not None
        try:
            with scope:
                async with self.router.placement(request.ticket, waiter, request.arrival) as placed:
                    request.placed = placed
                    request.slots[0] = placed.slot
                    self.channel.answer(message, _slot_answer(0, placed.slot, request.arrival))
                    await trio.sleep_forever()  # until released: the scope is cancelled
        except NarwhalError as exc:
            self.channel.answer(message, {"err": encode_error(exc)})
        finally:
            request.placing = None
            request.slots.pop(0, None)
            self._forget_if_done(request)

    def _slot(self, message: Message) -> tuple[_Request, Slot] | None:
        request = self._request(message)
        if request is None:
            return None
        slot = request.slots.get(int(message["s"]))
        return None if slot is None else (request, slot)

    def _first(self, message: Message) -> None:
        found = self._slot(message)
        if found is None:
            return
        request, slot = found
        ttft = float(message["ttft"])
        now = request.arrival + ttft
        generated = int(message["gen"])
        if generated:
            slot.generated(generated, now=now)
        observed = bool(message["observed"])
        slot.to_decode(observed=observed, now=now)
        placed = request.placed
        if observed and placed is not None and placed.teach is not None:
            placed.teach(ttft)

    def _progress(self, message: Message) -> None:
        for key, number, gap_s, gap_tokens, generated, at in message["u"]:
            request = self.requests.get(key)
            slot = None if request is None else request.slots.get(number)
            if request is not None and slot is not None:
                _apply_progress(slot, request.arrival + at, gap_s, gap_tokens, generated)

    def _retake(self, message: Message) -> None:
        request = self._request(message)
        if request is None or self.nursery is None:
            self.channel.answer(message, {"none": True})
            return
        self.nursery.start_soon(self._retaking, request, message)

    async def _retaking(self, request: _Request, message: Message) -> None:
        primary = request.placed.slot if request.placed is not None else None
        pool = self.router.pool
        if primary is None:
            self.channel.answer(message, {"none": True})
            return
        excluded = [self._engines[name] for name in message["exclude"] if name in self._engines]
        excluded += too_short(pool, primary.prompt_tokens)
        other = await pool.retake(primary, exclude=excluded, need_token_ids=bool(message["ids"]))
        if other is None:
            self.channel.answer(message, {"none": True})
            return
        if request.key not in self.requests:  # the worker went meanwhile
            other.release()
            return
        number = request.next_slot
        request.next_slot += 1
        request.slots[number] = other
        self.channel.answer(message, _slot_answer(number, other, request.arrival))

    def _release(self, message: Message) -> None:
        request = self._request(message)
        if request is None:
            return
        number = int(message["s"])
        slot = request.slots.pop(number, None)
        if slot is not None:
            progress = message.get("p")
            if progress is not None:
                gap_s, gap_tokens, generated, at = progress
                _apply_progress(slot, request.arrival + at, gap_s, gap_tokens, generated)
            if message.get("failed") is not None:
                slot.failed(counted=bool(message["failed"]))
            else:
                slot.release()
        if number == 0 and request.placing is not None:
            request.placing.cancel()  # a placement still waiting leaves the queue
        self._forget_if_done(request)

    def _engine(self, message: Message) -> Engine | None:
        return self._engines.get(str(message["e"]))

    def _health(self, message: Message) -> None:
        engine = self._engine(message)
        if engine is None:
            return
        if message["ok"]:
            engine.request_answered(trio.current_time())
            return
        report_failure(engine, Failure(message["kind"], str(message["detail"])))

    def _outcome(self, message: Message) -> None:
        engine = self._engine(message)
        if engine is not None:
            engine.record_outcome(ok=bool(message["ok"]))

    def _learn(self, message: Message) -> None:
        request = self._request(message)
        engine = self._engine(message)
        if request is None or engine is None:
            return
        self.router.learn_remote(
            request.placed,
            engine=engine.name,
            ttft=message["ttft"],
            predicted_ttft=message["pred"],
            gaps=message["gaps"],
            gap_sum=float(message["gap_sum"]),
            produced=message["produced"],
            finished=bool(message["finished"]),
            route=message["route"],
            max_output_tokens=message["max"],
        )

    def _finish(self, message: Message) -> None:
        request = self._request(message)
        if request is None:
            return
        request.ticket.sized = request.ticket.sized or bool(message["sized"])
        if request.ticket.finished is None:
            request.ticket.finish(message["cls"], message["reason"] or None)
        self._forget_if_done(request)

    def _timeout(self, message: Message) -> None:
        self.router.count_client_timeout(str(message["kind"]))

    def _asgi(self, message: Message) -> None:
        if self.nursery is not None:
            self.nursery.start_soon(self._answer_route, message)

    async def _answer_route(self, message: Message) -> None:
        """Serve a forwarded request with the controller's app, in memory."""
        body = str(message["body"]).encode("latin-1")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": message["method"],
            "scheme": "http",
            "path": message["path"],
            "raw_path": str(message["path"]).encode("latin-1"),
            "query_string": str(message["query"]).encode("latin-1"),
            "root_path": "",
            "headers": [
                (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in message["headers"]
            ],
            "client": tuple(message["client"]) if message["client"] else None,
            "server": tuple(message["server"]) if message["server"] else None,
            "extensions": {},
        }
        sent = False
        answer: dict[str, Any] = {"status": 500, "headers": [], "body": ""}
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await trio.sleep_forever()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(event: dict[str, Any]) -> None:
            if event["type"] == "http.response.start":
                answer["status"] = event["status"]
                answer["headers"] = [
                    [bytes(name).decode("latin-1"), bytes(value).decode("latin-1")]
                    for name, value in event.get("headers", ())
                ]
            elif event["type"] == "http.response.body":
                chunks.append(bytes(event.get("body", b"")))

        try:
            await self.controller.app(scope, receive, send)
        except Exception:
            log.exception("the controller failed to answer a forwarded %s", message["path"])
            answer = {"status": 500, "headers": [], "body": ""}
            chunks = []
        answer["body"] = b"".join(chunks).decode("latin-1")
        self.channel.answer(message, answer)


class _WorkersCollector(Collector):
    """``narwhal_relay_workers``: the relay workers connected to this controller."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "narwhal_relay_workers",
            "Relay worker processes connected to this admission controller",
            value=self._controller.connected,
        )


def _slot_answer(number: int, slot: Slot, arrival: float) -> Message:
    return {"s": number, "e": slot.engine.name, "ttft": slot.predicted_first_token_at - arrival}


def _apply_progress(slot: Slot, now: float, gap_s: float, gap_tokens: int, generated: int) -> None:
    if gap_tokens:
        slot.observe_gap(gap_s, gap_tokens, now=now)
    if generated:
        slot.generated(generated, now=now)


def _unknown() -> Unavailable:
    return Unavailable("The router lost track of this request; retry it.", code="internal_error")
