"""The router's state, shared by every request: engines, accounting, metrics.

The web layer holds one :class:`Router`; everything a handler needs comes from it, so tests and
embedders can build one from a :class:`~narwhal.config.Config` and a set of transports.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import attrs
import httpx
import trio

from narwhal.admission.accounting import Accounting, AccountingStatistics
from narwhal.config import Config
from narwhal.scheduling.engines import Engine, EnginePool, EngineStatistics
from narwhal.upstream.client import EngineClient
from narwhal.web.metrics import Metrics

__all__ = ["Router", "RouterStatistics"]


@attrs.frozen
class RouterStatistics:
    """What ``/ready`` shows: state, reason, counters and engines."""

    state: str
    reason: str | None
    accounting: AccountingStatistics
    engines: tuple[EngineStatistics, ...]

    @property
    def ready(self) -> bool:
        """Active, with at least one eligible engine."""
        return self.state == "active" and any(engine.eligible for engine in self.engines)

    def as_json(self) -> dict[str, Any]:
        """The ``/ready`` body."""
        return {
            "state": self.state,
            "reason": self.reason
            if self.reason is not None
            else (None if self.ready else "no_eligible_engine"),
            "counters": self.accounting.as_json(),
            "engines": [
                {
                    "name": engine.name,
                    "eligible": engine.eligible,
                    "reason": engine.reason,
                    "token_accounting": engine.token_accounting,
                    "wave": engine.wave,
                    "occupancy": {"prefill": engine.prefill, "decode": engine.decode},
                }
                for engine in self.engines
            ],
        }


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
        self.pool = EnginePool(
            Engine(
                engine, EngineClient(engine, config.upstream, transport=transports.get(engine.name))
            )
            for engine in config.engines
        )
        self.accounting = Accounting()
        self.state = "active"
        self.state_reason: str | None = None
        self.metrics = Metrics(self)

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the engines' joins in ``nursery`` (returns at once)."""
        for engine in self.pool:
            nursery.start_soon(
                partial(
                    engine.join,
                    self.config.serving.model,
                    retry_interval_s=self.config.monitoring.poll_interval_s,
                )
            )

    async def aclose(self) -> None:
        """Close every engine's connection pool."""
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
            accounting=self.accounting.statistics(),
            engines=tuple(engine.statistics() for engine in self.pool),
        )
