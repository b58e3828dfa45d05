"""The router's own state: what it may do, from the conditions that decide it.

Several parts of the control plane each hold one condition, and the state is read from all of
them together, so no part can overwrite another's:

- the **lease** (:mod:`narwhal.control.lease`): ``active``, ``standby`` or ``fenced``;
- the **watchdog**: monitoring-degraded while the router cannot trust what it sees;
- **maintenance**: whole-wave maintenance while every engine is in a wave;
- **draining**: a graceful shutdown has begun.

When several hold, the state is the first of ``draining``, ``fenced``, ``standby``,
``monitoring_degraded``, ``maintenance`` (SPEC's order, with the shutdown first: nothing comes
back from it). Every change wakes whoever waits on :meth:`ControlState.wait_changed` and is
kept in a short history (:attr:`ControlState.history`) for ``/admin`` and the logs.

.. code-block:: text

    standby ──lease won──▶ active ──cannot renew in time──▶ fenced
       ▲                    │  ▲                              │
       └───lease held by ───┘  └────────lease held again──────┘
           the other router

    active ◀──▶ monitoring_degraded   (watchdog, with hysteresis)
    active ◀──▶ maintenance           (every engine in a maintenance wave)
    any ──shutdown──▶ draining
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import attrs
import trio

__all__ = ["ControlState", "LeaseState", "RouterState", "Transition"]

log = logging.getLogger(__name__)

RouterState = Literal[
    "active", "standby", "fenced", "maintenance", "monitoring_degraded", "draining"
]
LeaseState = Literal["active", "standby", "fenced"]

# Transitions kept for /admin and the event feed.
HISTORY = 64


@attrs.frozen
class Transition:
    """One change of the router's state."""

    at: float
    """``trio.current_time()`` when it happened, or ``0.0`` outside Trio."""
    old: RouterState
    new: RouterState
    reason: str | None


def _now() -> float:
    try:
        return trio.current_time()
    except RuntimeError:
        return 0.0


@attrs.define(eq=False)
class ControlState:
    """The conditions that decide the router's state, and the state they give.

    Each setter takes the condition's own reason (``None`` when it no longer holds); the
    reason of the state that wins is what ``/ready`` shows.
    """

    _lease: LeaseState = "active"
    _lease_reason: str | None = None
    _degraded: str | None = None
    _maintenance: str | None = None
    _draining: bool = False
    history: deque[Transition] = attrs.field(factory=lambda: deque(maxlen=HISTORY))
    _changed: trio.Event | None = None

    # -- reading ---------------------------------------------------------------------------

    @property
    def state(self) -> RouterState:
        """The state that applies now."""
        return self._decide()[0]

    @property
    def reason(self) -> str | None:
        """Why the router is not active (``None`` when it is)."""
        return self._decide()[1]

    @property
    def lease(self) -> LeaseState:
        """The lease's own condition, whatever else holds."""
        return self._lease

    @property
    def admitting(self) -> bool:
        """True in ``active`` only: new requests may be admitted and placed."""
        return self.state == "active"

    @property
    def placing(self) -> bool:
        """May the dispatcher place work it has already admitted?

        Everywhere but ``fenced`` and ``standby``: a router that may not hold the lease must
        not start new work on the engines at all, while one in maintenance, degraded or
        draining lets what it admitted go on.
        """
        return self._lease == "active"

    def _decide(self) -> tuple[RouterState, str | None]:
        if self._draining:
            return "draining", "router_draining"
        if self._lease != "active":
            return self._lease, self._lease_reason or f"router_{self._lease}"
        if self._degraded is not None:
            return "monitoring_degraded", self._degraded
        if self._maintenance is not None:
            return "maintenance", self._maintenance
        return "active", None

    # -- changing --------------------------------------------------------------------------

    def set_lease(self, lease: LeaseState, reason: str | None = None) -> None:
        """The lease's condition (:mod:`narwhal.control.lease`)."""
        with self._changing():
            self._lease, self._lease_reason = lease, reason

    def set_degraded(self, reason: str | None) -> None:
        """Monitoring-degraded while ``reason`` is not ``None``."""
        with self._changing():
            self._degraded = reason

    def set_maintenance(self, reason: str | None) -> None:
        """Whole-wave maintenance while ``reason`` is not ``None``."""
        with self._changing():
            self._maintenance = reason

    def begin_drain(self) -> None:
        """A graceful shutdown has begun; there is no way back."""
        with self._changing():
            self._draining = True

    @contextmanager
    def _changing(self) -> Iterator[None]:
        old, old_reason = self._decide()
        yield
        new, reason = self._decide()
        if (new, reason) == (old, old_reason):
            return
        if new != old:
            self.history.append(Transition(_now(), old, new, reason))
            log.info("router state %s -> %s (%s)", old, new, reason or "no reason")
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_changed(self) -> None:
        """Return at the next change of state or reason."""
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()
