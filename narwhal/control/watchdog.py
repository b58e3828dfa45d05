"""The watchdog: is the router blind? Then it refuses new requests rather than admit blind.

Admission decides on what the router sees: its own clock running on time (a projection made by
a loop that runs late is late itself) and its engines' health and metrics polls
(:mod:`narwhal.upstream.health`). The watchdog checks both every :attr:`Watchdog.tick_s`
(``min(0.125, monitoring.max_loop_lag_s / 2)``) and sets the router's monitoring-degraded
condition (:meth:`~narwhal.control.state.ControlState.set_degraded`) while either fails:

- **loop lag**: how late the watchdog's own sleep woke. Lag strictly over
  ``monitoring.max_loop_lag_s`` at :data:`LATE_CHECKS` (3) checks in a row or more, spanning
  at least ``monitoring.lag_sustain_s`` (counted from when the first of them was due),
  degrades: the loop is slow, not once but as a rule. One late check, however late, is a
  spike: a single block of the loop (a garbage collection, a large body parsed at once) is over
  by the time the check sees it, and refusing traffic afterwards would not undo it. (A loop
  wedged for good runs no check at all: the probe listener, :mod:`narwhal.web.probes`, answers
  for it.)
- **blind polls**: every engine the router would place on (the eligible ones) has stale data:
  its last good health poll, or where its metrics are polled
  (:attr:`~narwhal.scheduling.engines.Engine.metrics_expected`) its last good metrics poll, is
  older than ``monitoring.stale_after_s`` (data never read counts from the watchdog's start).
  While one eligible engine is seen fresh the router still sees part of its pool and goes on;
  with no eligible engine at all it is not blind but empty, which ``backend_unavailable``
  answers.

It recovers by itself, with hysteresis: once degraded, every check must pass for
``monitoring.recover_after_s`` in a row before the condition clears, and passing is stricter
than staying active: one late check (a single lag over the threshold) or stale polls start the
count again. A router whose lag hovers at the threshold therefore does not flap: it takes a
sustained lag to degrade, and a clean run to recover. The reason
(``router_monitoring_degraded: ...``) names the cause and not its changing figures, so that
the state's reason changes only when the cause does.

:class:`Watchdog` is pure (every method takes the time); :meth:`Watchdog.run` is its Trio
shell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import attrs
import trio

from narwhal.config import MonitoringConfig
from narwhal.control.state import ControlState

__all__ = ["LATE_CHECKS", "PollView", "Watchdog", "WatchdogStatistics"]

PREFIX = "router_monitoring_degraded"
LATE_CHECKS = 3
"""Late checks in a row before lag can degrade (with ``monitoring.lag_sustain_s``)."""


class PollView(Protocol):
    """What the watchdog reads of an engine (an
    :class:`~narwhal.scheduling.engines.EngineStatistics` is one)."""

    @property
    def eligible(self) -> bool: ...

    @property
    def health_age_s(self) -> float | None: ...

    @property
    def metrics_age_s(self) -> float | None: ...

    @property
    def metrics_expected(self) -> bool: ...


@attrs.frozen
class WatchdogStatistics:
    """A snapshot of the watchdog."""

    loop_lag_s: float
    """The last check's lag (seconds late)."""
    worst_loop_lag_s: float
    """The largest lag seen since the start."""
    reason: str | None
    """The degraded reason while degraded, else ``None``."""
    checks: int
    times_degraded: int

    @property
    def degraded(self) -> bool:
        """Whether the watchdog holds the router monitoring-degraded."""
        return self.reason is not None


