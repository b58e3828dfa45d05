"""What the lease's condition does to a running router: a fenced or standby router places
nothing (queued requests get their 503 at once, placed ones finish), and the fencing token goes
to the engines with every request. Virtual time, in-process engines."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from narwhal.admission.queue import Waiter
from narwhal.config import AdmissionConfig
from narwhal.errors import Unavailable
from narwhal.upstream.client import FENCE_HEADER
from tests.conftest import MODEL, Fleet, StartFleet
from tests.support import until

STALL = {"output_tokens": 2, "fault": "stall", "stall_s": 5.0}


async def _post(fleet: Fleet, sim: dict[str, object] | None = None) -> httpx.Response:
    body: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if sim is not None:
        body["narwhal_sim"] = sim
    return await fleet.client.post("/v1/chat/completions", json=body)


class Recorder(httpx.AsyncBaseTransport):
    """Records the fencing header of every completion request on its way to the engine."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.fences: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("completions"):
            self.fences.append(request.headers.get(FENCE_HEADER))
        return await self.inner.handle_async_request(request)


async def test_fenced_router_refuses_its_queue_at_once_and_lets_placed_work_finish(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(
        [("sim-a", "vllm")],
        admission=AdmissionConfig(mode="open", prefill_concurrency=1, admission_wait_s=20),
    )
    done: list[tuple[float, httpx.Response]] = []

    async def run(sim: dict[str, object] | None) -> None:
        response = await _post(fleet, sim)
        done.append((trio.current_time(), response))

    with trio.fail_after(60):
        nursery.start_soon(run, STALL)  # placed: holds the only prefill slot
        await until(lambda: fleet.router.pool.eligible()[0].prefill == 1)
        nursery.start_soon(run, None)  # queued behind it
        await until(lambda: fleet.router.queue.statistics().depth == 1)
        fenced_at = trio.current_time()
        fleet.router.control.set_lease("fenced", "router_fenced: test")
        await until(lambda: len(done) == 1)
        queued_at, queued = done[0]
        assert queued_at == fenced_at  # not at the end of its admission wait
        assert queued.status_code == 503, queued.text
        assert queued.json()["error"]["code"] == "router_fenced"
        assert queued.headers["retry-after"] == "1"
        newcomer = await _post(fleet)
        assert newcomer.json()["error"]["code"] == "router_fenced"
        await until(lambda: len(done) == 2)
    assert done[1][1].status_code == 200  # the placed request finished
    counters = fleet.counters()
    assert counters["unavailable"] == 2 and counters["completed"] == 1
    assert fleet.router.queue.statistics().refused_unavailable == 1
    assert fleet.router.accounting.statistics().by_reason[("unavailable", "router_fenced")] == 2
    fleet.router.control.set_lease("active")
    assert (await _post(fleet)).status_code == 200
    fleet.assert_quiescent()


async def test_standby_router_places_nothing_even_when_admitted_before(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=AdmissionConfig(mode="open"))
    queue = fleet.router.queue
    fleet.router.control.set_lease("standby", "router_standby: the leader is b")
    # A request that passed the state check just before is still not placed.
    waiter = Waiter(10, False)
    assert queue.place_now(waiter) is None
    with pytest.raises(Unavailable) as refused:
        async with queue.placement(waiter, 5.0):
            raise AssertionError("placed while standby")
    assert refused.value.code == "router_standby"
    assert queue.statistics().placed == 0


async def test_the_fencing_token_goes_with_every_request(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=AdmissionConfig(mode="open"))
    recorder = Recorder(fleet.plugs["sim-a"].inner)
    fleet.plugs["sim-a"].inner = recorder
    with trio.fail_after(60):
        assert (await _post(fleet)).status_code == 200
        fleet.router._fence(41)  # what the lease keeper tells the router on winning the key
        assert (await _post(fleet)).status_code == 200
        stream = {"model": MODEL, "prompt": "x", "stream": True}
        assert (await fleet.client.post("/v1/completions", json=stream)).status_code == 200
        fleet.router._fence(57)
        assert (await _post(fleet)).status_code == 200
    assert recorder.fences == [None, "41", "41", "57"]
