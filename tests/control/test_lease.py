"""The lease's state machine (narwhal.control.lease) on the in-memory store, in virtual time.

TTL 3 s: renewals every 1 s, a router holds the key until 2.4 s after its last renewal was
sent, and retries a failed request every 0.3 s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from narwhal.config import ControlConfig
from narwhal.control.lease import (
    LeaseKeeper,
    MemoryClient,
    MemoryStore,
    NoLease,
    open_lease,
)
from narwhal.control.state import ControlState
from tests.support import until

TTL = 3.0
approx = pytest.approx


@attrs.define(eq=False)
class Node:
    """One router's side: its state, its connection to the store, its keeper."""

    name: str
    control: ControlState
    client: MemoryClient
    keeper: LeaseKeeper
    tokens: list[int]
    scope: trio.CancelScope | None = None

    def history(self) -> list[tuple[float, str]]:
        return [(t.at, t.new) for t in self.control.history]

    def at(self, state: str) -> list[float]:
        return [at for at, new in self.history() if new == state]


@pytest.fixture
async def pair(nursery: trio.Nursery) -> AsyncIterator[Any]:
    store = MemoryStore()
    nodes: list[Node] = []

    async def start(name: str) -> Node:
        control = ControlState()
        client = store.client()
        tokens: list[int] = []
        keeper = LeaseKeeper(
            client, control, ttl_s=TTL, identity=name, on_token=tokens.append, backend="memory"
        )
        control.history.clear()  # built standby (tested below): the history starts here
        node = Node(name, control, client, keeper, tokens)

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as node.scope:
                await keeper.run(task_status=task_status)

        await nursery.start(run)
        nodes.append(node)
        return node

    start.store = store  # type: ignore[attr-defined]
    yield start
    for node in nodes:
        assert node.scope is not None
        node.scope.cancel()


def _active_spans(node: Node) -> list[tuple[float, float]]:
    spans, since = [], None
    for at, new in node.history():
        if new == "active" and since is None:
            since = at
        elif new != "active" and since is not None:
            spans.append((since, at))
            since = None
    if since is not None:
        spans.append((since, math.inf))
    return spans


def _never_both_active(*nodes: Node) -> None:
    """No two nodes' active spans overlap (a hand-over at one instant is not an overlap)."""
    spans = [(span, node.name) for node in nodes for span in _active_spans(node)]
    for (a_span, a_name), (b_span, b_name) in itertools.combinations(spans, 2):
        if a_name != b_name:
            assert a_span[1] <= b_span[0] or b_span[1] <= a_span[0], (a_name, b_name, spans)


async def test_none_is_always_active() -> None:
    control = ControlState()
    lease = open_lease(ControlConfig(), control, identity="solo")
    assert isinstance(lease, NoLease)
    await lease.run()
    lease.release()
    assert control.state == "active" and control.placing
    assert lease.statistics().backend == "none"


async def test_standby_until_the_key_is_held(autojump_clock: trio.testing.MockClock) -> None:
    control = ControlState()
    keeper = LeaseKeeper(MemoryStore().client(), control, ttl_s=TTL, identity="a")
    # Built, not yet running: nothing may be placed.
    assert control.state == "standby" and not control.placing
    assert keeper.statistics().state == "standby"


