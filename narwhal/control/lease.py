"""The lease: which router of a pair is active, and how the other one knows it is not.

Two routers share one leader key in a store (etcd, :mod:`narwhal.control.etcd`; or an
in-process :class:`MemoryStore` for tests). Each router keeps a lease of its own at the store
and, under it, tries to create the leader key only if it is absent: the router whose lease the
key is attached to is ``active``, the other ``standby``. The key's ``create_revision`` is the
**fencing token**: it only grows, every new leader has a larger one, and it goes to the engines
with every request (``x-narwhal-fence``), so that an engine can refuse a deposed leader's late
requests.

The :class:`LeaseKeeper` is the only thing that sets the lease's condition
(``router.control.set_lease``). Its clock rules, all measured on the router's own clock from
when a request was **sent** (the store can only have started the lease's TTL later than that):

- it renews every ``TTL / 3`` (:data:`RENEW_SHARE`);
- it holds the key until ``sent + TTL * (1 - FENCE_MARGIN_SHARE)`` of its last successful
  renewal (:data:`FENCE_MARGIN_SHARE` of the TTL before the store could expire it). When that
  time comes without a renewal back, the router is ``fenced`` at once, however the requests to
  the store are doing (a request still in flight is abandoned), and places nothing until it
  holds the key again;
- after a failed request it tries again every ``TTL / 10`` (:data:`RETRY_SHARE`).

The other router can only create the key once the store has expired the lease, which is after
the fenced one stopped: two routers never place work at the same time (while their clocks run
at the same rate to within the margin, and the event loop is not stalled for longer than it).

A standby keeps its own lease alive the same way, and watches the key between renewals, so it
takes over as soon as the key is gone: at once when the leader releases it (a graceful shutdown
revokes the lease), within the TTL when the leader disappeared. The leader watches the key too:
if it is deleted under it (its lease revoked by hand, outside the clock's guarantee), the leader
looks again at once and stops placing, rather than at its next renewal.

.. code-block:: text

            ┌──────────── key held by the other router ◀──────────┐
            ▼                                                      │
        standby ──key created under our lease──▶ active ──no renewal by
            ▲                                      ▲       sent + 0.8 TTL──▶ fenced
            │                                      └──── key still ours ─────┘ │
            └──────────────────── key held by the other router ────────────────┘

``lease = "none"`` (:class:`NoLease`) is a single router, always active.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from narwhal.config import ControlConfig
from narwhal.control.state import ControlState, LeaseState

__all__ = [
    "FENCE_MARGIN_SHARE",
    "RENEW_SHARE",
    "RETRY_SHARE",
    "Grant",
    "Leader",
    "Lease",
    "LeaseKeeper",
    "LeaseStatistics",
    "LeaseStore",
    "LeaseStoreError",
    "MemoryClient",
    "MemoryStore",
    "NoLease",
    "open_lease",
]

log = logging.getLogger(__name__)

RENEW_SHARE = 1 / 3
"""A lease is renewed this share of its TTL after the last renewal was sent."""
FENCE_MARGIN_SHARE = 0.2
"""The router fences itself this share of the TTL before the store could expire its lease."""
RETRY_SHARE = 0.1
"""After a failed request to the store, the next comes this share of the TTL later."""


class LeaseStoreError(Exception):
    """The store could not be reached, or answered something unusable (the message says
    which, without secrets)."""


@attrs.frozen
class Grant:
    """A lease the store granted: its id and the TTL it enforces (it may round the asked one
    up)."""

    id: int
    ttl_s: float


@attrs.frozen
class Leader:
    """Who holds the leader key, as one look at the store saw it.

    Attributes:
        lease_id: the lease the key is attached to.
        token: the key's ``create_revision``: the fencing token.
        revision: the store's revision when it was read (a watch starts after it).
        value: what the holder wrote in the key (who it is, for ``/ready`` and the logs).
    """

    lease_id: int
    token: int
    revision: int
    value: str


class LeaseStore(Protocol):
    """What a :class:`LeaseKeeper` needs from a store. Every method may raise
    :class:`LeaseStoreError`; the keeper bounds how long each may take."""

    async def grant(self, ttl_s: float) -> Grant:
        """Grant a new lease of about ``ttl_s``."""

    async def keep_alive(self, lease_id: int) -> float:
        """Renew the lease; return its TTL from now, ``0`` when the store no longer has it."""

    async def campaign(self, lease_id: int, value: str) -> Leader:
        """Create the leader key under ``lease_id`` if it is absent; return who holds it."""

    async def watch(self, leader: Leader) -> None:
        """Return once the leader key changed after ``leader.revision`` (created, deleted)."""

    async def revoke(self, lease_id: int) -> None:
        """Give the lease up (its key goes with it)."""

    async def aclose(self) -> None:
        """Release the store's connections."""


