"""``narwhal serve`` with ``serving.workers = 2`` as processes, in front of two ``narwhal sim``
engine processes (free ports, bounded, polling with deadlines).

Which worker accepts a connection is the kernel's choice; to make it the test's, the other
worker is paused (SIGSTOP) while a client connects, so that only one process calls ``accept``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from narwhal.bench.procstat import descendants
from narwhal.bench.services import free_port
from tests.conftest import MODEL
from tests.support import wait_ready

pytestmark = pytest.mark.realtime

URL = re.compile(rb"serving '[^']*' on (http://127\.0\.0\.1:\d+) with 2 relay workers")
SIM_URL = re.compile(rb"(http://127\.0\.0\.1:\d+)")
_numbers = itertools.count()
DRAIN_S = 30


class Process:
    """A ``python -m narwhal`` child: stdout read as needed, stderr to a file (a full pipe would
    stall the process)."""

    def __init__(self, process: trio.Process, errors: Path) -> None:
        self.process = process
        self.errors = errors
        self.output = bytearray()

    async def find(self, pattern: re.Pattern[bytes], within_s: float = 60) -> str:
        assert self.process.stdout is not None
        with trio.fail_after(within_s):
            while not (found := pattern.search(self.output)):
                data = await self.process.stdout.receive_some(4096)
                assert data, f"the process ended: {bytes(self.output)!r} {self.stderr()}"
                self.output.extend(data)
        return found.group(1).decode()

    def stderr(self) -> str:
        return self.errors.read_text(errors="replace")


async def start(folder: Path, *args: str, module: str = "narwhal", **env: str) -> Process:
    errors = folder / f"stderr-{args[0]}-{next(_numbers)}.txt"
    with open(errors, "wb") as sink:  # noqa: ASYNC230 - a file handle for the child
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=sink,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        )
    return Process(process, errors)


class Pool:
    """The serve process, its URL, and the PIDs of its relay workers."""

    def __init__(self, serve: Process, url: str, probes: str) -> None:
        self.serve = serve
        self.url = url
        self.probes = probes

    def workers(self) -> list[int]:
        return sorted(descendants(self.serve.process.pid)[1:])

    async def ready(self, client: httpx.AsyncClient) -> dict[str, Any]:
        body: dict[str, Any] = (await client.get(f"{self.url}/ready")).json()
        return body


async def engines(folder: Path, processes: list[Process]) -> str:
    """Two ``narwhal sim`` processes; their ``[[engines]]`` tables."""
    text = ""
    for seed in range(2):
        sim = await start(
            folder, "sim", "--bind", "127.0.0.1:0", "--model", MODEL, "--seed", str(seed)
        )
        processes.append(sim)
        text += f'[[engines]]\nname = "engine-{seed}"\nurl = "{await sim.find(SIM_URL)}"\n\n'
    return text


async def stop_all(processes: list[Process]) -> None:
    for process in processes:
        if process.process.returncode is None:
            process.process.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await process.process.wait()


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Pool]:
    processes: list[Process] = []
    try:
        config = tmp_path / "config.toml"
        probes = f"127.0.0.1:{free_port()}"
        text = f'[serving]\nmodel = "{MODEL}"\nbind = "127.0.0.1:0"\nworkers = 2\n'
        text += f'probe_bind = "{probes}"\n\n[control]\ndrain_deadline_s = {DRAIN_S}\n\n'
        config.write_text(text + await engines(tmp_path, processes))
        serve = await start(tmp_path, "serve", "--config", str(config))
        processes.append(serve)
        pool = Pool(serve, await serve.find(URL), f"http://{probes}")
        await wait_ready(pool.url, within_s=30, step_s=0.05)
        assert len(pool.workers()) == 2
        yield pool
    finally:
        await stop_all(processes)
        for process in processes:
            assert b"Traceback" not in process.errors.read_bytes(), process.stderr()


@contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    """``pids`` stopped while the block runs: none of them accepts a connection meanwhile."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def chat_body(output_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "a long story"}],
        "narwhal_sim": {"output_tokens": output_tokens},
    }


