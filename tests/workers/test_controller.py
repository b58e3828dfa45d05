"""Relay workers under one admission controller, in one Trio run on virtual time.

The controller is the full router; each worker is the worker app over its own
:class:`~narwhal.workers.worker.WorkerRouter`, reaching the controller through a memory stream
(the same channel a Unix socket carries between processes), in front of the same in-process
simulated engines. Every assertion reads the controller's books: one truth for the pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio
import trio.testing

from narwhal.bench.inprocess import ASGIStreamTransport, run_lifespan
from narwhal.config import AdmissionConfig, Config, ServingConfig, UpstreamConfig
from narwhal.router import Router
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.web.app import create_app, get_router
from narwhal.workers.controller import Controller
from narwhal.workers.worker import PROGRESS_S, WorkerRouter
from tests.conftest import MODEL, engine_config
from tests.support import Pluggable, sse_payloads, until

pytestmark = pytest.mark.usefixtures("autojump_clock")


@attrs.define
class Worker:
    router: WorkerRouter
    client: httpx.AsyncClient
    scope: trio.CancelScope
    plugs: dict[str, Pluggable]  # this worker's way to each engine

    async def chat(self, **body: Any) -> httpx.Response:
        body.setdefault("model", MODEL)
        body.setdefault("messages", [{"role": "user", "content": "Hello there"}])
        return await self.client.post("/v1/chat/completions", json=body)

    def kill(self) -> None:
        """The worker process dies: it sends nothing more, and everything it runs stops."""
        assert self.router.channel is not None
        self.router.channel.close()
        self.scope.cancel()


@attrs.define
class Pool:
    router: Router
    controller: Controller
    workers: list[Worker]
    sims: dict[str, SimTransport]

    async def assert_quiescent(self) -> None:
        """Once the workers' last messages have arrived: nothing held, the books balance."""
        with trio.fail_after(1):
            await until(
                lambda: self.router.accounting.in_flight == 0 and self.router.retention.in_use == 0
            )
        stats = self.router.statistics()
        books = stats.accounting
        assert books.in_flight == 0, books
        self.router.accounting.check()
        assert stats.retention.in_use == 0
        assert stats.queue.depth == 0
        for engine in stats.engines:
            assert (engine.prefill, engine.decode) == (0, 0), engine


StartPool = Callable[..., Awaitable[Pool]]


@pytest.fixture
async def start_pool(nursery: trio.Nursery) -> AsyncIterator[StartPool]:
    clients: list[httpx.AsyncClient] = []

    async def start(
        workers: int = 2,
        engines: Sequence[str] = ("sim-a", "sim-b"),
        **config: Any,
    ) -> Pool:
        configs = tuple(engine_config(name) for name in engines)
        config.setdefault("serving", ServingConfig(model=MODEL, workers=workers))
        config.setdefault("upstream", UpstreamConfig(read_timeout_s=600))
        settings = Config(engines=configs, **config)
        sims = {
            engine.name: SimTransport(
                SimEngine(
                    MODEL,
                    timing=StepTiming(get_profile("h100-llama3-8b")),
                    seed=index,
                    name=engine.name,
                )
            )
            for index, engine in enumerate(configs)
        }
        app = create_app(settings, transports=sims)
        await nursery.start(partial(run_lifespan, app))
        router = get_router(app)
        controller = Controller(router, app)
        with trio.fail_after(60):
            await router.wait_ready()
            # Ready is one engine profiled: the tests that retry on another engine need all
            # of them (on a loaded machine the second joined after the first requests).
            await until(lambda: all(engine.eligible for engine in router.pool))
        pool = Pool(router, controller, [], sims)
        for _ in range(workers):
            pool.workers.append(await _start_worker(nursery, settings, controller, sims, clients))
        return pool

    yield start
    for client in clients:
        await client.aclose()


async def _start_worker(
    nursery: trio.Nursery,
    settings: Config,
    controller: Controller,
    sims: dict[str, SimTransport],
    clients: list[httpx.AsyncClient],
) -> Worker:
    ours, theirs = trio.testing.memory_stream_pair()
    nursery.start_soon(controller.serve_worker, theirs)

    async def connect() -> trio.abc.Stream:
        return ours

    plugs = {name: Pluggable(sim) for name, sim in sims.items()}
    router = WorkerRouter(settings, connect, transports=plugs)
    app = create_app(settings, router=router)
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[None]) -> None:
        with scope:
            async with trio.open_nursery() as inner:
                await inner.start(partial(run_lifespan, app))
                task_status.started()
                await trio.sleep_forever()

    await nursery.start(run)
    client = httpx.AsyncClient(
        transport=ASGIStreamTransport(app, nursery), base_url="http://narwhal.test"
    )
    clients.append(client)
    return Worker(router, client, scope, plugs)


def _content(response: httpx.Response) -> str:
    text = ""
    for payload in sse_payloads(response.text):
        if payload == "[DONE]":
            continue
        for choice in orjson.loads(payload).get("choices", ()):
            text += choice.get("delta", {}).get("content") or ""
    return text