@attrs.frozen
class LeaseStatistics:
    """A snapshot of the lease.

    Attributes:
        backend: ``none``, ``etcd`` or ``memory``.
        state: the lease's condition.
        token: the fencing token sent to engines (``None`` until the key was first held).
        leader: who holds the key as last seen (its value), or ``None``.
        renewals: successful renewals of this router's lease.
        failures: failed or timed-out requests to the store.
        fences: times this router fenced itself.
    """

    backend: str
    state: LeaseState
    token: int | None
    leader: str | None
    renewals: int
    failures: int
    fences: int

    def as_json(self) -> dict[str, Any]:
        """What ``/ready`` shows of the lease (the counts are in ``/metrics``)."""
        return {
            "backend": self.backend,
            "state": self.state,
            "token": self.token,
            "leader": self.leader,
        }


class Lease(Protocol):
    """A router's lease, started once in the router's nursery."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the lease until cancelled or released."""

    def release(self) -> None:
        """Stop placing at once and give the lease up (a graceful shutdown)."""

    def statistics(self) -> LeaseStatistics:
        """A frozen snapshot."""


@attrs.define(eq=False)
class NoLease:
    """``lease = "none"``: a single router, always active; nothing to keep."""

    control: ControlState

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Nothing to do: the router is active from the start."""
        task_status.started()

    def release(self) -> None:
        """Nothing to give up."""

    def statistics(self) -> LeaseStatistics:
        """A frozen snapshot."""
        return LeaseStatistics("none", self.control.lease, None, None, 0, 0, 0)


@attrs.define
class _Held:
    """This router's own lease at the store."""

    id: int
    ttl_s: float
    valid_until: float  # the router's clock: until when it may act on it


