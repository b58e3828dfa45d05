"""SIGTERM against a ``narwhal serve`` process with streams in flight (real processes, bounded).

Two ``narwhal sim`` engine processes, one router process. With streams running, SIGTERM: every
stream ends whole (an in-band error event and ``data: [DONE]`` once the drain deadline passes,
never a cut chunked body), the process exits 0 with no traceback. With only an idle keep-alive
connection open, it exits at once.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.chaos.support import check_answer, count_case
from tests.conftest import MODEL
from tests.support import wait_ready

pytestmark = pytest.mark.realtime

DRAIN_S = 1.0
_numbers = itertools.count()
URL = re.compile(rb"(http://127\.0\.0\.1:\d+)")


class Process:
    def __init__(self, process: trio.Process, errors: Path) -> None:
        self.process = process
        self.errors = errors  # stderr goes to a file: a full pipe would stall the process
        self.output = bytearray()

    async def url(self) -> str:
        """The first URL the process prints (both commands print theirs once listening)."""
        assert self.process.stdout is not None
        with trio.fail_after(20):
            while not (found := URL.search(self.output)):
                data = await self.process.stdout.receive_some(4096)
                assert data, f"the process ended: {bytes(self.output)!r}"
                self.output.extend(data)
        return found.group(1).decode()

    async def stderr(self) -> str:
        return await trio.Path(self.errors).read_text(errors="replace")


async def start(folder: Path, *args: str) -> Process:
    errors = folder / f"stderr-{args[0]}-{next(_numbers)}.txt"
    with open(errors, "wb") as sink:  # noqa: ASYNC230 - a file handle for the child
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "narwhal", *args], stdout=subprocess.PIPE, stderr=sink
        )
    return Process(process, errors)


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[tuple[Process, str]]:
    processes: list[Process] = []
    try:
        engines = []
        for seed in range(2):
            sim = await start(
                tmp_path, "sim", "--bind", "127.0.0.1:0", "--model", MODEL, "--seed", str(seed)
            )
            processes.append(sim)
            engines.append(await sim.url())
        config = tmp_path / "config.toml"
        text = f'[serving]\nmodel = "{MODEL}"\nbind = "127.0.0.1:0"\n\n'
        text += f"[control]\ndrain_deadline_s = {DRAIN_S}\n\n"
        for index, url in enumerate(engines):
            text += f'[[engines]]\nname = "engine-{index}"\nurl = "{url}"\n\n'
        await trio.Path(config).write_text(text)
        serve = await start(tmp_path, "serve", "--config", str(config))
        processes.append(serve)
        url = await serve.url()
        await wait_ready(url)
        yield serve, url
    finally:
        for process in processes:
            if process.process.returncode is None:
                process.process.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await process.process.wait()


async def wait_exit(process: Process, within_s: float) -> tuple[int, float]:
    began = trio.current_time()
    with trio.fail_after(within_s):
        code = await process.process.wait()
    return code, trio.current_time() - began


async def test_sigterm_with_streams_in_flight_ends_each_stream_whole(
    router: tuple[Process, str],
) -> None:
    serve, url = router
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer please"}],
        "stream": True,
        "narwhal_sim": {"output_tokens": 5000, "itl_s": 0.02},
    }
    streams = 6
    started = 0
    endings: list[bytes] = []

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal started
        content = bytearray()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            counted = False
            # A cut chunked body raises here (httpx.RemoteProtocolError): that fails the test.
            async for chunk in response.aiter_bytes():
                content.extend(chunk)
                if not counted and b'"content":"' in content:
                    started += 1
                    counted = True
        endings.append(bytes(content))

    with trio.fail_after(30):
        async with httpx.AsyncClient(timeout=20) as client, trio.open_nursery() as clients:
            for _ in range(streams):
                clients.start_soon(one, client)
            while started < streams:  # noqa: ASYNC110 - counted by the readers
                await trio.sleep(0.02)
            serve.process.send_signal(signal.SIGTERM)
            signalled = trio.current_time()
            # The signal reaches the router asynchronously: once /ready says it is draining, a
            # new request is refused (or finds the port closed).
            try:
                while (await client.get(f"{url}/ready")).json()["state"] != "draining":  # noqa: ASYNC110
                    await trio.sleep(0.01)
            except httpx.TransportError:
                pass
            try:
                refused = await client.post(f"{url}/v1/chat/completions", json=body)
            except httpx.TransportError:
                pass
            else:
                assert refused.status_code == 503, refused.text
                check_answer(503, refused.content)
        code, _ = await wait_exit(serve, DRAIN_S + 10)
        took = trio.current_time() - signalled
    assert len(endings) == streams
    for content in endings:
        answer = check_answer(200, content, streamed=True, where="a stream cut by shutdown")
        assert answer.terminal in ("unavailable", "completed"), answer
        if answer.code is not None:
            assert answer.code in ("shutdown", "router_draining", "router_shutdown"), answer
        count_case("sigterm", answer.code or "completed", latency_s=took)
    assert code == 0, f"exit code {code}"
    assert took < DRAIN_S + 5, f"took {took:.1f} s to exit"
    errors = await serve.stderr()
    assert "Traceback" not in errors and "Exceptions from Trio nursery" not in errors, errors


async def test_sigterm_with_only_an_idle_keep_alive_connection_exits_at_once(
    router: tuple[Process, str],
) -> None:
    serve, url = router
    with trio.fail_after(30):
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert response.status_code == 200
            json.loads(response.content)  # the pooled connection now idles, kept alive
            serve.process.send_signal(signal.SIGTERM)
            code, took = await wait_exit(serve, 15)
    count_case("sigterm idle", code, latency_s=took)
    assert code == 0, f"exit code {code}"
    assert took < 1.0, f"an idle keep-alive connection held the exit for {took:.1f} s"
    errors = await serve.stderr()
    assert "Traceback" not in errors, errors