async def test_both_workers_serve_and_the_controller_keeps_the_books(start_pool: StartPool) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    responses: list[httpx.Response] = []

    async def one(worker: Worker, stream: bool) -> None:
        responses.append(await worker.chat(stream=stream, max_tokens=16))

    async with trio.open_nursery() as clients:
        for index in range(12):
            clients.start_soon(one, pool.workers[index % 2], index % 3 == 0)
    assert [response.status_code for response in responses] == [200] * 12
    streamed = [r for r in responses if r.headers["content-type"].startswith("text/event-stream")]
    assert len(streamed) == 4
    assert all(_content(response) for response in streamed)
    # A client has its answer a moment before its worker's last message reaches the
    # controller: the books are read once every message is in.
    await pool.assert_quiescent()
    books = pool.router.statistics().accounting
    assert books.offered == 12
    assert books.terminal["completed"] == 12
    engines = pool.router.statistics().engines
    assert sum(engine.completed for engine in engines) == 12


async def test_other_routes_are_the_controllers(start_pool: StartPool) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    assert (await pool.workers[0].chat(max_tokens=4)).status_code == 200
    ready = await pool.workers[1].client.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["counters"]["offered"] == 1  # served by the other worker
    metrics = await pool.workers[1].client.get("/metrics")
    assert metrics.status_code == 200
    assert "narwhal_relay_workers 2.0" in metrics.text
    health = await pool.workers[1].client.get("/health")
    assert health.json() == {"status": "ok"}
    missing = await pool.workers[0].client.get("/nowhere")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


async def test_the_retention_limit_holds_across_workers(start_pool: StartPool) -> None:
    pool = await start_pool(
        admission=AdmissionConfig(mode="open", http_retention_limit=3),
    )
    statuses: list[tuple[int, str | None]] = []

    async def one(worker: Worker) -> None:
        response = await worker.chat(stream=True, max_tokens=64)
        code = response.json()["error"]["code"] if response.status_code != 200 else None
        statuses.append((response.status_code, code))

    async with trio.open_nursery() as clients:
        for index in range(4):
            clients.start_soon(one, pool.workers[index % 2])
            await trio.sleep(0.001)  # in this order: the fourth finds three held
    assert sorted(statuses, key=str) == [(200, None)] * 3 + [(429, "http_retention_full")]
    await pool.assert_quiescent()


async def test_predictive_refusals_reach_the_client_as_the_router_gives_them(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(ttft_budget_s=0.001))
    response = await pool.workers[0].chat(max_tokens=4)
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["code"] == "prompt_exceeds_ttft_budget"  # its prefill alone is longer
    assert set(error) == {"message", "type", "param", "code"}
    await pool.assert_quiescent()
    assert pool.router.statistics().accounting.terminal["refused"] == 1


async def test_a_worker_that_dies_has_its_requests_counted_and_its_slots_released(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    doomed, survivor = pool.workers

    async def stream(worker: Worker) -> None:
        async with worker.client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
                "max_tokens": 4000,
                "narwhal_sim": {"output_tokens": 4000},
            },
        ) as response:
            async for _ in response.aiter_bytes():
                pass

    async with trio.open_nursery() as clients:
        for _ in range(3):
            clients.start_soon(stream, doomed)
        await until(lambda: sum(e.decode for e in pool.router.pool) == 3)
        doomed.kill()
        clients.cancel_scope.cancel()
    await pool.assert_quiescent()
    books = pool.router.statistics().accounting
    assert books.by_reason[("failed", "worker_lost")] == 3
    # The pool goes on serving through the other worker.
    assert (await survivor.chat(max_tokens=8)).status_code == 200
    await pool.assert_quiescent()


