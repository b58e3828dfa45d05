"""The probe listener: ``/health`` and ``/ready`` that a saturated event loop cannot starve.

One Trio loop has no priorities: under a load that saturates it, an orchestrator's probe waits
in line with the completions, and a busy but healthy router can be declared dead. With
``serving.probe_bind`` set, :func:`probe_listener` opens a second listener served by the
standard library's :class:`~http.server.ThreadingHTTPServer` in its own daemon thread, which
never waits for the loop:

- the Trio side publishes an immutable snapshot of what ``/ready`` would answer (status and
  JSON, the same body as the main port's) every :data:`PUBLISH_S`
  (:meth:`ProbeListener.publish`); the thread serves the latest one (publishing replaces one
  reference, which the thread reads whole: no lock is needed);
- ``/ready`` answers the snapshot while it is fresh. Once it is older than
  :attr:`ProbeListener.stale_after_s` (``max(1 s, 4 * monitoring.max_loop_lag_s)``) the loop
  is not running and the router cannot be trusted to act on what it shows: 503 with the last
  snapshot's body, ``state: monitoring_degraded`` and ``reason: router_monitoring_degraded:
  event loop unresponsive for N s``;
- ``/health`` is liveness: 200 ``{"status": "ok"}`` while the process serves and its loop has
  run within :data:`WEDGED_AFTER_S`. A loop that has not run for that long is wedged, not
  busy (a saturated loop still turns every few milliseconds), and restarting the process is
  the cure: 503 ``{"status": "unresponsive", ...}``.

Every other path is the 404 envelope, every other method the 405 envelope; no page of the
standard library's ever reaches a client. Connections are given :data:`SOCKET_TIMEOUT_S` to send
their request.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import trio

from narwhal.config import Config, ConfigError
from narwhal.errors import FrameworkHTTPError, MethodNotAllowed, NarwhalError, RouteNotFound

if TYPE_CHECKING:
    from narwhal.router import Router

__all__ = [
    "PUBLISH_S",
    "SOCKET_TIMEOUT_S",
    "WEDGED_AFTER_S",
    "ProbeListener",
    "ReadySnapshot",
    "probe_listener",
    "ready_answer",
]

log = logging.getLogger(__name__)

PUBLISH_S = 0.05
"""How often the Trio side publishes a snapshot."""
WEDGED_AFTER_S = 30.0
"""A loop that has published nothing for this long is wedged: ``/health`` turns 503."""
SOCKET_TIMEOUT_S = 5.0
"""How long a probe connection may take to send its request."""


@attrs.frozen
class ReadySnapshot:
    """What ``/ready`` answered when the loop last published."""

    status: int
    body: dict[str, Any]
    published_at: float
    """``time.monotonic()`` at publication (the thread cannot read the Trio clock)."""


def _starting() -> dict[str, Any]:
    return {"state": "starting", "reason": "router_starting", "counters": {}, "engines": []}


class ProbeListener:
    """The listener and its thread; :func:`probe_listener` opens and closes one.

    Args:
        bind: ``HOST:PORT`` (port 0 picks a free port: see :attr:`url`).
        stale_after_s: a snapshot older than this makes ``/ready`` 503.
        wedged_after_s: a snapshot older than this makes ``/health`` 503.
    """

    def __init__(
        self, bind: str, *, stale_after_s: float, wedged_after_s: float = WEDGED_AFTER_S
    ) -> None:
        self.stale_after_s = stale_after_s
        self.wedged_after_s = wedged_after_s
        self._snapshot = ReadySnapshot(503, _starting(), time.monotonic())
        host, _, port = bind.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Server", (_Server,), {"address_family": family})
        self._server: _Server = server_class((host, int(port)), _Handler)
        self._server.listener = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": PUBLISH_S},
            name="narwhal-probes",
            daemon=True,
        )

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` as bound."""
        host, port = self._server.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{name}]" if ":" in name else name
        return f"http://{shown}:{port}"

    @property
    def snapshot(self) -> ReadySnapshot:
        """The latest snapshot."""
        return self._snapshot

    def publish_now(self, status: int, body: dict[str, Any]) -> None:
        """Publish what ``/ready`` answers now (from the Trio side; ``body`` is not changed
        after this)."""
        self._snapshot = ReadySnapshot(status, body, time.monotonic())

    async def publish(self, ready: Callable[[], tuple[int, dict[str, Any]]]) -> None:
        """Publish ``ready()`` every :data:`PUBLISH_S` until cancelled."""
        while True:
            self.publish_now(*ready())
            await trio.sleep(PUBLISH_S)

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        """The status and JSON body for ``GET path`` now (what the thread sends)."""
        snapshot = self._snapshot
        age = time.monotonic() - snapshot.published_at
        if path == "/health":
            if age > self.wedged_after_s:
                return 503, {"status": "unresponsive", "loop_unresponsive_s": round(age, 3)}
            return 200, {"status": "ok"}
        if path == "/ready":
            if age > self.stale_after_s:
                reason = f"router_monitoring_degraded: event loop unresponsive for {age:.1f} s"
                return 503, dict(snapshot.body, state="monitoring_degraded", reason=reason)
            return snapshot.status, snapshot.body
        error = RouteNotFound(f"No route GET {path} on the probe listener.")
        return error.http_status, error.envelope()

    def start(self) -> None:
        """Start serving in the thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close the socket (blocks up to :data:`PUBLISH_S`)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    listener: ProbeListener


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "narwhal-probes"
    sys_version = ""

    def do_GET(self) -> None:
        status, body = self.server.listener.answer(self.path.partition("?")[0])
        self._send(status, orjson.dumps(body))

    def do_HEAD(self) -> None:
        status, body = self.server.listener.answer(self.path.partition("?")[0])
        self._send(status, orjson.dumps(body), head=True)

    def _not_allowed(self) -> None:
        error = MethodNotAllowed(f"Method {self.command} is not allowed on the probe listener.")
        self._send(error.http_status, orjson.dumps(error.envelope()), allow="GET, HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # The standard library's own error page, replaced by the envelope (a malformed request
        # line, an unknown method).
        error: NarwhalError
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # a request line it could not read: answer 1.x
        if code == 501:
            code = 405
            error = MethodNotAllowed("Method not allowed on the probe listener.")
        else:
            error = FrameworkHTTPError(message or "Bad request.", status=code)
        self.close_connection = True
        self._send(code, orjson.dumps(error.envelope()))

    def _send(self, status: int, body: bytes, *, head: bool = False, allow: str = "") -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("cache-control", "no-store")
        if allow:
            self.send_header("allow", allow)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("probe %s: " + format, self.address_string(), *args)


def ready_answer(router: Router) -> tuple[int, dict[str, Any]]:
    """What the main port's ``/ready`` answers now: status and JSON body."""
    stats = router.statistics()
    return 200 if stats.ready else 503, stats.as_json()


def stale_after_s(config: Config) -> float:
    """How old a snapshot may be before the probe's ``/ready`` says the loop is unresponsive."""
    return max(1.0, 4 * config.monitoring.max_loop_lag_s)


@contextmanager
def probe_listener(config: Config) -> Iterator[ProbeListener | None]:
    """The probe listener of ``serving.probe_bind`` while the block runs (``None`` when unset);
    its thread is stopped and its socket closed on exit.

    Raises:
        ConfigError: the address cannot be bound (the message names ``serving.probe_bind``).
    """
    bind = config.serving.probe_bind
    if not bind:
        yield None
        return
    try:
        listener = ProbeListener(bind, stale_after_s=stale_after_s(config))
    except OSError as exc:
        # Named by its key: the command line's "cannot listen on" names serving.bind.
        raise ConfigError(
            f"serving.probe_bind: cannot listen on {bind}: {exc.strerror or exc}"
        ) from exc
    try:
        listener.start()
        log.info("Probes on %s (/health, /ready)", listener.url)
        yield listener
    finally:
        listener.close()