@attrs.define
class Watchdog:
    """The rules of the module doc; :meth:`check` by plain calls, :meth:`run` in Trio."""

    max_loop_lag_s: float = 0.25
    stale_after_s: float = 5.0
    lag_sustain_s: float = 1.0
    recover_after_s: float = 2.0
    started_at: float = 0.0
    _lagging_since: float | None = attrs.field(default=None, init=False)
    _late_checks: int = attrs.field(default=0, init=False)
    _passing_since: float | None = attrs.field(default=None, init=False)
    _reason: str | None = attrs.field(default=None, init=False)
    _lag_s: float = attrs.field(default=0.0, init=False)
    _worst_lag_s: float = attrs.field(default=0.0, init=False)
    _checks: int = attrs.field(default=0, init=False)
    _times_degraded: int = attrs.field(default=0, init=False)

    @classmethod
    def for_config(cls, monitoring: MonitoringConfig) -> Watchdog:
        """A watchdog with ``[monitoring]``'s thresholds."""
        return cls(
            max_loop_lag_s=monitoring.max_loop_lag_s,
            stale_after_s=monitoring.stale_after_s,
            lag_sustain_s=monitoring.lag_sustain_s,
            recover_after_s=monitoring.recover_after_s,
        )

    @property
    def tick_s(self) -> float:
        """The time between checks."""
        return min(0.125, self.max_loop_lag_s / 2)

    @property
    def reason(self) -> str | None:
        """``router_monitoring_degraded: <why>`` while degraded, else ``None``."""
        return self._reason

    def check(self, *, due: float, now: float, engines: Iterable[PollView]) -> str | None:
        """One check at ``now`` of a sleep that was due at ``due``; the reason it leaves.

        Args:
            due: when the check should have run.
            now: when it ran.
            engines: the engines' poll freshness, now.
        """
        self._checks += 1
        lag = max(0.0, now - due)
        self._lag_s = lag
        self._worst_lag_s = max(self._worst_lag_s, lag)
        if lag > self.max_loop_lag_s:
            if self._lagging_since is None:
                self._lagging_since = due
            self._late_checks += 1
        else:
            self._lagging_since, self._late_checks = None, 0
        trouble = self._lag_trouble(now) or self._blind(now, engines)
        if trouble is None and self._reason is not None and self._lagging_since is not None:
            trouble = self._reason.removeprefix(f"{PREFIX}: ")  # recovering: no late check
        if trouble is not None:
            self._passing_since = None
            if self._reason is None:
                self._times_degraded += 1
            self._reason = f"{PREFIX}: {trouble}"
            return self._reason
        if self._reason is not None:
            if self._passing_since is None:
                self._passing_since = now
            if now - self._passing_since >= self.recover_after_s:
                self._reason = self._passing_since = None
        return self._reason

    def _lag_trouble(self, now: float) -> str | None:
        since = self._lagging_since
        if since is None or self._late_checks < LATE_CHECKS or now - since < self.lag_sustain_s:
            return None
        return (
            f"event loop lag over {self.max_loop_lag_s:g} s for at least {self.lag_sustain_s:g} s"
        )

    def _blind(self, now: float, engines: Iterable[PollView]) -> str | None:
        ages = [self._age(now, engine) for engine in engines if engine.eligible]
        if not ages or min(ages) <= self.stale_after_s:
            return None
        return (
            f"no fresh health or metrics poll from any eligible engine "
            f"(stale after {self.stale_after_s:g} s)"
        )

    def _age(self, now: float, engine: PollView) -> float:
        since_start = now - self.started_at
        health = since_start if engine.health_age_s is None else engine.health_age_s
        if not engine.metrics_expected:
            return health
        metrics = since_start if engine.metrics_age_s is None else engine.metrics_age_s
        return max(health, metrics)

    def statistics(self) -> WatchdogStatistics:
        """A frozen snapshot."""
        return WatchdogStatistics(
            loop_lag_s=self._lag_s,
            worst_loop_lag_s=self._worst_lag_s,
            reason=self._reason,
            checks=self._checks,
            times_degraded=self._times_degraded,
        )

    async def run(
        self,
        control: ControlState,
        engines: Callable[[], Iterable[PollView]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Check every :attr:`tick_s` and set ``control``'s degraded condition; never returns.

        Args:
            control: the router's state.
            engines: called at each check for the engines' snapshots.
        """
        self.started_at = trio.current_time()
        due = self.started_at + self.tick_s
        task_status.started()
        while True:
            await trio.sleep_until(due)
            now = trio.current_time()
            reason = self.check(due=due, now=now, engines=engines())
            control.set_degraded(reason)
            # The next check is a tick after this one ran: a late loop is not made to
            # catch up with checks in a burst.
            due = now + self.tick_s