async def test_a_queued_request_whose_client_leaves_leaves_the_controllers_queue(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(
        engines=("sim-a",),
        admission=AdmissionConfig(mode="open", prefill_concurrency=1, decode_concurrency=1),
    )
    first, second = pool.workers
    async with trio.open_nursery() as clients:
        clients.start_soon(
            partial(first.chat, stream=True, max_tokens=2000, narwhal_sim={"output_tokens": 2000})
        )
        await until(lambda: sum(e.prefill + e.decode for e in pool.router.pool) == 1)
        with trio.move_on_after(1.0):
            await second.chat(max_tokens=4)  # queued behind the first; its client gives up
        await until(lambda: pool.router.statistics().queue.depth == 0)
        clients.cancel_scope.cancel()
    await pool.assert_quiescent()
    assert pool.router.statistics().accounting.terminal["cancelled"] == 2


async def test_the_controller_learns_a_streams_progress_while_it_runs(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(engines=("sim-a",), admission=AdmissionConfig(mode="open"))
    engine = next(iter(pool.router.pool))
    seen: list[int] = []
    async with trio.open_nursery() as clients:
        clients.start_soon(
            partial(
                pool.workers[0].chat,
                stream=True,
                max_tokens=400,
                narwhal_sim={"output_tokens": 400},
            )
        )
        await until(lambda: engine.decode == 1)
        start = trio.current_time()
        await trio.sleep(0.5)
        seen = [slot.generated_tokens for slot in engine.slots]
        clients.cancel_scope.cancel()
    assert trio.current_time() - start >= 0.5
    assert seen and seen[0] > 0.5 / 0.02  # told every PROGRESS_S, not only at the end
    assert PROGRESS_S <= 0.05


async def test_a_failed_attempt_is_retried_on_the_engine_the_controller_gives(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    # The fault goes on the engine placement picks first, whichever profiled faster: on a
    # fixed one, every request could go to the other and the retry would never be tried.
    first = pool.router.pool.best(8)
    assert first is not None
    (other,) = (engine for engine in pool.router.pool if engine is not first)
    pool.sims[first.name].engine.set_directives({"fault": "http_500"})
    statuses = []
    for _ in range(6):
        statuses.append((await pool.workers[0].chat(max_tokens=4)).status_code)
    assert statuses == [200] * 6
    await pool.assert_quiescent()
    engines = {engine.name: engine for engine in pool.router.statistics().engines}
    assert engines[first.name].failed >= 1  # counted where the pool's books are
    assert engines[first.name].completed == 0
    assert engines[other.name].completed == 6


async def test_an_engine_a_worker_cannot_reach_opens_the_pools_circuit(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    first, second = pool.workers
    engines = {engine.name: engine for engine in pool.router.pool}
    sim_a, sim_b = engines["sim-a"], engines["sim-b"]
    first.plugs["sim-a"].down = True  # only this worker's way there is cut
    sim_b.enter_maintenance("test")  # so that the request goes to sim-a
    await until(lambda: not first.router.mirrors.by_name["sim-b"].eligible)
    failed = await first.chat(max_tokens=4)
    assert failed.status_code == 502  # unreachable from this worker, and no other engine
    assert not sim_a.eligible  # the controller's circuit: the failure was told
    sim_b.leave_maintenance()
    mirrors = second.router.mirrors.by_name
    await until(lambda: mirrors["sim-b"].eligible and not mirrors["sim-a"].eligible)
    before = pool.sims["sim-a"].statistics().completion_requests
    for _ in range(3):  # the other worker places nothing there while the circuit is open
        assert (await second.chat(max_tokens=4)).status_code == 200
    assert pool.sims["sim-a"].statistics().completion_requests == before
    await pool.assert_quiescent()


async def test_a_worker_that_sends_garbage_is_cut_off_and_accounted(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    bad, good = pool.workers
    async with trio.open_nursery() as clients:
        clients.start_soon(
            partial(bad.chat, stream=True, max_tokens=999, narwhal_sim={"output_tokens": 999})
        )
        await until(lambda: sum(e.decode for e in pool.router.pool) == 1)
        channel = bad.router.channel
        assert channel is not None
        channel.send({"t": "no-such-message"})
        await until(lambda: pool.controller.connected == 1)
        clients.cancel_scope.cancel()
    await pool.assert_quiescent()
    assert pool.router.statistics().accounting.by_reason[("failed", "worker_lost")] == 1
    assert (await good.chat(max_tokens=4)).status_code == 200


async def test_a_request_that_goes_as_sent_is_answered_whole_through_a_worker(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    response = await pool.workers[1].client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Say it back", "max_tokens": 4, "echo": True},
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith("Say it back")
    await pool.assert_quiescent()
    assert sum(engine.completed for engine in pool.router.statistics().engines) == 1


async def test_requests_that_share_a_clients_request_id_are_counted_apart(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    worker = pool.workers[0]
    statuses: list[int] = []

    async def one() -> None:
        response = await worker.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
            headers={"x-request-id": "same-id"},
        )
        statuses.append(response.status_code)

    async with trio.open_nursery() as clients:
        for _ in range(3):
            clients.start_soon(one)
    assert statuses == [200] * 3
    await pool.assert_quiescent()
    assert pool.router.statistics().accounting.terminal["completed"] == 3


async def test_a_streams_inter_token_gaps_reach_the_controllers_histogram(
    start_pool: StartPool,
) -> None:
    pool = await start_pool(admission=AdmissionConfig(mode="open"))
    response = await pool.workers[0].chat(
        stream=True, max_tokens=40, narwhal_sim={"output_tokens": 40}
    )
    assert response.status_code == 200
    await pool.assert_quiescent()
    events = sum(
        1
        for payload in sse_payloads(response.text)
        if payload != "[DONE]"
        and any(
            (choice.get("delta") or {}).get("content")
            for choice in orjson.loads(payload).get("choices", ())
        )
    )
    text = pool.router.metrics.render().decode()
    count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("narwhal_inter_token_gap_seconds_count")
    )
    assert events > 10
    assert count == events - 1  # one per output event after the first, as one process counts


async def test_a_forwarded_body_over_the_limit_is_the_413_envelope(start_pool: StartPool) -> None:
    pool = await start_pool(serving=ServingConfig(model=MODEL, workers=2, max_request_bytes=64))
    response = await pool.workers[0].client.post("/admin/maintenance/a", content=b"x" * 65)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
