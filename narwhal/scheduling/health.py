"""An engine's health (pure, no I/O): joining, the circuit breaker, and why it is not eligible.

Nothing here reads a clock or a socket: every method takes the time as an argument, the way h11
takes bytes. The Trio shell (:mod:`narwhal.upstream.health`) polls the engine and reports what
it saw; the exchange reports what requests met. Both feed one machine::

    joining ──good poll──▶ ready ──failures──▶ open ──cool-down──▶ half-open ──good probe──▶ ready
       ▲ failed polls                                  ▲                │
       └───────────┘                                   └──failed probe──┘

* An engine is **eligible** only when ``ready``. It joins on its first good poll (``/health``
  answered, ``serving.model`` listed in ``/v1/models``, the token-ID probe done).
* ``failure_threshold`` **consecutive failures** of polls or requests open the circuit; a good
  poll or an answered request resets the count. A **decisive** failure (no connection could be
  made; a poll answered an error status or did not list the model) opens it at once.
* After ``open_s`` the circuit is **half-open**: still ineligible, it waits for the next poll,
  the probe. A good probe closes the circuit, a failed one opens it for another ``open_s``.
* A **hold** keeps a healthy engine out of placement for a reason that is not its circuit:
  ``profiling`` while its probes run, ``profiling_failed: ...`` until a profiling succeeds,
  ``drift: ...`` while its severe drift waits for a re-profiling
  (:mod:`narwhal.upstream.profiling`, :mod:`narwhal.scheduling.drift`). ``/ready`` shows the
  hold as the reason of a joining or ready engine; an open circuit's reason comes first.

Only failures that say the engine is unresponsive count for requests (no connection, a timeout,
a broken connection). An engine's 5xx answer, in-band error or malformed event can be caused by
the request itself, and counting those would let a client take engines out of placement.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs

__all__ = [
    "Change",
    "EngineHealth",
    "Failure",
    "FailureKind",
    "HealthState",
    "HealthStatistics",
]

FailureKind = Literal["connect", "timeout", "disconnect", "protocol", "unhealthy"]
"""``connect``: no connection; ``timeout``: no answer in time; ``disconnect``: the connection
broke; ``protocol``: a malformed HTTP answer; ``unhealthy``: a poll answered, and the answer
says no (an error status, the model not listed)."""

HealthState = Literal["joining", "ready", "open", "half_open"]

Change = Literal["joined", "opened", "closed", "reopened", "held", "released"]
"""What a report changed: ``joined``, ``opened``, ``closed``, ``held`` and ``released`` change
eligibility."""

_DECISIVE: frozenset[FailureKind] = frozenset({"connect", "unhealthy"})

_KIND_WORDS: dict[FailureKind, str] = {
    "connect": "unreachable",
    "timeout": "timeout",
    "disconnect": "connection lost",
    "protocol": "malformed HTTP answer",
    "unhealthy": "unhealthy",
}


@attrs.frozen
class Failure:
    """One failed poll or request.

    ``detail`` is short and safe to show in ``/ready``: no exception repr, no address
    (``"unreachable (connection refused)"``, ``"/health answered 503"``).
    """

    kind: FailureKind
    detail: str

    @property
    def decisive(self) -> bool:
        """Whether this failure alone opens the circuit."""
        return self.kind in _DECISIVE


@attrs.frozen
class HealthStatistics:
    """A snapshot of one engine's health."""

    state: HealthState
    eligible: bool
    reason: str | None
    consecutive_failures: int
    last_failure: Failure | None
    last_good_poll_at: float | None
    probe_at: float | None
    times_opened: int
    polls: int
    failed_polls: int
    failed_requests: int


