"""The router's state and its lease, seen from outside: ``/metrics`` and ``/ready``. Virtual
time, in-process engines, the lease on an in-memory store."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from narwhal.config import AdmissionConfig
from narwhal.control.lease import LeaseKeeper, MemoryStore
from tests.conftest import Fleet, StartFleet
from tests.support import until

TTL = 3.0


async def _samples(fleet: Fleet) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await fleet.client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _one_hot(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str
) -> dict[str, float]:
    found = {labels: value for (metric, labels), value in samples.items() if metric == name}
    return {dict(labels)["state"]: value for labels, value in found.items()}


async def test_the_state_and_the_lease_are_in_metrics_and_ready(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=AdmissionConfig(mode="open"))
    with trio.fail_after(60):
        samples = await _samples(fleet)
        ready = (await fleet.client.get("/ready")).json()
    assert _one_hot(samples, "narwhal_router_state") == {
        "active": 1,
        "standby": 0,
        "fenced": 0,
        "maintenance": 0,
        "monitoring_degraded": 0,
        "draining": 0,
    }
    assert _one_hot(samples, "narwhal_lease_state") == {"active": 1, "standby": 0, "fenced": 0}
    assert samples["narwhal_lease_state", (("backend", "none"), ("state", "active"))] == 1
    assert not any(name == "narwhal_lease_fencing_token" for name, _ in samples)
    for name in ("renewals", "failures", "fences"):
        assert samples[f"narwhal_lease_{name}_total", ()] == 0
    assert ready["lease"] == {"backend": "none", "state": "active", "token": None, "leader": None}

    fleet.router.control.set_degraded("router_monitoring_degraded: test")
    with trio.fail_after(60):
        samples = await _samples(fleet)
    assert _one_hot(samples, "narwhal_router_state")["monitoring_degraded"] == 1
    assert _one_hot(samples, "narwhal_lease_state")["active"] == 1  # the lease's own condition


async def test_a_keeper_shows_its_token_renewals_and_fence(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=AdmissionConfig(mode="open"))
    store = MemoryStore()
    client = store.client()
    keeper = LeaseKeeper(
        client, fleet.router.control, ttl_s=TTL, identity="router-a", backend="memory"
    )
    fleet.router.lease = keeper
    with trio.fail_after(60):
        start = trio.current_time()
        await nursery.start(keeper.run)
        await until(lambda: fleet.router.state == "active")
        await trio.sleep(2.5)  # renewals sent at start + 1.0 and start + 2.0
        samples = await _samples(fleet)
        ready = (await fleet.client.get("/ready")).json()
        assert samples["narwhal_lease_fencing_token", ()] == 1
        assert samples["narwhal_lease_renewals_total", ()] == 2
        assert samples["narwhal_lease_state", (("backend", "memory"), ("state", "active"))] == 1
        assert ready["lease"] == {
            "backend": "memory",
            "state": "active",
            "token": 1,
            "leader": "router-a",
        }

        client.cut = "refuse"
        await until(lambda: fleet.router.state == "fenced")
        # Its last renewal was sent at start + 2.0: fenced 0.8 TTL later, by its own clock.
        assert trio.current_time() == pytest.approx(start + 2.0 + 0.8 * TTL)
        samples = await _samples(fleet)
        response = await fleet.client.get("/ready")
    assert samples["narwhal_lease_fences_total", ()] == 1
    assert samples["narwhal_lease_failures_total", ()] >= 1
    assert _one_hot(samples, "narwhal_router_state")["fenced"] == 1
    assert _one_hot(samples, "narwhal_lease_state") == {"active": 0, "standby": 0, "fenced": 1}
    assert samples["narwhal_lease_fencing_token", ()] == 1  # the last token held
    assert response.status_code == 503
    assert response.json()["state"] == "fenced"
    assert response.json()["reason"] == "router_fenced: the lease was not renewed in time"
    assert response.json()["lease"]["state"] == "fenced"
