"""Running the router under Hypercorn's Trio worker, embedded or from the command line."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Mapping

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from narwhal.config import Config
from narwhal.web.app import create_app, get_router

__all__ = ["hypercorn_config", "serve"]


def hypercorn_config(bind: str, *, drain_deadline_s: float = 30.0) -> HypercornConfig:
    """Hypercorn settings for a streaming router.

    Args:
        bind: ``HOST:PORT``.
        drain_deadline_s: on shutdown, how long running streams may finish.
    """
    settings = HypercornConfig()
    settings.bind = [bind]
    settings.accesslog = None
    # Hypercorn logs through this logger as given: the application's logging setup decides.
    settings.errorlog = logging.getLogger("hypercorn.error")
    settings.keep_alive_timeout = 75
    settings.graceful_timeout = drain_deadline_s
    return settings


async def serve(
    config: Config,
    *,
    bind: str | None = None,
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the router until cancelled (or ``shutdown_trigger`` returns).

    Embeddable in any Trio program: ``urls = await nursery.start(serve, config)``.

    Args:
        config: the configuration.
        bind: ``HOST:PORT`` overriding ``serving.bind`` (port 0 picks a free port).
        transports: optional in-process transports by engine name.
        shutdown_trigger: awaitable that ends serving gracefully when it returns.
        task_status: receives the list of bound URLs once listening.
    """
    app = create_app(config, transports=transports)
    try:
        await hypercorn_serve(
            app,
            hypercorn_config(
                bind or config.serving.bind, drain_deadline_s=config.control.drain_deadline_s
            ),
            shutdown_trigger=shutdown_trigger,
            task_status=task_status,
        )
    finally:
        # Hypercorn skips the lifespan shutdown when it is cancelled: close the engine
        # connections here too (closing twice is harmless).
        with trio.CancelScope(shield=True):
            await get_router(app).aclose()


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM (the command line's shutdown trigger)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
