"""Relay workers as processes: what ``narwhal serve`` runs when ``serving.workers`` is over 1,
and ``narwhal controller`` (the controller alone, for Hypercorn's own ``-w``).

:func:`serve_workers` runs in the ``narwhal serve`` process. It

1. binds the listening socket(s) of ``serving.bind`` once, here, so that every worker accepts
   on the same socket (the kernel hands each connection to one of them);
2. runs the admission controller here: the full :class:`~narwhal.router.Router` of
   ``create_app(config)`` with its lifespan (engines, polls, lease), the probe listener of
   ``serving.probe_bind``, and :class:`~narwhal.workers.controller.Controller` on a Unix socket
   (``serving.controller_socket``, else ``controller.sock`` in a private 0700 folder);
3. starts ``serving.workers`` processes, ``python -m narwhal worker``, each given the listening
   socket as an inherited file descriptor and the configuration as a TOML file in that private
   folder (mode 0600), each in a process group of its own (a terminal's Ctrl-C reaches only
   this process, which tells the workers in order);
4. reports the URL(s) once every worker is connected to the controller;
5. restarts a worker that exits while serving (after :attr:`Backoff.first_s`, doubling to
   :attr:`Backoff.max_s`; a worker that ran :attr:`Backoff.steady_s` starts the ladder again).
   A worker that exits before every worker has connected fails the start instead
   (:class:`WorkerStartError`): the cause is not one a restart cures.

The shutdown (the first SIGINT, SIGTERM or SIGHUP with ``handle_signals``, or cancellation of the
shutdown trigger's wait) goes: the controller begins draining (new requests, whichever worker
reads them, get 503 ``router_draining``); every worker gets SIGTERM and drains as ``narwhal
serve`` does (:mod:`narwhal.server`); they get ``control.drain_deadline_s`` plus
:data:`EXIT_GRACE_S` to exit, and are then killed (the controller accounts for what a killed
worker held); then the controller stops. A second signal is passed on to the workers, which
end their drain at once: as SIGINT, a signal other than the SIGTERM that began it, since two
copies of one signal that reach a worker before it has read the first are read as one (Trio's
signal receiver, and the kernel, keep one pending copy of each signal), and a worker slow to
read them would drain to the deadline instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path

import attrs
import trio
from hypercorn.utils import repr_socket_addr

from narwhal.config import Config, ConfigError, config_to_toml
from narwhal.router import Router
from narwhal.server import (
    CLOSE_GRACE_S,
    CUT_GRACE_S,
    Shutdown,
    console,
    hypercorn_config,
    lifespan,
    watch_signals,
)
from narwhal.web.app import create_app, get_router
from narwhal.web.probes import probe_listener, ready_answer
from narwhal.workers.controller import Controller, open_controller_listener

__all__ = [
    "EXIT_GRACE_S",
    "Backoff",
    "WorkerStartError",
    "Workers",
    "run_controller",
    "serve_workers",
    "worker_argv",
    "worker_config",
]

log = logging.getLogger(__name__)

EXIT_GRACE_S = CUT_GRACE_S + CLOSE_GRACE_S + 2.0
"""After the drain deadline: how long workers may take to end their streams, close their
connections and exit before they are killed."""

Say = Callable[[str], None]


class WorkerStartError(RuntimeError):
    """A relay worker exited before every worker had connected to the controller."""


@attrs.define
class Backoff:
    """How long to wait before starting a worker again: :attr:`first_s`, doubling at each
    exit up to :attr:`max_s`; a worker that ran at least :attr:`steady_s` starts again from
    :attr:`first_s` (pure: the caller measures how long it ran)."""

    first_s: float = 0.5
    max_s: float = 5.0
    steady_s: float = 10.0
    _next_s: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._next_s = self.first_s

    def delay(self, ran_s: float) -> float:
        """The wait before the next start, after a worker that ran ``ran_s`` exited."""
        if ran_s >= self.steady_s:
            self._next_s = self.first_s
        delay = self._next_s
        self._next_s = min(self.max_s, delay * 2)
        return delay


def worker_config(config: Config, socket_path: str) -> Config:
    """The configuration a relay worker runs with: ``config``, its controller at
    ``socket_path``, and no probe listener (the controller's answers for the pool)."""
    serving = attrs.evolve(config.serving, controller_socket=socket_path, probe_bind="")
    return attrs.evolve(config, serving=serving)


def worker_argv(
    config_path: str, socket_path: str, fds: Sequence[int], *, verbose: bool = False
) -> list[str]:
    """The command line of one relay worker (the hidden ``narwhal worker`` command)."""
    argv = [sys.executable, "-m", "narwhal", "worker", "--config", config_path]
    argv += ["--controller", socket_path]
    for fd in fds:
        argv += ["--fd", str(fd)]
    if verbose:
        argv.append("-v")
    return argv


@attrs.define(eq=False)
class Workers:
    """The relay worker processes: started, watched, restarted, stopped.

    Args:
        argv: one worker's command line.
        fds: the file descriptors each worker inherits (the listening sockets).
        count: how many workers run at once.
        say: where exits and restarts are reported.
        backoff: the restart ladder (one per worker slot is made from it).
    """

    argv: Sequence[str]
    fds: tuple[int, ...]
    count: int
    say: Say
    backoff: Backoff = attrs.Factory(Backoff)
    #: Set once every worker has connected: an exit from then on is restarted.
    serving: bool = False
    #: Worker starts (restarts included), for tests and the log.
    starts: int = 0
    _running: dict[int, trio.Process] = attrs.Factory(dict)
    _stopping: trio.Event = attrs.Factory(trio.Event)
    _stopped: trio.Event = attrs.Factory(trio.Event)

    @property
    def pids(self) -> list[int]:
        """The process IDs of the workers running now, by slot."""
        return [self._running[slot].pid for slot in sorted(self._running)]

    async def run(self) -> None:
        """Keep :attr:`count` workers running until :meth:`stop`; returns once every worker
        has exited after it.

        Raises:
            WorkerStartError: a worker exited before :attr:`serving` was set.
        """
        async with trio.open_nursery() as nursery:
            for slot in range(self.count):
                nursery.start_soon(self._keep, slot)

    def stop(self) -> None:
        """Stop restarting, and send SIGTERM to every worker (they drain, then exit)."""
        self._stopping.set()
        self.signal(signal.SIGTERM)
        self._check_stopped()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every worker running now."""
        for process in self._running.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    def kill(self) -> int:
        """SIGKILL every worker still running; returns how many there were."""
        left = [process for process in self._running.values() if process.returncode is None]
        for process in left:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        return len(left)

    async def wait_stopped(self) -> None:
        """Return once :meth:`stop` was called and no worker runs."""
        await self._stopped.wait()

    def _check_stopped(self) -> None:
        if self._stopping.is_set() and not self._running:
            self._stopped.set()

    async def _keep(self, slot: int) -> None:
        backoff = attrs.evolve(self.backoff)
        while not self._stopping.is_set():
            began = trio.current_time()
            try:
                process = await trio.lowlevel.open_process(
                    list(self.argv),
                    pass_fds=self.fds,
                    stdin=subprocess.DEVNULL,
                    process_group=0,
                )
            except OSError as exc:  # out of processes or descriptors: as if it had exited
                if not self.serving:
                    raise WorkerStartError(f"cannot start relay worker {slot + 1}: {exc}") from exc
                await self._pause(slot, backoff, began, f"could not be started ({exc})")
                continue
            self.starts += 1
            self._running[slot] = process
            log.info("relay worker %d started (pid %d)", slot + 1, process.pid)
            if self._stopping.is_set():  # stopped while it was being started
                process.send_signal(signal.SIGTERM)
            try:
                code = await process.wait()
            finally:
                if process.returncode is None:  # cancelled: no worker outlives its supervisor
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    with trio.CancelScope(shield=True):
                        await process.wait()
                del self._running[slot]
                self._check_stopped()
            if self._stopping.is_set():
                return
            if not self.serving:
                raise WorkerStartError(f"relay worker {slot + 1} {_ended(code)} while starting")
            await self._pause(slot, backoff, began, f"(pid {process.pid}) {_ended(code)}")

    async def _pause(self, slot: int, backoff: Backoff, began: float, what: str) -> None:
        """Say what became of the worker in ``slot``, then wait its turn on ``backoff``
        (or until :meth:`stop`)."""
        delay = backoff.delay(trio.current_time() - began)
        self.say(f"relay worker {slot + 1} {what}; starting another in {delay:g} s")
        with trio.move_on_after(delay):
            await self._stopping.wait()


def _ended(code: int) -> str:
    """How a process ended, from its return code (negative: the signal that ended it)."""
    if code < 0:
        try:
            return f"was ended by {signal.Signals(-code).name}"
        except ValueError:
            return f"was ended by signal {-code}"
    return f"exited with status {code}"


@contextlib.asynccontextmanager
async def _controlling(
    config: Config, socket_path: str, shutdown: Shutdown, say: Say, *, handle_signals: bool
) -> AsyncIterator[tuple[Router, Controller]]:
    """The admission controller running while the block runs: its app's lifespan, the probe
    listener, the signal watcher and :class:`Controller` on ``socket_path``."""
    app = create_app(config)
    router = get_router(app)
    if not isinstance(router, Router):  # pragma: no cover - create_app makes a Router
        raise TypeError("the controller needs a Router")
    try:
        with probe_listener(config) as probes:
            async with trio.open_nursery() as nursery:
                if probes is not None:
                    nursery.start_soon(probes.publish, partial(ready_answer, router))
                if handle_signals:
                    await nursery.start(watch_signals, shutdown, say)
                # The socket first: a path that cannot be listened on fails before the engines
                # are polled.
                listener = await _listen(config, socket_path)
                try:
                    async with lifespan(app, hypercorn_config(config.serving.bind)):
                        controller = Controller(router, app)
                        async with trio.open_nursery() as controlling:
                            await controlling.start(controller.run, listener)
                            yield router, controller
                            controlling.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        await listener.aclose()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await router.aclose()


async def serve_workers(
    config: Config,
    *,
    bind: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool = False,
    verbose: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve with ``serving.workers`` relay worker processes under one admission controller in
    this process, until a graceful shutdown ends (module docstring).

    Args:
        config: the configuration (``serving.workers`` workers are started).
        bind: ``HOST:PORT`` overriding ``serving.bind``.
        shutdown_trigger: awaitable that begins a graceful shutdown when it returns.
        handle_signals: SIGINT, SIGTERM and SIGHUP begin a graceful shutdown (the first) and
            end the workers' drain at once (the second), reporting on standard error.
        verbose: the workers log engine joins and errors too (``narwhal serve -v``).
        task_status: receives the list of bound URLs once every worker is connected.

    Raises:
        OSError: the address cannot be bound.
        ConfigError: the probe listener or the controller's socket cannot be made.
        WorkerStartError: a worker exited before every worker had connected.
    """
    settings = hypercorn_config(bind or config.serving.bind)
    sockets = settings.create_sockets().insecure_sockets
    shutdown = Shutdown()
    say = console if handle_signals else log.info
    with contextlib.ExitStack() as stack:
        for sock in sockets:
            stack.callback(sock.close)
        urls = []
        for sock in sockets:
            sock.listen(settings.backlog)
            urls.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
        private = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="narwhal-")))
        socket_path = config.serving.controller_socket or str(private / "controller.sock")
        if config.serving.controller_socket:
            stack.callback(_remove, socket_path)
        config_path = private / "worker.toml"
        _write_private(config_path, config_to_toml(worker_config(config, socket_path)))
        workers = Workers(
            worker_argv(
                str(config_path), socket_path, [sock.fileno() for sock in sockets], verbose=verbose
            ),
            tuple(sock.fileno() for sock in sockets),
            config.serving.workers,
            say,
        )
        async with _controlling(
            config, socket_path, shutdown, say, handle_signals=handle_signals
        ) as (router, controller):
            async with trio.open_nursery() as nursery:
                if shutdown_trigger is not None:
                    nursery.start_soon(_trigger, shutdown_trigger, shutdown)
                nursery.start_soon(workers.run)
                await controller.wait_connected(workers.count)
                workers.serving = True
                for url in urls:
                    log.info("Running on %s with %d relay workers", url, workers.count)
                task_status.started(urls)
                await shutdown.requested.wait()
                await _stop_workers(router, workers, shutdown, config, say)
                nursery.cancel_scope.cancel()