class Stream:
    """One streamed chat on a client (and so a connection) of its own."""

    def __init__(self) -> None:
        self.text = ""
        self.error: str | None = None

    @property
    def payloads(self) -> list[str]:
        return [line[6:] for line in self.text.splitlines() if line.startswith("data: ")]

    async def run(
        self, url: str, output_tokens: int, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Stream; ``started`` at the first event (the worker that accepted it serves it)."""
        try:
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream(
                    "POST", f"{url}/v1/chat/completions", json=chat_body(output_tokens)
                ) as response,
            ):
                assert response.status_code == 200
                async for piece in response.aiter_text():
                    if not self.text:
                        task_status.started()
                    self.text += piece
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__
            if not self.text:
                raise


async def streams_on(
    nursery: trio.Nursery, pool: Pool, worker: int, count: int, output_tokens: int
) -> list[Stream]:
    """``count`` streams served by ``worker`` (every other worker paused while they begin)."""
    others = [pid for pid in pool.workers() if pid != worker]
    streams = [Stream() for _ in range(count)]
    with paused(others), trio.fail_after(30):
        for stream in streams:
            await nursery.start(partial(stream.run, pool.url, output_tokens))
    return streams


def openai_stream(url: str) -> tuple[str, str | None, int]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20) as client:
        text, finish, chunks = "", None, 0
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello there"}],
            stream=True,
            max_tokens=12,
        )
        for chunk in stream:
            chunks += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish, chunks


async def served_by(pool: Pool, worker: int) -> tuple[str, str | None, int]:
    """An openai streamed chat that only ``worker`` can accept."""
    others = [pid for pid in pool.workers() if pid != worker]
    with paused(others), trio.fail_after(30):
        return await trio.to_thread.run_sync(openai_stream, pool.url)


def balanced(counters: dict[str, int]) -> bool:
    terminals = sum(
        v for k, v in counters.items() if k not in ("offered", "unsized_offered", "in_flight")
    )
    return counters["offered"] == terminals + counters["in_flight"]


async def settled(pool: Pool, client: httpx.AsyncClient) -> dict[str, Any]:
    """``/ready`` once no request is in flight and no engine holds a slot."""
    with trio.fail_after(30):
        while True:
            ready = await pool.ready(client)
            assert balanced(ready["counters"]), ready["counters"]
            occupied = [
                engine["occupancy"]
                for engine in ready["engines"]
                if engine["occupancy"]["prefill"] or engine["occupancy"]["decode"]
            ]
            if ready["counters"]["in_flight"] == 0 and not occupied:
                return ready
            await trio.sleep(0.05)


# -- the tests ------------------------------------------------------------------------------------


async def test_both_workers_serve_openai_streams_from_one_pool(pool: Pool) -> None:
    workers = pool.workers()
    for worker in workers:
        text, finish, chunks = await served_by(pool, worker)
        assert text and finish in ("stop", "length") and chunks >= 2
    async with httpx.AsyncClient(timeout=5) as client:
        ready = await settled(pool, client)
        # One set of books whichever worker answers: both requests are in it.
        assert ready["counters"]["completed"] == 2
        for worker in workers:
            with paused([pid for pid in workers if pid != worker]), trio.fail_after(30):
                async with httpx.AsyncClient(timeout=5) as fresh:  # a connection it accepts
                    again = await pool.ready(fresh)
            assert again["counters"] == ready["counters"]
        metrics = (await client.get(f"{pool.url}/metrics")).text
        # The controller's probe listener answers for the pool too (the workers have none).
        with trio.fail_after(10):
            while (probe := (await client.get(f"{pool.probes}/ready")).json())[  # noqa: ASYNC110
                "counters"
            ] != ready["counters"]:
                await trio.sleep(0.05)
        assert probe["state"] == "active"
    assert "\nnarwhal_offered_total 2.0\n" in metrics


async def test_a_killed_worker_is_accounted_its_slots_released_and_it_is_replaced(
    pool: Pool,
) -> None:
    doomed, survivor = pool.workers()
    async with httpx.AsyncClient(timeout=5) as client, trio.open_nursery() as nursery:
        lost = await streams_on(nursery, pool, doomed, 3, 50_000)
        kept = await streams_on(nursery, pool, survivor, 3, 50_000)
        running = await pool.ready(client)
        assert running["counters"]["in_flight"] == 6
        assert sum(engine["occupancy"]["decode"] for engine in running["engines"]) == 6

        os.kill(doomed, signal.SIGKILL)
        with trio.fail_after(30):
            while not all(stream.error for stream in lost):  # noqa: ASYNC110
                await trio.sleep(0.05)
            # The survivor's streams still run.
            lengths = [len(stream.text) for stream in kept]
            while not all(len(s.text) > n for s, n in zip(kept, lengths, strict=True)):  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert not any(stream.error for stream in kept)
        nursery.cancel_scope.cancel()  # the survivor's clients go away

    async with httpx.AsyncClient(timeout=5) as client:
        ready = await settled(pool, client)
        counters = ready["counters"]
        assert counters["offered"] == 6
        assert counters["failed"] == 3  # the killed worker's: worker_lost
        assert counters["cancelled"] == 3  # the survivor's, whose clients left
        metrics = (await client.get(f"{pool.url}/metrics")).text
        assert 'narwhal_failed_total{reason="worker_lost"} 3.0' in metrics

    # It is replaced, and the new worker serves.
    with trio.fail_after(30):
        while len(workers := pool.workers()) != 2 or doomed in workers:  # noqa: ASYNC110
            await trio.sleep(0.05)
    (new,) = [pid for pid in workers if pid != survivor]
    text, finish, _ = await served_by(pool, new)
    assert text and finish in ("stop", "length")
    assert f"(pid {doomed}) was ended by SIGKILL; starting another in 0.5 s" in (
        pool.serve.stderr()
    )


async def test_sigterm_drains_the_workers_and_exits_0(pool: Pool) -> None:
    workers = pool.workers()
    async with trio.open_nursery() as nursery:
        streams = [
            *await streams_on(nursery, pool, workers[0], 1, 300),
            *await streams_on(nursery, pool, workers[1], 1, 300),
        ]
        pool.serve.process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            code = await pool.serve.process.wait()
    assert code == 0, pool.serve.stderr()
    for stream in streams:  # both ran to their end while the workers drained
        assert stream.error is None
        assert stream.payloads[-1] == "[DONE]"
        assert "error" not in json.loads(stream.payloads[-2])
    errors = pool.serve.stderr()
    assert "SIGTERM: shutting down" in errors
    assert "Traceback" not in errors
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_hypercorns_own_workers_share_one_controller(tmp_path: Path) -> None:
    processes: list[Process] = []
    # A short folder: a Unix socket's path has at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="nw-") as short:
        socket_path = f"{short}/controller.sock"
        try:
            config = tmp_path / "config.toml"
            text = f'[serving]\nmodel = "{MODEL}"\ncontroller_socket = "{socket_path}"\n\n'
            config.write_text(text + await engines(tmp_path, processes))
            controller = await start(tmp_path, "controller", "--config", str(config))
            processes.append(controller)
            assert await controller.find(re.compile(rb"controller for '[^']*' on (\S+)")) == (
                socket_path
            )
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            hypercorn = await start(
                tmp_path,
                "-k",
                "trio",
                "-w",
                "2",
                "--bind",
                f"127.0.0.1:{port}",
                "narwhal.asgi:app()",
                module="hypercorn",
                NARWHAL_CONFIG=str(config),
            )
            processes.append(hypercorn)
            await wait_ready(url, within_s=30)
            async with httpx.AsyncClient(timeout=5) as client:
                for _ in range(4):
                    text, finish, _ = await trio.to_thread.run_sync(openai_stream, url)
                    assert text and finish in ("stop", "length")
                ready = (await client.get(f"{url}/ready")).json()
            assert ready["counters"]["offered"] == ready["counters"]["completed"] == 4

            hypercorn.process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                await hypercorn.process.wait()
            controller.process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await controller.process.wait() == 0, controller.stderr()
            assert not os.path.exists(socket_path)  # noqa: ASYNC240 - one stat, after the exit
            assert "Traceback" not in controller.stderr()
        finally:
            await stop_all(processes)


def status_field(pid: int, name: str) -> str:
    """One field of process ``pid``'s ``/proc/PID/status``."""
    found = re.search(rf"^{name}:\s*(.*)$", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert found is not None, name
    return found.group(1)


def pending_signals(pid: int) -> set[int]:
    """The signals sent to process ``pid`` and not yet delivered (``ShdPnd``)."""
    mask = int(status_field(pid, "ShdPnd"), 16)
    return {number + 1 for number in range(64) if mask >> number & 1}


async def test_a_second_signal_ends_the_drain_of_workers_that_had_not_read_the_first(
    pool: Pool,
) -> None:
    # Two copies of one signal pending at once are delivered as one: a worker busy enough
    # not to have read the drain's signal before the hurry's came would drain to the deadline.
    # Frozen workers make that moment certain.
    workers = pool.workers()
    both = {signal.SIGTERM, signal.SIGINT}  # the drain's, then the hurry's
    async with trio.open_nursery() as nursery:
        streams = [
            *await streams_on(nursery, pool, workers[0], 1, 50_000),
            *await streams_on(nursery, pool, workers[1], 1, 50_000),
        ]
        with paused(workers):
            with trio.fail_after(10):  # stopped: no signal is delivered until they continue
                while not all(status_field(pid, "State").startswith("T") for pid in workers):  # noqa: ASYNC110
                    await trio.sleep(0.02)
            pool.serve.process.send_signal(signal.SIGINT)
            with trio.fail_after(10):
                while "SIGINT: shutting down" not in pool.serve.stderr():  # noqa: ASYNC110
                    await trio.sleep(0.02)
            pool.serve.process.send_signal(signal.SIGINT)
            with trio.fail_after(10):  # the drain's signal and the hurry's wait for each, apart
                while not all(both <= pending_signals(pid) for pid in workers):  # noqa: ASYNC110
                    await trio.sleep(0.02)
        with trio.fail_after(DRAIN_S / 2):  # ended at once, not at the drain's deadline
            code = await pool.serve.process.wait()
    errors = pool.serve.stderr()
    assert code == 0, errors
    for stream in streams:
        assert stream.payloads[-1] == "[DONE]"
        assert json.loads(stream.payloads[-2])["error"]["code"] == "shutdown"


async def test_a_second_signal_ends_the_workers_streams_in_band_and_exits_0(pool: Pool) -> None:
    workers = pool.workers()
    async with trio.open_nursery() as nursery:
        streams = [
            *await streams_on(nursery, pool, workers[0], 1, 50_000),
            *await streams_on(nursery, pool, workers[1], 1, 50_000),
        ]
        pool.serve.process.send_signal(signal.SIGINT)
        with trio.fail_after(10):
            while "draining:" not in pool.serve.stderr():  # noqa: ASYNC110
                await trio.sleep(0.02)
        pool.serve.process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            code = await pool.serve.process.wait()
    errors = pool.serve.stderr()
    assert code == 0, errors
    assert "SIGINT again: ending the drain now" in errors
    for stream in streams:  # each ended whole: an in-band error, then [DONE]
        assert stream.error is None
        assert stream.payloads[-1] == "[DONE]"
        assert json.loads(stream.payloads[-2])["error"]["code"] == "shutdown"
