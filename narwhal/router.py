"""The router's state, shared by every request: engines, accounting, metrics.

The web layer holds one :class:`Router`; everything a handler needs comes from it, so tests and
embedders can build one from a :class:`~narwhal.config.Config` and a set of transports.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import httpx
import trio

from narwhal.admission.accounting import Accounting, AccountingStatistics
from narwhal.admission.limits import RetentionLimit, RetentionStatistics
from narwhal.admission.margin import SafetyMargin
from narwhal.admission.observer import Observers
from narwhal.admission.queue import AdmissionQueue, QueueStatistics
from narwhal.admission.sizing import Sizer, TokenizerCounter
from narwhal.config import Config, ConfigError
from narwhal.control.lease import Lease, LeaseStatistics, open_lease
from narwhal.control.maintenance import Maintenance
from narwhal.control.state import ControlState, RouterState
from narwhal.control.watchdog import Watchdog
from narwhal.errors import Unavailable
from narwhal.scheduling.engines import Engine, EnginePool, EngineStatistics
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.health import EngineHealth
from narwhal.scheduling.lengths import OutputLengths
from narwhal.scheduling.profiles import get_profile
from narwhal.upstream.client import EngineClient
from narwhal.upstream.health import HealthPoller, client_of
from narwhal.web.metrics import Metrics

__all__ = ["LiveRequest", "Router", "RouterState", "RouterStatistics"]


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


def _never() -> bool:
    return False


def _identity(config: Config) -> str:
    """Who this router is, in the leader key while it holds the lease."""
    return f"{socket.gethostname()} pid {os.getpid()} ({config.serving.bind})"


class Router:
    """Engines, books and metrics of one Narwhal process.

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
        self.config = config
        transports = transports or {}
        admission = config.admission
        self.pool = EnginePool(
            (
                Engine(
                    engine,
                    EngineClient(engine, config.upstream, transport=transports.get(engine.name)),
                    prefill_limit=prefill,
                    decode_limit=engine.decode_concurrency or admission.decode_concurrency,
                    forecast=PrefillForecast(get_profile(engine.profile), prefill_limit=prefill),
                    health=EngineHealth(
                        failure_threshold=config.monitoring.failure_threshold,
                        open_s=config.monitoring.breaker_open_s,
                    ),
                )
                for engine in config.engines
                for prefill in [engine.prefill_concurrency or admission.prefill_concurrency]
            ),
            tpot_target_s=admission.tpot_target_s,
        )
        self.accounting = Accounting()
        self.retention = RetentionLimit(admission.http_retention_limit)
        self.lengths = OutputLengths()
        self.queue = AdmissionQueue(self.pool, admission.queue_limit, self.lengths)
        counter = None
        if config.serving.tokenizer:
            try:
                counter = TokenizerCounter.from_file(config.serving.tokenizer)
            except RuntimeError as exc:
                raise ConfigError(f"serving.tokenizer: {exc}") from exc
        self.sizer = Sizer(counter)
        self.margin = SafetyMargin()
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
        # Asked, in the request's own task, when predictive admission would refuse it: true
        # lets it in all the same, as shadow mode would (the benchmark's forced-in reruns).
        self.exempt: Callable[[], bool] = _never
        self._live: set[LiveRequest] = set()
        self._idle = trio.Event()
        self._idle.set()

    @property
    def state(self) -> RouterState:
        """The router's state (:class:`~narwhal.control.state.ControlState`)."""
        return self.control.state

    @property
    def state_reason(self) -> str | None:
        """Why the router is not active, or ``None``."""
        return self.control.reason

    def check_state(self) -> None:
        """Refuse work unless the router is active.

        Raises:
            Unavailable: 503 with ``router_<state>`` while standby, fenced, in maintenance or
                monitoring-degraded.
        """
        if self.state == "draining":
            raise Unavailable(
                "This router is shutting down and admits no requests; retry on another.",
                code="router_draining",
            )
        if self.state != "active":
            raise Unavailable(
                f"This router is {self.state.replace('_', '-')} and admits no requests; "
                "retry shortly.",
                code=f"router_{self.state}",
            )

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
        """Stop admitting for a shutdown: ``/ready`` turns 503, new requests get 503.

        Requests already placed go on until :meth:`cut_streams`; the lease is given up at
        once, so that the other router of an HA pair takes over.
        """
        self.control.begin_drain()
        self.lease.release()

    def cut_streams(self) -> None:
        """End every held request now: in-band error on streams, 503 before headers.

        Counted ``unavailable`` with reason ``shutdown``.
        """
        for live in self._live:
            live.cut = True
            live.scope.cancel()

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the lease, the dispatcher and one health poller per engine in ``nursery``."""
        await nursery.start(self.lease.run)
        await nursery.start(self.queue.run)
        await nursery.start(self.maintenance.run)

        for engine in self.pool:
            nursery.start_soon(HealthPoller.for_engine(engine, self.config).run)
        await nursery.start(self.watchdog.run, self.control, self._poll_views)

    def _poll_views(self) -> list[EngineStatistics]:
        return [engine.statistics() for engine in self.pool]

    def _fence(self, token: int) -> None:
        """The lease's fencing token goes to the engines with every request from now on."""
        for engine in self.pool:
            client_of(engine).set_fence(token)

    async def aclose(self) -> None:
        """Stop the dispatcher and close every engine's connection pool."""
        self.queue.close()
        for engine in self.pool:
            await engine.client.aclose()

    async def wait_ready(self, poll_s: float = 0.01) -> None:
        """Return once ``/ready`` would answer 200 (tests and the demo)."""
        while not self.statistics().ready:  # noqa: ASYNC110 - readiness has many sources
            await trio.sleep(poll_s)

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