async def _stop_workers(
    router: Router, workers: Workers, shutdown: Shutdown, config: Config, say: Say
) -> None:
    router.begin_drain()
    deadline_s = config.control.drain_deadline_s
    say(
        f"draining: {workers.count} relay workers finish their running requests for up to "
        f"{deadline_s:g} s (interrupt again to end them now)"
    )
    workers.stop()
    with trio.move_on_after(deadline_s + EXIT_GRACE_S):
        async with trio.open_nursery() as waiting:

            async def hurry() -> None:
                await shutdown.hurried.wait()
                # A second signal: the workers end their drain. Not SIGTERM again, which a
                # worker that has not yet read the first would read as one (module doc).
                workers.signal(signal.SIGINT)

            waiting.start_soon(hurry)
            await workers.wait_stopped()
            waiting.cancel_scope.cancel()
    killed = workers.kill()
    if killed:
        say(f"{killed} relay worker{'' if killed == 1 else 's'} still running: killed")
    with trio.move_on_after(CLOSE_GRACE_S + 5):
        await workers.wait_stopped()


async def run_controller(
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool = False,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run only the admission controller, on ``serving.controller_socket``, for relay workers
    started elsewhere (``hypercorn -w N 'narwhal.asgi:app()'``), until a graceful shutdown ends.

    The shutdown: the controller begins draining, then waits until every worker has left (the
    workers get their own SIGTERM from whoever started them) for up to
    ``control.drain_deadline_s`` plus :data:`EXIT_GRACE_S`; a second signal ends the wait.

    Args:
        config: the configuration; ``serving.controller_socket`` must be set.
        shutdown_trigger: awaitable that begins a graceful shutdown when it returns.
        handle_signals: SIGINT, SIGTERM and SIGHUP begin a graceful shutdown (the first) and
            end it at once (the second), reporting on standard error.
        task_status: receives the socket path once the controller listens.

    Raises:
        ConfigError: ``serving.controller_socket`` is empty or cannot be listened on, or the
            probe listener cannot be bound.
    """
    socket_path = config.serving.controller_socket
    if not socket_path:
        raise ConfigError("serving.controller_socket: required for narwhal controller")
    shutdown = Shutdown()
    say = console if handle_signals else log.info
    try:
        async with _controlling(
            config, socket_path, shutdown, say, handle_signals=handle_signals
        ) as (router, controller):
            async with trio.open_nursery() as nursery:
                if shutdown_trigger is not None:
                    nursery.start_soon(_trigger, shutdown_trigger, shutdown)
                log.info("Controller on %s", socket_path)
                task_status.started(socket_path)
                await shutdown.requested.wait()
                router.begin_drain()
                connected = controller.connected
                say(
                    f"draining: waiting for {connected} relay worker"
                    f"{'' if connected == 1 else 's'} to leave (interrupt again to stop now)"
                )
                deadline_s = config.control.drain_deadline_s + EXIT_GRACE_S
                with trio.move_on_after(deadline_s) as waiting:
                    nursery.start_soon(_cancel_on, shutdown.hurried, waiting)
                    await controller.wait_left()
                nursery.cancel_scope.cancel()
    finally:
        _remove(socket_path)


async def _listen(config: Config, socket_path: str) -> trio.SocketListener:
    """The controller's listener, or a :class:`ConfigError` that names the key to change."""
    try:
        return await open_controller_listener(socket_path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if config.serving.controller_socket:
            raise ConfigError(
                f"serving.controller_socket: cannot listen on {socket_path}: {reason}"
            ) from exc
        raise ConfigError(
            f"cannot make the controller's socket {socket_path}: {reason} (set "
            "serving.controller_socket to a path that can be)"
        ) from exc


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _trigger(trigger: Callable[[], Awaitable[None]], shutdown: Shutdown) -> None:
    await trigger()
    shutdown.request()


def _write_private(path: Path, text: str) -> None:
    """``text`` to a new file only this user can read (it may name API key variables)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w", encoding="utf-8") as file:
        file.write(text)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if Path(path).is_socket():
            os.unlink(path)