class LeaseKeeper:
    """Keeps one router's lease in a :class:`LeaseStore` and sets ``control``'s lease
    condition from it (the module docstring has the rules).

    Args:
        store: the store (the keeper closes it when :meth:`run` ends).
        control: the router's state; the keeper sets only its lease condition.
        ttl_s: the TTL to ask for (``control.lease_ttl_s``).
        identity: written in the leader key while this router holds it.
        on_token: told the fencing token before the router turns active with it.
        backend: the name in :meth:`statistics`.
    """

    def __init__(
        self,
        store: LeaseStore,
        control: ControlState,
        *,
        ttl_s: float,
        identity: str,
        on_token: Callable[[int], None] | None = None,
        backend: str = "etcd",
    ) -> None:
        self._store = store
        self._control = control
        self._ttl_s = ttl_s
        self._identity = identity
        self._on_token = on_token
        self._backend = backend
        self._lease: _Held | None = None
        self._holding = False  # active: the key is ours and the lease still valid
        self._token: int | None = None
        self._leader: Leader | None = None
        self._scope = trio.CancelScope()
        self._bound: trio.CancelScope | None = None
        self._renewals = self._failures = self._fences = 0
        self._unreachable = False
        # Nothing is placed before the key is ours.
        control.set_lease("standby", "router_standby: looking for the leader")

    # -- the clock rules -----------------------------------------------------------------------

    def _ttl(self) -> float:
        return self._ttl_s if self._lease is None else self._lease.ttl_s

    @property
    def renew_s(self) -> float:
        """How long after a renewal was sent the next one goes."""
        return self._ttl() * RENEW_SHARE

    @property
    def retry_s(self) -> float:
        """How long after a failed request the next one goes."""
        return self._ttl() * RETRY_SHARE

    @staticmethod
    def valid_until(sent: float, ttl_s: float) -> float:
        """Until when a lease renewed by a request sent at ``sent`` may be acted on."""
        return sent + ttl_s * (1 - FENCE_MARGIN_SHARE)

    # -- running -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the lease until cancelled or :meth:`release`; then revoke it (bounded) and close
        the store."""
        task_status.started()
        try:
            with self._scope:
                while True:
                    await self._cycle()
        finally:
            self._step_down("router_standby: the lease was released")
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.renew_s):
                    await self._revoke()
                await self._store.aclose()

    def release(self) -> None:
        """Stop placing now, and revoke the lease so the other router takes over at once."""
        self._step_down("router_standby: the lease was released")
        self._scope.cancel()

    async def _revoke(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await self._store.revoke(lease.id)
        except LeaseStoreError as exc:
            log.warning("lease: could not revoke the lease (%s); it expires by itself", exc)

    async def _cycle(self) -> None:
        """One look at the store (renew or grant our lease, then campaign), then the wait
        until the next."""
        sent = trio.current_time()
        leader: Leader | None = None
        failure = "no answer in time"
        with trio.move_on_at(self._deadline(sent)) as self._bound:
            try:
                leader = await self._look(sent)
            except LeaseStoreError as exc:
                failure = str(exc)
        self._bound = None
        if self._holding and trio.current_time() >= self._deadline(sent):
            self._fence("router_fenced: the lease was not renewed in time")
        if leader is None:
            self._failures += 1
            # Said once when the store goes away, and once when it is back.
            log.log(
                logging.DEBUG if self._unreachable else logging.WARNING,
                "lease: the store failed: %s",
                failure,
            )
            self._unreachable = True
            if self._control.lease == "standby":
                self._control.set_lease("standby", "router_standby: the lease store is unreachable")
            await self._wait(trio.current_time() + self.retry_s)
            return
        if self._unreachable:
            self._unreachable = False
            log.info("lease: the store answers again")
        self._leader = leader
        lease = self._lease
        if lease is not None and leader.lease_id == lease.id:
            if trio.current_time() < lease.valid_until:
                self._activate(leader)
            # Watching its own key too: a leader whose key is deleted under it (its lease
            # revoked by hand) learns it at once, not at its next renewal.
            await self._wait(sent + self.renew_s, leader)
            return
        self._step_down(f"router_standby: the leader is {leader.value or 'another router'}")
        await self._wait(sent + self.renew_s, leader)

    def _deadline(self, sent: float) -> float:
        """The bound of a look started at ``sent``: the end of the lease while active."""
        if self._holding and self._lease is not None:
            return self._lease.valid_until
        return sent + self.renew_s

    async def _look(self, sent: float) -> Leader:
        lease = self._lease
        if lease is not None:
            ttl_s = await self._store.keep_alive(lease.id)
            if ttl_s <= 0:
                self._lease = None
                if self._holding:
                    self._fence("router_fenced: the lease expired at the store")
            else:
                self._renewals += 1
                lease.ttl_s = ttl_s
                lease.valid_until = self.valid_until(sent, ttl_s)
                self._extend()
        if self._lease is None:
            grant = await self._store.grant(self._ttl_s)
            if grant.ttl_s != self._ttl_s:
                log.info("lease: the store granted a TTL of %g s", grant.ttl_s)
            self._lease = _Held(grant.id, grant.ttl_s, self.valid_until(sent, grant.ttl_s))
        return await self._store.campaign(self._lease.id, self._identity)

    def _extend(self) -> None:
        if self._holding and self._bound is not None and self._lease is not None:
            self._bound.deadline = self._lease.valid_until

    async def _wait(self, until: float, leader: Leader | None = None) -> None:
        """Wait until ``until``, or until the leader key changes after what ``leader`` saw
        (the next look then comes at once); while active, fence if the lease runs out first."""
        holding = self._holding and self._lease is not None
        end = min(until, self._lease.valid_until) if self._lease is not None and holding else until
        with trio.move_on_at(end):
            if leader is not None:
                try:
                    await self._store.watch(leader)
                    return
                except LeaseStoreError as exc:
                    self._failures += 1
                    log.debug("lease: the watch failed: %s", exc)
            await trio.sleep_forever()
        lease = self._lease
        if holding and lease is not None and trio.current_time() >= lease.valid_until:
            self._fence("router_fenced: the lease was not renewed in time")

    # -- the condition -------------------------------------------------------------------------

    def _activate(self, leader: Leader) -> None:
        if leader.token != self._token:
            self._token = leader.token
            if self._on_token is not None:
                self._on_token(leader.token)  # before the first placement under it
        if not self._holding:
            self._holding = True
            log.info("lease: this router holds the leader key (fencing token %d)", leader.token)
        self._control.set_lease("active", None)

    def _fence(self, reason: str) -> None:
        if not self._holding:
            return
        self._holding = False
        self._fences += 1
        log.warning("lease: %s; placing nothing until the lease is held again", reason)
        self._control.set_lease("fenced", reason)

    def _step_down(self, reason: str) -> None:
        if self._holding:
            log.info("lease: standing down (%s)", reason)
        self._holding = False
        self._control.set_lease("standby", reason)

    def statistics(self) -> LeaseStatistics:
        """A frozen snapshot."""
        return LeaseStatistics(
            self._backend,
            self._control.lease,
            self._token,
            None if self._leader is None else self._leader.value,
            self._renewals,
            self._failures,
            self._fences,
        )


# -- the in-process store ------------------------------------------------------------------------


@attrs.define
class _MemoryLease:
    ttl_s: float
    expires_at: float


@attrs.define
class _MemoryKey:
    lease_id: int
    token: int
    value: str


class MemoryStore:
    """A leader key and leases in memory, on the Trio clock: several routers in one process
    share one (the state-machine tests run it under the MockClock).

    Each router talks to it through its own :class:`MemoryClient` (:meth:`client`), which a
    test can cut off from the store.
    """

    def __init__(self) -> None:
        self.revision = 0
        self.key: _MemoryKey | None = None
        self._leases: dict[int, _MemoryLease] = {}
        self._next_id = 1
        self._changed = trio.Event()

    def client(self) -> MemoryClient:
        """A new router's connection to this store."""
        return MemoryClient(self)

    def expire(self) -> None:
        """Drop the leases whose TTL ran out, and the key with its lease."""
        now = trio.current_time()
        for lease_id, lease in list(self._leases.items()):
            if lease.expires_at <= now:
                self._drop(lease_id)

    def _drop(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        if self.key is not None and self.key.lease_id == lease_id:
            self.key = None
            self.revision += 1
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def grant(self, ttl_s: float) -> Grant:
        lease_id, self._next_id = self._next_id, self._next_id + 1
        self._leases[lease_id] = _MemoryLease(ttl_s, trio.current_time() + ttl_s)
        return Grant(lease_id, ttl_s)

    def keep_alive(self, lease_id: int) -> float:
        self.expire()
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0.0
        lease.expires_at = trio.current_time() + lease.ttl_s
        return lease.ttl_s

    def campaign(self, lease_id: int, value: str) -> Leader:
        self.expire()
        if lease_id not in self._leases:
            raise LeaseStoreError("requested lease not found")
        if self.key is None:
            self.revision += 1
            self.key = _MemoryKey(lease_id, self.revision, value)
            self._notify()
        key = self.key
        return Leader(key.lease_id, key.token, self.revision, key.value)

    async def watch(self, leader: Leader) -> None:
        while True:
            self.expire()
            key = self.key
            if key is None or key.token != leader.token:
                return
            changed = self._changed
            with trio.move_on_at(self._leases[key.lease_id].expires_at):
                await changed.wait()

    def revoke(self, lease_id: int) -> None:
        self._drop(lease_id)


@attrs.define(eq=False)
class MemoryClient:
    """One router's connection to a :class:`MemoryStore`.

    Attributes:
        cut: ``None`` (connected); ``"refuse"``: every request fails at once; ``"hang"``:
            every request waits for ever, as through a network that drops packets.
    """

    store: MemoryStore
    cut: str | None = None

    async def _reach(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.cut == "refuse":
            raise LeaseStoreError("connection refused")
        if self.cut == "hang":
            await trio.sleep_forever()

    async def grant(self, ttl_s: float) -> Grant:
        await self._reach()
        return self.store.grant(ttl_s)

    async def keep_alive(self, lease_id: int) -> float:
        await self._reach()
        return self.store.keep_alive(lease_id)

    async def campaign(self, lease_id: int, value: str) -> Leader:
        await self._reach()
        return self.store.campaign(lease_id, value)

    async def watch(self, leader: Leader) -> None:
        await self._reach()
        await self.store.watch(leader)

    async def revoke(self, lease_id: int) -> None:
        await self._reach()
        self.store.revoke(lease_id)

    async def aclose(self) -> None:
        """Nothing to close."""


def open_lease(
    config: ControlConfig,
    control: ControlState,
    *,
    identity: str,
    on_token: Callable[[int], None] | None = None,
) -> Lease:
    """The lease ``[control]`` asks for: :class:`NoLease`, or a :class:`LeaseKeeper` on etcd
    (leader key ``<control.cluster>/leader``, :mod:`narwhal.control.etcd`)."""
    if config.lease == "none":
        return NoLease(control)
    from narwhal.control.etcd import EtcdStore, leader_key  # etcd imports this module

    store = EtcdStore(
        config.etcd_endpoints,
        leader_key(config.cluster),
        timeout_s=config.lease_ttl_s * RENEW_SHARE,
    )
    return LeaseKeeper(
        store, control, ttl_s=config.lease_ttl_s, identity=identity, on_token=on_token
    )
