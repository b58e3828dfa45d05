"""Serving the router: the Trio shell around :mod:`narwhal.web.http11`, embedded or from the
command line, and its graceful shutdown.

The ASGI lifespan and the HTTP stream are Hypercorn's; the listeners, the connections
(:class:`~narwhal.web.http11.Connections`) and the shutdown are ours. A shutdown (the trigger
returns, or the first SIGINT, SIGTERM or SIGHUP) goes:

1. ``router.begin_drain()``: ``/ready`` is 503, new completion requests get 503
   ``router_draining`` (connections are still accepted, so clients read that rather than a
   refused connection); idle keep-alive connections close at once, the others after their
   next response, which says ``connection: close``;
2. running requests may finish until ``control.drain_deadline_s`` (a second signal ends this
   at once);
3. ``router.cut_streams()`` ends the rest in-band (an error event and ``data: [DONE]``), and
   their endings get up to :data:`CUT_GRACE_S` to be written;
4. the listeners close, idle connections close, the others get :data:`CLOSE_GRACE_S` to
   finish their last write and are then aborted; the lifespan shuts down, the engines' pools
   close.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from functools import partial

import attrs
import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.typing import AppWrapper
from hypercorn.utils import repr_socket_addr, wrap_app
from quart_trio import QuartTrio

from narwhal.config import Config
from narwhal.router import Router, RouterBase
from narwhal.web.app import create_app, get_router
from narwhal.web.http11 import Connections
from narwhal.web.probes import probe_listener, ready_answer

__all__ = [
    "CUT_GRACE_S",
    "IGNORED_SIGNALS",
    "STOP_SIGNALS",
    "Shutdown",
    "console",
    "hypercorn_config",
    "lifespan",
    "listening",
    "serve",
    "watch_signals",
]

log = logging.getLogger(__name__)

# After cut_streams(): how long the in-band endings may take to be written.
CUT_GRACE_S = 2.0
# After the last request ended: how long connections may take to finish their last write.
CLOSE_GRACE_S = 1.0


def hypercorn_config(bind: str) -> HypercornConfig:
    """Hypercorn settings for a streaming router (sockets, response headers, h11 limits).

    Timeouts are Narwhal's own (``serving.header_timeout_s``, ``serving.body_timeout_s``,
    ``control.drain_deadline_s``), not Hypercorn's.

    Args:
        bind: ``HOST:PORT``.
    """
    settings = HypercornConfig()
    settings.bind = [bind]
    settings.accesslog = None
    # Hypercorn logs through this logger as given: the application's logging setup decides.
    settings.errorlog = logging.getLogger("hypercorn.error")
    return settings


@attrs.define(eq=False)
class Shutdown:
    """A shutdown's two requests: begin draining, then (optionally) end the drain at once.

    Attributes:
        requested: set once a shutdown is asked for.
        hurried: set once the drain is to end at once.
    """

    requested: trio.Event = attrs.field(factory=trio.Event)
    hurried: trio.Event = attrs.field(factory=trio.Event)
    _drain_scope: trio.CancelScope | None = None

    def request(self) -> None:
        """Begin the graceful shutdown."""
        self.requested.set()

    def hurry(self) -> None:
        """End the drain now (running requests still end in-band)."""
        self.requested.set()
        self.hurried.set()
        if self._drain_scope is not None:
            self._drain_scope.cancel()

    async def drain(
        self,
        router: RouterBase,
        connections: Connections,
        *,
        deadline_s: float,
        say: Callable[[str], None],
    ) -> None:
        """Drain ``router`` and ``connections`` as the module describes; returns when it is
        time to abort what is left."""
        router.begin_drain()
        await connections.drain()
        running = router.in_flight()
        say(
            f"draining: {running} request{'' if running == 1 else 's'} still running; they "
            f"may finish for {deadline_s:g} s (interrupt again to end them now)"
            if running
            else "draining: no request running"
        )
        with trio.move_on_after(deadline_s) as self._drain_scope:
            if self.hurried.is_set():
                self._drain_scope.cancel()
            await router.wait_idle()
        self._drain_scope = None
        running = router.in_flight()
        if running:
            say(f"ending {running} running request{'' if running == 1 else 's'} now")
            router.cut_streams()
            with trio.move_on_after(CUT_GRACE_S):
                await router.wait_idle()


async def serve(
    config: Config,
    *,
    bind: str | None = None,
    app: QuartTrio | None = None,
    sockets: Sequence[socket.socket] | None = None,
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool = False,
    say: Callable[[str], None] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the router until cancelled, or until a graceful shutdown ends.

    Embeddable in any Trio program: ``urls = await nursery.start(serve, config)``. Cancelling
    it stops at once; a graceful shutdown drains first (module docstring).

    Args:
        config: the configuration.
        bind: ``HOST:PORT`` overriding ``serving.bind`` (port 0 picks a free port).
        app: an application already built (a relay worker's,
            :func:`narwhal.workers.worker.create_worker_app`) instead of
            ``create_app(config, transports=transports)``. The probe listener
            (``serving.probe_bind``) is only opened for an app whose router holds the books
            (a :class:`~narwhal.router.Router`): a relay worker's controller answers probes.
        sockets: listening sockets already bound (a relay worker's, inherited from ``narwhal
            serve``) instead of binding ``bind`` or ``serving.bind``; ``serve`` closes them
            when it ends.
        transports: optional in-process transports by engine name (not with ``app``).
        shutdown_trigger: awaitable that begins a graceful shutdown when it returns.
        handle_signals: SIGINT, SIGTERM and SIGHUP begin a graceful shutdown (the first) and
            end its drain at once (the second), reporting on standard error (the command line);
            SIGUSR1 and SIGUSR2 are said and ignored.
        say: where the shutdown's progress lines go (default: standard error with
            ``handle_signals``, else the log).
        task_status: receives the list of bound URLs once listening.

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``app`` with ``transports``, or ``sockets`` with ``bind``.
    """
    if app is not None and transports is not None:
        raise ValueError("serve(): transports are for the app serve builds, not for app=")
    if sockets is not None and bind is not None:
        raise ValueError("serve(): bind is for the sockets serve binds, not for sockets=")
    if app is None:
        app = create_app(config, transports=transports)
    router = get_router(app)
    shutdown = Shutdown()
    if say is None:
        say = console if handle_signals else log.info
    listen: str | Sequence[socket.socket] = (
        sockets if sockets is not None else bind or config.serving.bind
    )
    try:
        # serving.probe_bind: /health and /ready from their own thread (narwhal.web.probes).
        with probe_listener(config) if isinstance(router, Router) else nullcontext() as probes:
            async with trio.open_nursery() as watchers:
                if probes is not None and isinstance(router, Router):
                    watchers.start_soon(probes.publish, partial(ready_answer, router))
                if handle_signals:
                    await watchers.start(watch_signals, shutdown, say)
                if shutdown_trigger is not None:
                    watchers.start_soon(_trigger, shutdown_trigger, shutdown)
                await _serve(app, config, listen, shutdown, say, task_status)
                watchers.cancel_scope.cancel()
    finally:
        for sock in sockets or ():
            sock.close()  # given to serve, which may have ended before listening on them
        # A cancelled serve skips the lifespan shutdown: close the engine connections here
        # too (closing twice is harmless).
        with trio.CancelScope(shield=True):
            await router.aclose()


