"""The router's state, shared by every request: engines, accounting, metrics.

The web layer holds one :class:`Router`; everything a handler needs comes from it, so tests and
embedders can build one from a :class:`~narwhal.config.Config` and a set of transports.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import httpx
import trio

from narwhal.admission.accounting import Accounting, AccountingStatistics, Ticket
from narwhal.admission.instants import Instants, Turn
from narwhal.admission.limits import RetentionLimit, RetentionStatistics
from narwhal.admission.margin import SafetyMargin
from narwhal.admission.observer import Decision, Observers, Served, Verdict
from narwhal.admission.predictor import Ticks, judge, project
from narwhal.admission.queue import AdmissionQueue, QueueStatistics, Waiter
from narwhal.admission.sizing import Sizer, TokenizerCounter
from narwhal.config import Config, ConfigError
from narwhal.control.lease import Lease, LeaseStatistics, open_lease
from narwhal.control.maintenance import Maintenance
from narwhal.control.state import ControlState, RouterState
from narwhal.control.watchdog import Watchdog
from narwhal.errors import PredictiveRefusal, Unavailable
from narwhal.scheduling.engines import Engine, EnginePool, EngineStatistics, Slot
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.health import EngineHealth
from narwhal.scheduling.lengths import OutputLengths
from narwhal.scheduling.profiles import get_profile
from narwhal.upstream.client import EngineClient
from narwhal.upstream.health import HealthPoller, client_of
from narwhal.web.metrics import Metrics

if TYPE_CHECKING:
    from narwhal.upstream.exchange import Exchange
    from narwhal.upstream.whole import WholeExchange

__all__ = [
    "LiveRequest",
    "Placed",
    "Router",
    "RouterBase",
    "RouterState",
    "RouterStatistics",
    "build_engines",
    "refuse_unless_active",
    "sizer_for",
]


@attrs.define(eq=False)
class LiveRequest:
    """A request the router holds, from arrival to its last byte.

    ``scope`` wraps the whole request; :meth:`Router.cut_streams` cancels it (with ``cut`` set)
    to end the request at a shutdown's drain deadline.
    """

    request_id: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    cut: bool = False


@attrs.frozen
class Placed:
    """An admitted request's placement, while the request holds it.

    Attributes:
        slot: its place on an engine.
        decision: what admission decided and why (``None`` in a relay worker: the controller
            holds it, :mod:`narwhal.workers`).
        teach: what to call with the TTFT when the first output event arrives (the safety
            margin learns how the projection fared), or ``None``.
    """

    slot: Slot
    decision: Decision | None = None
    teach: Callable[[float], None] | None = None


@attrs.frozen
class RouterStatistics:
    """What ``/ready`` shows: state, reason, counters and engines."""

    state: str
    reason: str | None
    mode: str
    accounting: AccountingStatistics
    engines: tuple[EngineStatistics, ...]
    retention: RetentionStatistics
    queue: QueueStatistics
    lease: LeaseStatistics | None = None

    @property
    def ready(self) -> bool:
        """Active, with at least one eligible engine."""
        return self.state == "active" and any(engine.eligible for engine in self.engines)

    def why_not_ready(self) -> str | None:
        """``None`` when ready; else the refusal code clients get (``router_fenced``...)."""
        if self.reason is not None:
            return self.reason
        if self.state != "active":
            return f"router_{self.state}"
        return None if self.ready else "backend_unavailable"

    def as_json(self) -> dict[str, Any]:
        """The ``/ready`` body."""
        body: dict[str, Any] = {
            "state": self.state,
            "reason": self.why_not_ready(),
            "admission": {"mode": self.mode},
        }
        if self.lease is not None:
            body["lease"] = self.lease.as_json()
        return body | {
            "counters": self.accounting.as_json(),
            "engines": [
                {
                    "name": engine.name,
                    "eligible": engine.eligible,
                    "reason": engine.reason,
                    "token_accounting": engine.token_accounting,
                    "wave": engine.wave,
                    "occupancy": {"prefill": engine.prefill, "decode": engine.decode},
                    "profiled": engine.profiled,
                    "drift": engine.drift.as_json(),
                }
                for engine in self.engines
            ],
        }


_E = TypeVar("_E", bound=Engine)


def build_engines(
    config: Config,
    kind: type[_E],
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    **extra: Any,
) -> list[_E]:
    """The configured engines, each with its client, limits, prior forecast and health, as
    ``kind`` (:class:`~narwhal.scheduling.engines.Engine`, or a relay worker's mirror of
    one); ``extra`` goes to each."""
    transports = transports or {}
    admission = config.admission
    engines = []
    for engine in config.engines:
        prefill = engine.prefill_concurrency or admission.prefill_concurrency
        client = EngineClient(engine, config.upstream, transport=transports.get(engine.name))
        engines.append(
            kind(
                engine,
                client,
                prefill_limit=prefill,
                decode_limit=engine.decode_concurrency or admission.decode_concurrency,
                forecast=PrefillForecast(get_profile(engine.profile), prefill_limit=prefill),
                health=EngineHealth(
                    failure_threshold=config.monitoring.failure_threshold,
                    open_s=config.monitoring.breaker_open_s,
                ),
                **extra,
            )
        )
    return engines


def sizer_for(config: Config) -> Sizer:
    """The prompt sizer of ``config``: ``serving.tokenizer``'s counts, else estimates.

    Raises:
        ConfigError: the tokenizer file cannot be loaded.
    """
    counter = None
    if config.serving.tokenizer:
        try:
            counter = TokenizerCounter.from_file(config.serving.tokenizer)
        except RuntimeError as exc:
            raise ConfigError(f"serving.tokenizer: {exc}") from exc
    return Sizer(counter)


def refuse_unless_active(state: str) -> None:
    """Raise what a request gets from a router in ``state``, unless it is active.

    Raises:
        Unavailable: 503 with ``router_<state>`` while standby, fenced, in maintenance,
            monitoring-degraded or draining.
    """
    if state == "draining":
        raise Unavailable(
            "This router is shutting down and admits no requests; retry on another.",
            code="router_draining",
        )
    if state != "active":
        raise Unavailable(
            f"This router is {state.replace('_', '-')} and admits no requests; retry shortly.",
            code=f"router_{state}",
        )


def _never(request_id: str) -> bool:
    return False


def _identity(config: Config) -> str:
    """Who this router is, in the leader key while it holds the lease."""
    return f"{socket.gethostname()} pid {os.getpid()} ({config.serving.bind})"


class RouterBase:
    """What the request path (:mod:`narwhal.web.completions`) and the server's shutdown ask of
    a router, whoever holds the books.

    :class:`Router` holds everything in this process (the default, and the admission
    controller of relay workers); a relay worker's :class:`~narwhal.workers.worker.WorkerRouter`
    holds only its own requests and asks the controller for the rest. What every request
    passes through is one method here, so that the two cannot drift apart: the request's
    ticket in the books (:meth:`offer`), its HTTP retention slot (:meth:`retain`), its
    admission and placement (:meth:`placement`), and what it taught (:meth:`learn`).
    """

    config: Config
    pool: EnginePool
    sizer: Sizer

    def __init__(self, config: Config) -> None:
        self.config = config
        self._live: set[LiveRequest] = set()
        self._idle = trio.Event()
        self._idle.set()

    # -- what every request passes through --------------------------------------------------------

    def check_state(self) -> None:
        """Refuse work unless the router is active.

        Raises:
            Unavailable: 503 with ``router_<state>`` while standby, fenced, in maintenance,
                monitoring-degraded or draining.
        """
        raise NotImplementedError

    def offer(self, request_id: str) -> Ticket:
        """Count one arrival; its ticket, to use as a context manager around the request."""
        raise NotImplementedError

    def retain(self, ticket: Ticket) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold an HTTP retention slot for ``ticket``'s request while the block runs.

        Raises:
            CapacityRejection: none is free (429 ``http_retention_full``).
        """
        raise NotImplementedError

    def placement(
        self, ticket: Ticket, waiter: Waiter, arrival: float
    ) -> contextlib.AbstractAsyncContextManager[Placed]:
        """Admit ``ticket``'s request, sized as ``waiter`` (arrived at ``arrival``), and hold
        its placement while the block runs, given back at exit however it ends.

        Raises:
            PredictiveRefusal: predictive mode refuses it.
            CapacityRejection: the queue is full.
            Expired: the admission wait ran out.
            Unavailable: no eligible engine could serve it, or the router does not place.
        """
        raise NotImplementedError

    def learn(self, exchange: Exchange | WholeExchange, placed: Placed) -> None:
        """Feed a completed request's measurements back."""
        raise NotImplementedError

    def count_client_timeout(self, kind: str) -> None:
        """A client took too long to send its request ``headers`` or ``body``."""
        raise NotImplementedError

    def forwards(self, scope: Mapping[str, Any]) -> bool:
        """Whether the request of ASGI ``scope`` is another process's to answer
        (:meth:`forward`): a relay worker's routes but the completions and ``/health``."""
        return False

    async def forward(
        self,
        scope: Mapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        """Have the request of ``scope`` answered where :meth:`forwards` says."""
        raise NotImplementedError

    # -- requests in flight, and shutdown --------------------------------------------------------

    @contextmanager
    def hold(self, request_id: str) -> Iterator[LiveRequest]:
        """Hold one request while the block runs (every completion request is held)."""
        live = LiveRequest(request_id)
        self._live.add(live)
        if self._idle.is_set():
            self._idle = trio.Event()
        try:
            yield live
        finally:
            self._live.discard(live)
            if not self._live:
                self._idle.set()

    def in_flight(self) -> int:
        """Requests held now (streams running included)."""
        return len(self._live)

    async def wait_idle(self) -> None:
        """Return once no request is held."""
        await self._idle.wait()

    def begin_drain(self) -> None:
        """Stop admitting for a shutdown: new requests get 503 ``router_draining``."""
        raise NotImplementedError

    def cut_streams(self) -> None:
        """End every held request now: in-band error on streams, 503 before headers.

        Counted ``unavailable`` with reason ``shutdown``.
        """
        for live in self._live:
            live.cut = True
            live.scope.cancel()

    async def start(self, nursery: trio.Nursery) -> None:
        """Start what the router runs beside its requests, in ``nursery``."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop and close every engine's connection pool."""
        raise NotImplementedError

    def model_object(self) -> dict[str, Any]:
        """What ``/v1/models`` shows for ``serving.model``: the engines' own model object.

        The first eligible engine's (in configuration order), as its last good poll read it;
        while none is eligible, the first engine's that has reported one; before any engine
        has, a minimal object naming the model (``owned_by: narwhal``).
        """
        cards = [engine.model_card for engine in self.pool if engine.eligible]
        cards += [engine.model_card for engine in self.pool]
        for card in cards:
            if card is not None:
                return dict(card)
        return {
            "id": self.config.serving.model,
            "object": "model",
            "created": 0,
            "owned_by": "narwhal",
        }


class Router(RouterBase):
    """Engines, books and metrics of one Narwhal process (or of relay workers' controller).

    Args:
        config: the configuration.
        transports: optional httpx transports by engine name (tests and the demo use the
            in-process simulator); engines without one use the network.
    """

    def __init__(
        self,
        config: Config,
        *,
        transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        super().__init__(config)
        transports = transports or {}
        admission = config.admission
        self.pool = EnginePool(
            build_engines(config, Engine, transports), tpot_target_s=admission.tpot_target_s
        )
        self.accounting = Accounting()
        self.retention = RetentionLimit(admission.http_retention_limit)
        self.lengths = OutputLengths()
        self.queue = AdmissionQueue(self.pool, admission.queue_limit, self.lengths)
        self.sizer = sizer_for(config)
        self.margin = SafetyMargin()
        self.ticks = Ticks()
        self.instants = Instants()
        # The conditions that decide the router's state (narwhal.control.state).
        self.control = ControlState()
        # The watchdog (narwhal.control.watchdog): the one part that sets monitoring-degraded.
        self.watchdog = Watchdog.for_config(config.monitoring)
        self.queue.control = self.control  # a fenced or standby router places nothing
        # The lease (narwhal.control.lease): the one part that sets the lease condition.
        self.lease: Lease = open_lease(
            config.control, self.control, identity=_identity(config), on_token=self._fence
        )
        # Maintenance waves (narwhal.control.maintenance): the one part that sets the
        # maintenance condition.
        self.maintenance = Maintenance(self.pool, self.control, config.maintenance)
        # What admission decided and how it turned out (narwhal.admission.observer); the
        # metrics listen first.
        self.observers = Observers()
        self.metrics = Metrics(self)
        self.observers.add(self.metrics)
        # Asked with the request's id when predictive admission would refuse it: true lets it
        # in all the same, as shadow mode would (the benchmark's forced-in reruns).
        self.exempt: Callable[[str], bool] = _never
        # What start() runs beside the requests, until aclose() (narwhal.web.app's lifespan).
        self._background: trio.CancelScope | None = None
        self._background_done = trio.Event()

    @property
    def state(self) -> RouterState:
        """The router's state (:class:`~narwhal.control.state.ControlState`)."""
        return self.control.state

    @property
    def state_reason(self) -> str | None:
        """Why the router is not active, or ``None``."""
        return self.control.reason

    def check_state(self) -> None:
        refuse_unless_active(self.state)

    # -- what every request passes through --------------------------------------------------------

    def offer(self, request_id: str) -> Ticket:
        return self.accounting.offer(request_id)

    @asynccontextmanager
    async def retain(self, ticket: Ticket) -> AsyncIterator[None]:
        with self.retention.hold():
            yield

    def count_client_timeout(self, kind: str) -> None:
        self.metrics.count_client_timeout(kind)

    @asynccontextmanager
    async def placement(
        self, ticket: Ticket, waiter: Waiter, arrival: float
    ) -> AsyncIterator[Placed]:
        # A projection is decided in turn with the requests of its instant, knowing those
        # behind it (open mode projects nothing); the turn ends once the request is queued or
        # placed, or however it ends before.
        turn = None
        if self.config.admission.mode != "open":
            expect = self.ticks.share > 0  # no tick seen lately: no wait for one
            turn = await self.instants.arrive(waiter, expect_company=expect)
        try:
            decision = self.decide(waiter, arrival, ticket.request_id, turn=turn)
            projection = decision.projection
            teach = None
            if projection is not None:  # the margin learns how the projection fared (shadow too)
                teach = partial(
                    self.margin.observe,
                    projection.fixed_s,
                    projection.wait_s,
                    projection.own_prefill_s,
                    budget_s=decision.budget_s,
                    seat_s=projection.seat_s,
                )
            wait_s = self.config.admission.admission_wait_s
            queued = None if turn is None else turn.done
            async with self.queue.placement(waiter, wait_s, queued=queued) as slot:
                self.metrics.queue_wait.observe(trio.current_time() - waiter.enqueued_at)
                yield Placed(slot, decision, teach)
        finally:
            if turn is not None:
                turn.done()

    def decide(
        self, waiter: Waiter, arrival: float, request_id: str = "", *, turn: Turn | None = None
    ) -> Decision:
        """Decide on a sized request, tell the observers what and why, then apply it.

        ``open`` mode projects nothing; ``predictive`` and ``shadow`` project the request's
        TTFT and judge it against the budget, and only ``predictive`` refuses (unless the
        router's ``exempt`` hook lets this request through): ``shadow`` records the would-be
        refusal and admits the request, as ``open`` mode does.

        ``turn``: its turn in its instant (:mod:`narwhal.admission.instants`): the requests
        that arrived after it in the same instant are walked in its projection.

        Raises:
            PredictiveRefusal: predictive mode refuses the request.
            Unavailable: no eligible engine could serve it.
        """
        admission = self.config.admission
        mode, budget = admission.mode, admission.ttft_budget_s
        projection = refusal = None
        if mode == "open":
            serviceable = self.pool.any_eligible(need_token_ids=waiter.need_token_ids)
        else:
            now = trio.current_time()
            # The rest of its instant has been read (its turn): those behind it are walked. A
            # request alone in its instant expects the learned share of ticks' joiners.
            chance = self.ticks.arrive(now)
            company = turn is not None and not turn.alone
            if company:
                chance = 0.0
            behind = turn.behind if turn is not None else []
            projection = project(
                self.pool,
                (),  # the queue's plan has walked every waiting request
                waiter,
                self.lengths,
                now=now,
                elapsed_s=now - arrival,
                overhead_s=admission.frontend_overhead_s,
                margin=self.margin,
                tpot_target_s=admission.tpot_target_s,
                plan=self.queue.current_plan(),
                overrun=self.queue.overrun(now, self.margin.floor_share * budget),
                budget_s=budget,
                overloaded=self.margin.overloaded(now, budget),
                joiners=chance,
                behind=behind,
                company=company,
            )
            serviceable = projection is not None
            if projection is not None:
                refusal = judge(projection, budget)
                waiter.projected_wait_s = projection.wait_s
                if refusal is not None and refusal.code == PredictiveRefusal.default_code:
                    self.margin.refused(now)  # over budget on its wait (shadow mode's too)
        verdict: Verdict = "admitted"
        if not serviceable:
            verdict = "unavailable"
        elif refusal is not None and mode == "predictive" and not self.exempt(request_id):
            verdict = "refused"
        decision = Decision.of(mode, budget, verdict, projection, refusal, request_id=request_id)
        self.observers.decided(decision)
        if verdict == "unavailable":
            raise Unavailable("No engine is eligible to serve this request; retry shortly.")
        if verdict == "refused" and refusal is not None:
            raise refusal
        return decision

    def learn(self, exchange: Exchange | WholeExchange, placed: Placed) -> None:
        """Feed a completed request's measurements back: the observers (the metrics among
        them), the output lengths and the prompt-size ratio."""
        measured = exchange.measurements
        # One observation per output event after the first: each read's gap, and zero for
        # the events that came with it.
        gaps = self.metrics.inter_token_gap
        together = 0
        for gap, events in measured.gaps:
            gaps.observe(gap)
            together += events - 1
        if together:
            gaps.observe(0.0, together)
        request = exchange.request
        self._learned(
            placed,
            engine=exchange.engine.name,
            ttft=measured.ttft,
            predicted_ttft=measured.predicted_ttft,
            produced=measured.output_tokens or measured.completion_tokens_reported,
            finished=exchange.finished,
            route=request.route,
            max_output_tokens=request.max_output_tokens,
        )
        if measured.prompt_tokens_reported:
            self.sizer.learn(
                exchange.engine.name, exchange.request, measured.prompt_tokens_reported
            )

    def learn_remote(
        self,
        placed: Placed | None,
        *,
        engine: str,
        ttft: float | None,
        predicted_ttft: float | None,
        gaps: list[list[int]],
        gap_sum: float,
        produced: int | None,
        finished: bool,
        route: str,
        max_output_tokens: int | None,
    ) -> None:
        """:meth:`learn` for a request a relay worker served (:mod:`narwhal.workers`): the
        worker counted its gaps into the histogram's buckets (``[bucket, count]`` pairs and
        their sum), and learnt the prompt-size ratio itself (it sizes its requests)."""
        self.metrics.inter_token_gap.add(gaps, gap_sum)
        if placed is not None:
            self._learned(
                placed,
                engine=engine,
                ttft=ttft,
                predicted_ttft=predicted_ttft,
                produced=produced,
                finished=finished,
                route=route,
                max_output_tokens=max_output_tokens,
            )

    def _learned(
        self,
        placed: Placed,
        *,
        engine: str,
        ttft: float | None,
        predicted_ttft: float | None,
        produced: int | None,
        finished: bool,
        route: str,
        max_output_tokens: int | None,
    ) -> None:
        if placed.decision is not None:
            self.observers.served(placed.decision, Served(engine, ttft, predicted_ttft))
        if produced is not None and finished:
            self.lengths.learn(route, max_output_tokens, produced, placed.slot.prompt_tokens)

    # -- shutdown ---------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Stop admitting for a shutdown: ``/ready`` turns 503, new requests get 503.

        Requests already placed go on until :meth:`cut_streams`; the lease is given up at
        once, so that the other router of an HA pair takes over.
        """
        self.control.begin_drain()
        self.lease.release()

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the lease, the dispatcher, one health poller per engine and the watchdog in a
        nursery of their own inside ``nursery``; :meth:`aclose` stops them before it closes
        what they use."""
        self._background = await nursery.start(self._run_background)

    async def _run_background(
        self, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.lease.run)
                    await nursery.start(self.queue.run)
                    await nursery.start(self.maintenance.run)
                    for engine in self.pool:
                        nursery.start_soon(HealthPoller.for_engine(engine, self.config).run)
                    await nursery.start(self.watchdog.run, self.control, self._poll_views)
                    task_status.started(scope)
        finally:
            self._background_done.set()

    def _poll_views(self) -> list[EngineStatistics]:
        return [engine.statistics() for engine in self.pool]

    def _fence(self, token: int) -> None:
        """The lease's fencing token goes to the engines with every request from now on."""
        for engine in self.pool:
            client_of(engine).set_fence(token)

    async def aclose(self) -> None:
        """Stop the dispatcher and the background tasks, then close every engine's connection
        pool (a poll after that would fail on a closed client)."""
        self.queue.close()
        if self._background is not None:
            self._background.cancel()
            await self._background_done.wait()
        for engine in self.pool:
            await engine.client.aclose()

    async def wait_ready(self, poll_s: float = 0.01) -> None:
        """Return once ``/ready`` would answer 200 (tests and the demo)."""
        while not self.statistics().ready:  # noqa: ASYNC110 - readiness has many sources
            await trio.sleep(poll_s)

    def statistics(self) -> RouterStatistics:
        """A frozen snapshot."""
        return RouterStatistics(
            state=self.state,
            reason=self.state_reason,
            mode=self.config.admission.mode,
            accounting=self.accounting.statistics(),
            engines=tuple(engine.statistics() for engine in self.pool),
            retention=self.retention.statistics(),
            queue=self.queue.statistics(),
            lease=self.lease.statistics(),
        )
