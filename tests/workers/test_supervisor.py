"""The supervisor's parts: the restart ladder, the workers' configuration and command line, the
worker processes' keeping (started, restarted, stopped, killed), ``serve()`` on sockets and an
app it is given, and the command line's one-line failures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from narwhal.asgi import CONFIG_ENV
from narwhal.asgi import app as asgi_app
from narwhal.cli import main
from narwhal.config import (
    Config,
    ServingConfig,
    config_from_mapping,
    config_to_mapping,
    config_to_toml,
)
from narwhal.router import Router
from narwhal.server import serve
from narwhal.web.app import create_app, get_router
from narwhal.workers.supervisor import (
    Backoff,
    Workers,
    WorkerStartError,
    worker_argv,
    worker_config,
)
from narwhal.workers.worker import WorkerRouter
from tests.conftest import MODEL, engine_config

# -- pure parts -----------------------------------------------------------------------------------


def test_the_restart_ladder_doubles_to_its_cap_and_starts_again_after_a_steady_run() -> None:
    backoff = Backoff(first_s=0.5, max_s=5.0, steady_s=10.0)
    assert [backoff.delay(0.1) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.delay(10.0) == 0.5  # it ran steadily: from the first rung again
    assert backoff.delay(9.9) == 1.0


def test_a_worker_runs_the_same_configuration_on_its_controller_without_probes() -> None:
    config = Config(
        serving=ServingConfig(model=MODEL, probe_bind="127.0.0.1:0", workers=3),
        engines=(engine_config("a"),),
    )
    worker = worker_config(config, "/run/narwhal/controller.sock")
    assert worker.serving.controller_socket == "/run/narwhal/controller.sock"
    assert worker.serving.probe_bind == ""  # the controller answers the pool's probes
    assert attrs.evolve(
        worker, serving=attrs.evolve(worker.serving, controller_socket="", probe_bind="")
    ) == attrs.evolve(config, serving=attrs.evolve(config.serving, probe_bind=""))
    # What the supervisor writes for it loads back to the same effective values.
    loaded = config_from_mapping(tomllib.loads(config_to_toml(worker)))
    assert config_to_mapping(loaded) == config_to_mapping(worker)


def test_the_worker_command_line() -> None:
    argv = worker_argv("/tmp/w.toml", "/tmp/c.sock", [5, 7], verbose=True)
    assert argv == [
        sys.executable,
        "-m",
        "narwhal",
        "worker",
        "--config",
        "/tmp/w.toml",
        "--controller",
        "/tmp/c.sock",
        "--fd",
        "5",
        "--fd",
        "7",
        "-v",
    ]


# -- keeping worker processes (stand-in commands, real processes) ---------------------------------

FAST = Backoff(first_s=0.01, max_s=0.04, steady_s=60.0)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def until(condition: Callable[[], bool], within_s: float = 20.0) -> None:
    with trio.fail_after(within_s):
        while not condition():  # noqa: ASYNC110 - polling a process, with a deadline
            await trio.sleep(0.01)


@pytest.mark.realtime
async def test_a_worker_that_exits_while_starting_fails_the_start() -> None:
    said: list[str] = []
    workers = Workers(python("raise SystemExit(3)"), (), 2, said.append, FAST)
    with trio.fail_after(20), pytest.raises(ExceptionGroup) as caught:
        await workers.run()
    assert caught.group_contains(WorkerStartError, match="exited with status 3 while starting")
    assert said == []


@pytest.mark.realtime
async def test_a_serving_worker_that_exits_is_restarted_with_backoff_then_stopped() -> None:
    said: list[str] = []
    # Each start exits at once: a crash loop, restarted on the ladder, never more than 2 alive.
    workers = Workers(python("raise SystemExit(7)"), (), 2, said.append, FAST)
    workers.serving = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(workers.run)
        await until(lambda: workers.starts >= 8)
        workers.stop()
        with trio.fail_after(10):
            await workers.wait_stopped()
    assert workers.pids == []
    assert any("exited with status 7; starting another in 0.01 s" in line for line in said)
    assert any("starting another in 0.04 s" in line for line in said)  # the cap


@pytest.mark.realtime
async def test_a_worker_that_cannot_be_started_fails_the_start_or_is_retried(
    tmp_path: Path,
) -> None:
    missing = [str(tmp_path / "no-such-program")]
    with trio.fail_after(20), pytest.raises(ExceptionGroup) as caught:
        await Workers(missing, (), 1, print, FAST).run()
    assert caught.group_contains(WorkerStartError, match="cannot start relay worker 1: ")
    said: list[str] = []
    workers = Workers(missing, (), 1, said.append, FAST)
    workers.serving = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(workers.run)
        await until(lambda: len(said) >= 3)
        workers.stop()
    assert said[0].startswith("relay worker 1 could not be started (")
    assert said[0].endswith("); starting another in 0.01 s")


@pytest.mark.realtime
async def test_stop_terminates_workers_and_kill_ends_one_that_ignores_sigterm(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    stubborn = python(
        "import signal, time, pathlib, os\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"pathlib.Path({str(ready)!r}, str(os.getpid())).touch()\n"
        "time.sleep(60)\n"
    )
    ready.mkdir()
    workers = Workers(stubborn, (), 2, print, FAST)
    workers.serving = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(workers.run)
        await until(lambda: len(list(ready.iterdir())) == 2)
        pids = workers.pids
        workers.stop()
        with trio.move_on_after(0.3):
            await workers.wait_stopped()
        assert workers.pids == pids  # SIGTERM ignored: still running, and not restarted
        assert workers.kill() == 2
        with trio.fail_after(10):
            await workers.wait_stopped()
    assert workers.starts == 2


@pytest.mark.realtime
async def test_cancelling_the_supervisor_leaves_no_worker_behind(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    sleeper = python(
        f"import pathlib, os, time; pathlib.Path({str(ready)!r}, str(os.getpid())).touch(); "
        "time.sleep(60)"
    )
    workers = Workers(sleeper, (), 2, print, FAST)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(workers.run)
        await until(lambda: len(list(ready.iterdir())) == 2)
        pids = workers.pids
        nursery.cancel_scope.cancel()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.realtime
async def test_a_worker_inherits_the_listening_socket(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        accept_one = python(
            "import socket, sys\n"
            f"s = socket.socket(fileno={sock.fileno()})\n"
            "c, _ = s.accept(); c.sendall(b'hello from ' + str(s.getsockname()[1]).encode())\n"
            "import time; time.sleep(60)\n"
        )
        workers = Workers(accept_one, (sock.fileno(),), 1, print, FAST)
        workers.serving = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(workers.run)
            with trio.fail_after(20):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    assert await stream.receive_some(100) == f"hello from {port}".encode()
            workers.stop()


# -- serve() on given sockets and a given app -----------------------------------------------------


@pytest.mark.realtime
async def test_serve_listens_on_sockets_it_is_given_and_closes_them() -> None:
    config = Config(serving=ServingConfig(model=MODEL), engines=(engine_config("a"),))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            lambda task_status: serve(
                config,
                app=create_app(config),
                sockets=[sock],
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )
        )
        assert urls == [f"http://127.0.0.1:{port}"]
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{urls[0]}/health")).status_code == 200
        stop.set()
    assert sock.fileno() == -1  # closed


async def test_serve_refuses_transports_with_an_app_and_bind_with_sockets() -> None:
    config = Config(serving=ServingConfig(model=MODEL), engines=(engine_config("a"),))
    with pytest.raises(ValueError, match="transports"):
        await serve(config, app=create_app(config), transports={})
    with socket.socket() as sock, pytest.raises(ValueError, match="bind"):
        await serve(config, sockets=[sock], bind="127.0.0.1:0")


# -- the command line -----------------------------------------------------------------------------


def test_narwhal_controller_needs_a_controller_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[serving]\nmodel = "{MODEL}"\n[[engines]]\nname = "a"\nurl = "http://a:1"\n')
    assert main(["controller", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"narwhal controller: {path}: serving.controller_socket: required by narwhal controller "
        "(the path where the relay workers reach it)"
    )


def test_the_worker_command_refuses_a_descriptor_that_is_not_a_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[serving]\nmodel = "{MODEL}"\n[[engines]]\nname = "a"\nurl = "http://a:1"\n')
    with open(path, "rb") as not_a_socket:
        code = main(
            [
                "worker",
                "--config",
                str(path),
                "--controller",
                "x",
                "--fd",
                str(not_a_socket.fileno()),
            ]
        )
    assert code == 2
    assert capsys.readouterr().err.startswith("narwhal worker: --fd: not a socket: ")


def test_usage_lists_the_controller_but_not_the_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "controller --config FILE" in usage
    assert "  worker" not in usage


def narwhal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.realtime
def test_serve_with_workers_on_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bind = f"127.0.0.1:{taken.getsockname()[1]}"
        path.write_text(
            f'[serving]\nmodel = "{MODEL}"\nbind = "{bind}"\nworkers = 2\n'
            '[[engines]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
        )
        done = narwhal("serve", "--config", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"narwhal serve: cannot listen on {bind}: Address already in use"


@pytest.mark.realtime
@pytest.mark.parametrize("command", ["serve", "controller"])
def test_a_controller_socket_that_cannot_be_made_is_one_line_and_exit_2(
    tmp_path: Path, command: str
) -> None:
    path = tmp_path / "config.toml"
    missing = tmp_path / "no-such-folder" / "c.sock"
    path.write_text(
        f'[serving]\nmodel = "{MODEL}"\nbind = "127.0.0.1:0"\nworkers = 2\n'
        f'controller_socket = "{missing}"\n'
        '[[engines]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    done = narwhal(command, "--config", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"narwhal {command}: serving.controller_socket: cannot listen on {missing}: "
        "No such file or directory"
    )


def test_the_hypercorn_factory_builds_a_relay_worker_when_a_controller_socket_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    engines = '[[engines]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    path.write_text(f'[serving]\nmodel = "{MODEL}"\ncontroller_socket = "/tmp/c.sock"\n{engines}')
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert isinstance(get_router(asgi_app()), WorkerRouter)
    path.write_text(f'[serving]\nmodel = "{MODEL}"\n{engines}')
    assert isinstance(get_router(asgi_app()), Router)