async def test_first_takes_the_key_second_stands_by(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(10)
    assert a.history() == [(0.0, "active")]
    assert b.control.state == "standby"
    assert b.control.reason == "router_standby: the leader is router-a"
    assert a.tokens == [1] and b.tokens == []
    stats = a.keeper.statistics()
    assert (stats.state, stats.token, stats.leader, stats.fences) == ("active", 1, "router-a", 0)
    assert stats.renewals == 10  # every TTL/3 for 10 s


async def test_missed_renewals_fence_before_the_store_expires(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(2.5)
        a.client.cut = "refuse"  # last renewal sent at 2.0: the store keeps the lease to 5.0
        await until(lambda: b.control.state == "active")
    assert a.at("fenced") == [approx(2.0 + 0.8 * TTL)]  # 4.4, by A's own clock
    assert a.control.reason == "router_fenced: the lease was not renewed in time"
    assert not a.control.placing
    assert b.at("active") == [approx(5.0)]
    assert b.tokens == [3]  # a new key, a larger token (the deletion was revision 2)
    _never_both_active(a, b)


async def test_a_hung_store_fences_at_the_same_instant(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    # Requests that never come back are abandoned at the lease's end: the fence does not
    # wait for them.
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(2.5)
        a.client.cut = "hang"
        await until(lambda: b.control.state == "active")
    assert a.at("fenced") == [approx(4.4)]
    assert b.at("active") == [approx(5.0)]
    _never_both_active(a, b)


async def test_fenced_router_regains_its_own_key(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(2.5)
        a.client.cut = "refuse"
        await until(lambda: a.control.state == "fenced")
        a.client.cut = None  # back before the store expired the lease (5.0)
        await until(lambda: a.control.state == "active")
        await trio.sleep(5)
    # Retries every 0.3 s: the first after the fence, at 4.7, renews the lease, and the key
    # is still A's, with the same token.
    assert a.history() == [(0.0, "active"), (approx(4.4), "fenced"), (approx(4.7), "active")]
    assert a.tokens == [1]
    assert b.history() == [] and b.control.state == "standby"
    _never_both_active(a, b)


async def test_fenced_router_back_after_takeover_stands_by(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(2.5)
        a.client.cut = "refuse"
        await until(lambda: b.control.state == "active")
        await trio.sleep(1.0)
        a.client.cut = None
        await until(lambda: a.control.state == "standby")
        await trio.sleep(5)
    assert [state for _, state in a.history()] == ["active", "fenced", "standby"]
    assert a.control.reason == "router_standby: the leader is router-b"
    assert b.control.state == "active" and b.tokens == [3]
    _never_both_active(a, b)


async def test_release_hands_over_at_once(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(7.25)
        released_at = trio.current_time()
        a.keeper.release()
        # Placing stops before the lease is even revoked.
        assert a.control.state == "standby" and not a.control.placing
        await until(lambda: b.control.state == "active")
    assert b.at("active") == [released_at]  # the watch saw the key go at once
    assert a.control.reason == "router_standby: the lease was released"
    _never_both_active(a, b)


async def test_leader_gone_silently_is_replaced_within_the_ttl(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(0.5)
        a.client.cut = "hang"  # as if A's host died: no renewal, no revoke
        await until(lambda: b.control.state == "active")
    # A's lease was last renewed at 0.0 (the grant): the store dropped it at 3.0.
    assert b.at("active") == [approx(TTL)]
    assert a.at("fenced") == [approx(0.8 * TTL)]
    _never_both_active(a, b)


async def test_started_together_exactly_one_wins(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    store = pair.store
    nodes: list[Node] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as starting:
            for name in ("router-a", "router-b", "router-c"):
                starting.start_soon(lambda n=name: _append(nodes, pair(n)))
        await trio.sleep(5)
    states = sorted(node.control.state for node in nodes)
    assert states == ["active", "standby", "standby"]
    assert all(len(node.history()) <= 1 for node in nodes)
    assert store.key is not None and store.key.token == 1
    _never_both_active(*nodes)


async def _append(nodes: list[Node], started: Any) -> None:
    nodes.append(await started)


async def test_store_down_at_start_stays_standby(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    store = pair.store
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        a.client.cut = "refuse"
        b = await pair("router-b")
        b.client.cut = "refuse"
        await trio.sleep(1.0)
        assert b.control.reason == "router_standby: the lease store is unreachable"
        assert b.keeper.statistics().failures > 0
        b.client.cut = None
        await until(lambda: b.control.state == "active")
    # A's lease, granted at 0.0 and never renewed, ran out at the store at 3.0.
    assert b.at("active") == [approx(TTL)]
    assert store.key is not None and store.key.value == "router-b"
    _never_both_active(a, b)


async def test_a_lease_revoked_under_the_leader_fences_it_at_its_next_renewal(
    pair: Any, autojump_clock: trio.testing.MockClock
) -> None:
    store = pair.store
    with trio.fail_after(60):
        a = await pair("router-a")
        await until(lambda: a.control.state == "active")
        b = await pair("router-b")
        await trio.sleep(1.5)
        assert store.key is not None
        store.revoke(store.key.lease_id)  # an operator's `etcdctl lease revoke`
        await until(lambda: a.control.state == "standby")
    # Both watches saw the key go at 1.501: A found its lease gone, fenced and, the key being
    # B's, stood by, in the instant B took the key. (Outside the clock's guarantee: only the
    # token, larger for B, tells a late request of A's from B's.)
    assert b.at("active") == [approx(1.501)]
    assert a.history()[1:] == [(approx(1.501), "fenced"), (approx(1.501), "standby")]
    assert a.keeper.statistics().fences == 1
    assert b.tokens[0] > a.tokens[0]