@attrs.define
class EngineHealth:
    """The health of one engine (see the module doc)."""

    failure_threshold: int = 3
    open_s: float = 5.0
    _state: Literal["joining", "ready", "open"] = attrs.field(default="joining", init=False)
    _joined: bool = attrs.field(default=False, init=False)
    _failures: int = attrs.field(default=0, init=False)  # consecutive, while ready
    _last_failure: Failure | None = attrs.field(default=None, init=False)
    _cause: str | None = attrs.field(default=None, init=False)  # why the circuit is open
    _probe_at: float = attrs.field(default=math.inf, init=False)  # end of the cool-down
    _last_good_poll_at: float | None = attrs.field(default=None, init=False)
    _times_opened: int = attrs.field(default=0, init=False)
    _polls: int = attrs.field(default=0, init=False)
    _failed_polls: int = attrs.field(default=0, init=False)
    _failed_requests: int = attrs.field(default=0, init=False)
    _hold: str | None = attrs.field(default=None, init=False)

    @property
    def eligible(self) -> bool:
        """Whether requests may be placed on the engine.

        Eligibility needs no time: leaving the cool-down makes the circuit half-open, which is
        still ineligible; only a good probe (a report) makes the engine eligible again.
        """
        return self._state == "ready" and self._hold is None

    @property
    def held(self) -> str | None:
        """The hold keeping the engine out of placement (``None``: none; see the module doc)."""
        return self._hold

    def hold(self, reason: str) -> Change | None:
        """Keep the engine out of placement for ``reason`` (replacing any hold); ``held``
        when that made an eligible engine ineligible."""
        was = self.eligible
        self._hold = reason
        return "held" if was else None

    def release(self) -> Change | None:
        """End the hold; ``released`` when that made the engine eligible again."""
        was = self.eligible
        self._hold = None
        return "released" if self.eligible and not was else None

    @property
    def joined(self) -> bool:
        """Whether the engine has ever joined (its token-ID probe is done)."""
        return self._joined

    def probe_at(self) -> float | None:
        """While the circuit is open: when the cool-down ends and the next poll may probe."""
        return self._probe_at if self._state == "open" else None

    def state(self, now: float) -> HealthState:
        """The state at ``now`` (an open circuit is half-open once its cool-down is over)."""
        if self._state == "open" and now >= self._probe_at:
            return "half_open"
        return self._state

    def reason(self, now: float) -> str | None:
        """Why the engine is not eligible (``None`` when it is), as ``/ready`` shows it."""
        state = self.state(now)
        if state in ("ready", "joining") and self._hold is not None:
            return self._hold
        if state == "ready":
            return None
        if state == "joining":
            waiting = "waiting for /health and /v1/models"
            return f"joining: {self._last_failure.detail if self._last_failure else waiting}"
        if state == "open":
            return f"circuit open: {self._cause}"
        return f"circuit half-open: probing ({self._cause})"

    # -- reports --------------------------------------------------------------------------------

    def poll_succeeded(self, now: float) -> Change | None:
        """A poll found the engine healthy (and, when joining, its token-ID probe done)."""
        self._polls += 1
        self._last_good_poll_at = now
        if self._state == "joining":
            self._state, self._joined = "ready", True
            self._failures, self._last_failure = 0, None
            return "joined"
        if self._state == "ready":
            self._failures = 0
            return None
        if now < self._probe_at:
            return None  # still cooling down: this poll is no probe
        self._state, self._failures, self._cause = "ready", 0, None
        return "closed"

    def poll_failed(self, now: float, failure: Failure) -> Change | None:
        """A poll failed."""
        self._polls += 1
        self._failed_polls += 1
        if self._state == "joining":
            self._last_failure = failure
            return None
        if self._state == "ready":
            return self._count(now, failure)
        if now < self._probe_at:
            return None
        self._last_failure = failure
        self._open(now, f"probe failed: {failure.detail}")
        return "reopened"

    def request_answered(self, now: float) -> None:
        """The engine answered a request (response headers arrived): it is responsive."""
        if self._state == "ready":
            self._failures = 0

    def request_failed(self, now: float, failure: Failure) -> Change | None:
        """A request met an unresponsive engine (no connection, a timeout, a broken connection)."""
        self._failed_requests += 1
        if self._state != "ready":
            return None  # already out of placement; an old request's news changes nothing
        return self._count(now, failure)

    def _count(self, now: float, failure: Failure) -> Change | None:
        self._failures += 1
        self._last_failure = failure
        if not failure.decisive and self._failures < self.failure_threshold:
            return None
        if failure.decisive or self._failures == 1:
            self._open(now, failure.detail)
        else:
            word = _KIND_WORDS[failure.kind]
            self._open(now, f"{self._failures} consecutive failures ({word})")
        return "opened"

    def _open(self, now: float, cause: str) -> None:
        self._state = "open"
        self._cause = cause
        self._probe_at = now + self.open_s
        self._times_opened += 1

    def statistics(self, now: float) -> HealthStatistics:
        """A frozen snapshot at ``now``."""
        return HealthStatistics(
            state=self.state(now),
            eligible=self.eligible,
            reason=self.reason(now),
            consecutive_failures=self._failures,
            last_failure=self._last_failure,
            last_good_poll_at=self._last_good_poll_at,
            probe_at=self.probe_at(),
            times_opened=self._times_opened,
            polls=self._polls,
            failed_polls=self._failed_polls,
            failed_requests=self._failed_requests,
        )