async def _serve(
    app: QuartTrio,
    config: Config,
    listen: str | Sequence[socket.socket],
    shutdown: Shutdown,
    say: Callable[[str], None],
    task_status: trio.TaskStatus[list[str]],
) -> None:
    settings = hypercorn_config(listen if isinstance(listen, str) else config.serving.bind)
    # Bound before the router starts: a port in use is the one line that says so, before any
    # engine is polled (or reported unreachable).
    sockets = (
        settings.create_sockets().insecure_sockets if isinstance(listen, str) else list(listen)
    )
    try:
        await _serve_on(app, config, sockets, settings, shutdown, say, task_status)
    finally:
        for sock in sockets:
            sock.close()  # closing twice is harmless


async def _serve_on(
    app: QuartTrio,
    config: Config,
    sockets: Sequence[socket.socket],
    settings: HypercornConfig,
    shutdown: Shutdown,
    say: Callable[[str], None],
    task_status: trio.TaskStatus[list[str]],
) -> None:
    router = get_router(app)
    async with lifespan(app, settings) as asgi:
        connections = Connections(
            asgi,
            settings,
            header_timeout_s=config.serving.header_timeout_s,
            on_header_timeout=lambda: router.count_client_timeout("headers"),
        )
        async with trio.open_nursery() as handlers:
            try:
                async with listening(sockets, settings.backlog) as (listeners, urls):
                    async with trio.open_nursery() as accepting:
                        accepting.start_soon(
                            partial(
                                trio.serve_listeners,
                                connections.handle,
                                listeners,
                                handler_nursery=handlers,
                            )
                        )
                        for url in urls:
                            log.info("Running on %s", url)
                        task_status.started(urls)
                        await shutdown.requested.wait()
                        # Still accepting while draining: a new request is answered 503
                        # router_draining (and /ready 503) rather than refused a connection.
                        await shutdown.drain(
                            router, connections, deadline_s=config.control.drain_deadline_s, say=say
                        )
                        accepting.cancel_scope.cancel()
                connections.close_idle()
                with trio.move_on_after(CLOSE_GRACE_S):
                    await connections.wait_closed()
            finally:
                connections.abort()
                handlers.cancel_scope.cancel()


