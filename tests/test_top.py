"""``narwhal top`` (narwhal.top): the view fed message by message, and the command against a
router served on a real socket (as a subprocess: exit statuses, one line on errors, Ctrl-C)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import pytest
import trio

from narwhal.top import TOKEN_ENV, TopError, View, _watch, feed_url
from tests.test_events import TOKEN, Live, live_config, start_live

HELLO: dict[str, Any] = {
    "type": "hello",
    "at": 10.0,
    "time": 1_700_000_000.0,
    "version": "9.9.9",
    "model": "llama",
    "state": "active",
    "reason": None,
    "ready": True,
    "summary_interval_s": 1.0,
    "admission": {"mode": "predictive", "ttft_budget_s": 2.0, "queue_limit": 256},
    "engines": [
        {
            "name": "engine-a",
            "wave": "a",
            "eligible": True,
            "reason": None,
            "prefill": 0,
            "decode": 0,
            "prefill_limit": 4,
            "decode_limit": 128,
        }
    ],
    "waves": [{"wave": "a", "engines": ["engine-a"], "in_maintenance": False}],
    "counters": {"offered": 0},
}
SUMMARY: dict[str, Any] = {
    "type": "summary",
    "at": 11.0,
    "time": 1_700_000_001.0,
    "state": "active",
    "reason": None,
    "counts": {"offered": 5, "completed": 4, "refused": 1},
    "in_flight": 2,
    "queue_depth": 1,
    "retention_in_use": 2,
    "ttft": {"count": 4, "p50_s": 0.12, "p99_s": 1.5},
    "engines": [{"name": "engine-a", "eligible": True, "prefill": 1, "decode": 1}],
    "dropped": 3,
}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/admin/events"),
        ("http://127.0.0.1:8000/", "ws://127.0.0.1:8000/admin/events"),
        ("https://router.example", "wss://router.example/admin/events"),
        ("http://proxy.example/narwhal/", "ws://proxy.example/narwhal/admin/events"),
        ("http://h:1/admin/events", "ws://h:1/admin/events"),
        ("ws://h:1/custom?x=1", "ws://h:1/custom?x=1"),
    ],
)
def test_feed_url(given: str, expected: str) -> None:
    assert feed_url(given) == expected


@pytest.mark.parametrize("given", ["127.0.0.1:8000", "ftp://h/", "http://", ""])
def test_a_url_that_is_not_a_routers_is_refused(given: str) -> None:
    with pytest.raises(TopError, match="--url"):
        feed_url(given)


def test_the_view_shows_hello_summary_and_events() -> None:
    view = View()
    assert view.feed(HELLO) is None
    assert view.feed(SUMMARY) is None
    lines = "\n".join(view.lines())
    assert "narwhal 9.9.9" in lines and "llama" in lines and "state active" in lines
    assert "offered 5" in lines and "completed 4" in lines and "refused 1" in lines
    assert "in flight 2" in lines and "queue 1" in lines
    assert "TTFT p50 120 ms p99 1.50 s (4 completed)" in lines
    assert "3 summaries lost" in lines
    assert "engine-a" in lines and "prefill 1/4" in lines and "decode 1/128" in lines
    happened = view.feed(
        {
            "type": "state",
            "time": 1_700_000_002.0,
            "from": "active",
            "to": "maintenance",
            "reason": "router_maintenance",
        }
    )
    assert happened is not None
    assert happened.endswith("state active -> maintenance (router_maintenance)")
    assert view.state == "maintenance"
    wave = {"type": "wave", "time": 1_700_000_003.0, "event": "started", "running": 1}
    view.feed(wave | {"wave": "a", "engines": ["engine-a"], "in_maintenance": True})
    lines = "\n".join(view.lines())
    assert "wave a: engine-a: 1 running" in lines
    assert "wave a started (1 running)" in lines
    assert "state maintenance (router_maintenance)" in lines
    assert "\x1b[" not in lines  # plain unless asked
    assert "\x1b[" in "\n".join(view.lines(ansi=True))
    line = view.line()
    assert "state=maintenance" in line and "offered=5" in line and "ttft_p99_s=1.5" in line


def test_a_feed_that_does_not_greet_is_not_narwhals() -> None:
    with pytest.raises(TopError, match="not greet"):
        View().feed(SUMMARY)


# -- against a served router -----------------------------------------------------------------------


@pytest.fixture
async def live(nursery: trio.Nursery) -> Live:
    return await start_live(nursery, live_config())


async def top(*args: str, token: str | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if token is not None:
        env[TOKEN_ENV] = token
    with trio.fail_after(60):
        return await trio.run_process(
            [sys.executable, "-m", "narwhal", "top", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )


def one_line(result: subprocess.CompletedProcess[bytes]) -> str:
    err = result.stderr.decode()
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.realtime
async def test_top_once_prints_the_state_and_exits_0(live: Live) -> None:
    result = await top("--url", live.url, "--once", "--token", TOKEN)
    assert result.returncode == 0, result.stderr
    out = result.stdout.decode()
    assert "state active" in out
    assert "last second" in out and "sim-a" in out and "sim-b" in out
    assert "\x1b[" not in out  # not a terminal: plain text


@pytest.mark.realtime
async def test_top_takes_its_token_from_the_environment(live: Live) -> None:
    result = await top("--url", live.url, "--once", token=TOKEN)
    assert result.returncode == 0, result.stderr
    assert b"state active" in result.stdout


@pytest.mark.realtime
@pytest.mark.parametrize("token", [None, "wrong"])
async def test_a_refused_token_is_one_line_and_status_2(live: Live, token: str | None) -> None:
    args = ["--url", live.url, "--once"] + ([] if token is None else ["--token", token])
    result = await top(*args)
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith("narwhal top: refused (HTTP 401 admin_unauthorized): ")
    assert "wrong" not in line


@pytest.mark.realtime
async def test_an_unreachable_router_is_one_line_and_status_2() -> None:
    with trio.socket.socket() as sock:  # a port nothing listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = await top("--url", f"http://127.0.0.1:{port}", "--once", "--timeout", "5")
    assert result.returncode == 2
    assert one_line(result).startswith(f"narwhal top: cannot reach ws://127.0.0.1:{port}/")


@pytest.fixture
async def not_narwhal(nursery: trio.Nursery) -> AsyncIterator[int]:
    """A plain HTTP server that answers every request with a 404 page."""

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                received += chunk
            page = b"<h1>Not Found</h1>"
            await stream.send_all(
                b"HTTP/1.1 404 Not Found\r\nContent-Type: text/html\r\nContent-Length: "
                + str(len(page)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + page
            )

    [listener] = await nursery.start(partial(trio.serve_tcp, answer, 0, host="127.0.0.1"))
    yield listener.socket.getsockname()[1]


@pytest.mark.realtime
async def test_a_server_that_is_not_narwhal_is_one_line_and_status_2(not_narwhal: int) -> None:
    result = await top("--url", f"http://127.0.0.1:{not_narwhal}", "--once")
    assert result.returncode == 2
    assert one_line(result) == (
        "narwhal top: the server answered HTTP 404: not a Narwhal event feed\n"
    )


@pytest.mark.realtime
async def test_without_a_terminal_top_prints_a_line_a_second_until_the_router_goes(
    live: Live,
) -> None:
    out = io.StringIO()
    url = feed_url(live.url)
    async with trio.open_nursery() as nursery:
        ended: list[str | None] = []

        async def watch() -> None:
            ended.append(await _watch(url, TOKEN, once=False, timeout_s=10, out=out, ansi=False))

        nursery.start_soon(watch)
        with trio.fail_after(20):
            while out.getvalue().count("\n") < 2:  # noqa: ASYNC110 - a StringIO has no event
                await trio.sleep(0.05)
            live.stop.set()
            await live.stopped.wait()
    lines = out.getvalue().splitlines()
    assert all(line.split()[1].startswith("state=") for line in lines[:2]), lines
    assert any(line.endswith("state active -> draining (router_draining)") for line in lines)
    assert ended == ["the router closed the feed: the router is shutting down"]


@pytest.mark.realtime
async def test_ctrl_c_ends_top_quietly_with_status_130(live: Live) -> None:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | {TOKEN_ENV: TOKEN}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(partial_process(["--url", live.url], env))
            assert process.stdout is not None and process.stderr is not None
            seen = b""
            while b"state=" not in seen:
                seen += await process.stdout.receive_some(4096)
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 130
            rest = b""
            while chunk := await process.stderr.receive_some(4096):
                rest += chunk
            assert b"Traceback" not in rest


def partial_process(args: list[str], env: dict[str, str]) -> Any:
    async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
        await trio.run_process(
            [sys.executable, "-m", "narwhal", "top", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            check=False,
            env=env,
            task_status=task_status,
        )

    return run