@asynccontextmanager
async def lifespan(app: QuartTrio, settings: HypercornConfig) -> AsyncIterator[AppWrapper]:
    """``app`` started (its ASGI lifespan: the router's engines, polls, lease) while the block
    runs, and shut down at its end; yields the app wrapped for Hypercorn's protocol code.

    Raises:
        hypercorn.utils.LifespanFailureError: the app's startup or shutdown failed.
    """
    asgi = wrap_app(app, settings.wsgi_max_body_size, "asgi")
    async with trio.open_nursery() as lifespan_nursery:
        running = Lifespan(asgi, settings, {})
        await lifespan_nursery.start(running.handle_lifespan)
        await running.wait_for_startup()
        yield asgi
        await running.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


@asynccontextmanager
async def listening(
    sockets: Sequence[socket.socket], backlog: int
) -> AsyncIterator[tuple[list[trio.SocketListener], list[str]]]:
    """Trio listeners on bound ``sockets`` and their URLs; every socket is closed on exit."""
    listeners: list[trio.SocketListener] = []
    urls: list[str] = []
    try:
        for sock in sockets:
            sock.listen(backlog)
            urls.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        yield listeners, urls
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
        for sock in sockets:
            sock.close()  # any not yet wrapped; closing twice is harmless


async def _trigger(trigger: Callable[[], Awaitable[None]], shutdown: Shutdown) -> None:
    await trigger()
    shutdown.request()


def _signals(*names: str) -> tuple[signal.Signals, ...]:
    """The signals of ``names`` that this platform has."""
    return tuple(getattr(signal, name) for name in names if hasattr(signal, name))


STOP_SIGNALS = _signals("SIGINT", "SIGTERM", "SIGHUP")
"""The signals that stop a listening command gracefully. SIGHUP is one: the terminal or a
supervisor hung up. (Python's default for SIGHUP ends the process at once, streams cut.)"""
IGNORED_SIGNALS = _signals("SIGUSR1", "SIGUSR2")
"""Signals that are said and ignored (Python's default for them, too, ends the process)."""


async def watch_signals(
    shutdown: Shutdown,
    say: Callable[[str], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGINT, SIGTERM or SIGHUP (:data:`STOP_SIGNALS`): the first begins the shutdown, the
    next ends the drain at once. SIGUSR1 and SIGUSR2 are said and ignored."""
    with trio.open_signal_receiver(*STOP_SIGNALS, *IGNORED_SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum in IGNORED_SIGNALS:
                say(f"{name}: ignored")
            elif not shutdown.requested.is_set():
                say(f"{name}: shutting down")
                shutdown.request()
            elif not shutdown.hurried.is_set():
                say(f"{name} again: ending the drain now")
                shutdown.hurry()


def console(message: str) -> None:
    """``message`` on standard error, as the command line reports (``narwhal: ...``)."""
    print(f"narwhal: {message}", file=sys.stderr, flush=True)
