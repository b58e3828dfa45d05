"""``narwhal top``: a live terminal view of a running router, from its event feed.

It connects to ``/admin/events`` (:mod:`narwhal.web.events`) with trio-websocket and redraws
after every summary (once a second): the router's state, the last second's admission figures,
the engines, the waves and the latest events. On a terminal the view is redrawn in place (ANSI);
otherwise every summary and every event is one plain line, for logs and pipes. ``--once`` prints
one view after the first summary and exits 0.

The token is ``--token``, else the environment variable :data:`TOKEN_ENV` (so that it need not
be on a command line that others can read). A refused token, an unreachable URL or a server that
is not a Narwhal router is one line on standard error and exit status 2; Ctrl-C is status 130.

The view (:class:`View`) is plain code fed message by message, tested without a connection.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, TextIO
from urllib.parse import urlsplit, urlunsplit

import attrs

if TYPE_CHECKING:
    from trio_websocket import WebSocketConnection

__all__ = ["TOKEN_ENV", "TopError", "View", "feed_url", "main", "open_feed"]

TOKEN_ENV: Final = "NARWHAL_ADMIN_TOKEN"
FEED_PATH: Final = "/admin/events"
EVENTS_SHOWN: Final = 8

CLEAR: Final = "\x1b[H\x1b[2J"  # cursor home, clear the screen
BOLD, DIM, RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"
STATE_COLOURS: Final = {
    "active": "\x1b[32m",
    "maintenance": "\x1b[33m",
    "monitoring_degraded": "\x1b[33m",
    "standby": "\x1b[33m",
    "fenced": "\x1b[31m",
    "draining": "\x1b[31m",
}

COUNTED: Final = (
    "offered",
    "completed",
    "refused",
    "rejected",
    "unavailable",
    "expired",
    "failed",
    "cancelled",
    "invalid_requests",
)


class TopError(Exception):
    """What ends ``narwhal top`` with one line and status 2."""


def feed_url(url: str) -> str:
    """The feed's WebSocket URL for a router's ``url``.

    ``http://HOST:PORT`` becomes ``ws://HOST:PORT/admin/events`` (``https`` gives ``wss``); a
    path is kept, and ``/admin/events`` added unless it ends with it (a router behind a path
    prefix); a ``ws://`` or ``wss://`` URL is used as given.

    Raises:
        TopError: not an ``http``, ``https``, ``ws`` or ``wss`` URL with a host.
    """
    parts = urlsplit(url.strip())
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    scheme = schemes.get(parts.scheme.lower())
    if scheme is None or not parts.hostname:
        raise TopError(f"--url must be the router's http:// or ws:// URL, got {url!r}")
    path = parts.path.rstrip("/")
    if parts.scheme.lower() in ("http", "https") and not path.endswith(FEED_PATH):
        path += FEED_PATH
    return urlunsplit((scheme, parts.netloc, path or FEED_PATH, parts.query, ""))


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _plain(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _clock(wall: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall)) if wall is not None else "--:--:--"


@attrs.define
class View:
    """What ``narwhal top`` shows, from the feed's messages (:meth:`feed`)."""

    hello: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    state: str = "unknown"
    reason: str | None = None
    engines: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    waves: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    events: deque[str] = attrs.field(factory=lambda: deque(maxlen=EVENTS_SHOWN))

    def feed(self, message: dict[str, Any]) -> str | None:
        """Take one message; what happened as one line (``None`` for a summary and a hello,
        which the view itself shows).

        Raises:
            TopError: the first message is not the feed's ``hello``.
        """
        kind = message.get("type")
        if self.hello is None and kind != "hello":
            raise TopError("the server's WebSocket did not greet as a Narwhal event feed")
        if kind == "hello":
            self.hello = message
            self.state, self.reason = message["state"], message.get("reason")
            self.engines = {engine["name"]: dict(engine) for engine in message["engines"]}
            self.waves = {wave["wave"]: dict(wave) for wave in message["waves"]}
            return None
        if kind == "summary":
            self.summary = message
            self.state, self.reason = message["state"], message.get("reason")
            for engine in message["engines"]:
                self.engines.setdefault(engine["name"], {}).update(engine)
            return None
        line: str | None = None
        if kind == "state":
            self.state, self.reason = message["to"], message.get("reason")
            because = f" ({message['reason']})" if message.get("reason") else ""
            line = f"state {message['from']} -> {message['to']}{because}"
        elif kind == "wave":
            self.waves[message["wave"]] = dict(message)
            line = f"wave {message['wave']} {message['event']} ({message['running']} running)"
        if line is not None:
            line = f"{_clock(message.get('time'))}  {line}"
            self.events.appendleft(line)
        return line

    # -- drawing ---------------------------------------------------------------------------------

    def _state(self, ansi: bool) -> str:
        text = self.state + (f" ({self.reason})" if self.reason else "")
        if not ansi:
            return text
        return f"{BOLD}{STATE_COLOURS.get(self.state, '')}{text}{RESET}"

    def line(self) -> str:
        """The last summary as one plain line (a pipe's view)."""
        summary = self.summary or {}
        counts = summary.get("counts", {})
        figures = " ".join(f"{name}={counts.get(name, 0)}" for name in COUNTED)
        ttft = summary.get("ttft", {})
        return (
            f"{_clock(summary.get('time'))} state={self.state}"
            f" reason={self.reason or '-'} {figures}"
            f" in_flight={summary.get('in_flight', 0)} queue={summary.get('queue_depth', 0)}"
            f" ttft_p50_s={_plain(ttft.get('p50_s'))} ttft_p99_s={_plain(ttft.get('p99_s'))}"
            f" dropped={summary.get('dropped', 0)}"
        )

    def lines(self, *, ansi: bool = False) -> list[str]:
        """The whole view, one string per line."""
        hello = self.hello or {}
        summary = self.summary or {}
        admission = hello.get("admission", {})
        bold, dim, reset = (BOLD, DIM, RESET) if ansi else ("", "", "")
        out = [
            f"{bold}narwhal {hello.get('version', '?')}{reset}  {hello.get('model', '?')}  "
            f"state {self._state(ansi)}",
            f"{dim}admission {admission.get('mode', '?')}, TTFT budget "
            f"{admission.get('ttft_budget_s', '?')} s, queue limit "
            f"{admission.get('queue_limit', '?')}{reset}",
            "",
        ]
        counts = summary.get("counts", {})
        if summary:
            out.append(
                f"{bold}last second{reset} ({_clock(summary.get('time'))}): "
                + "  ".join(f"{name} {counts.get(name, 0)}" for name in COUNTED)
            )
            ttft = summary.get("ttft", {})
            out.append(
                f"in flight {summary.get('in_flight', 0)}  queue {summary.get('queue_depth', 0)}"
                f"  retention {summary.get('retention_in_use', 0)}  TTFT p50 "
                f"{_seconds(ttft.get('p50_s'))} p99 {_seconds(ttft.get('p99_s'))} "
                f"({ttft.get('count', 0)} completed)"
                + (f"  {summary['dropped']} summaries lost" if summary.get("dropped") else "")
            )
        else:
            out.append("waiting for the first summary...")
        out += ["", f"{bold}engines{reset}"]
        width = max((len(name) for name in self.engines), default=6)
        for name, engine in self.engines.items():
            where = "eligible" if engine.get("eligible") else f"out: {engine.get('reason') or '?'}"
            out.append(
                f"  {name:<{width}}  wave {engine.get('wave', '?'):<4} prefill "
                f"{engine.get('prefill', 0)}/{engine.get('prefill_limit', '?')}  decode "
                f"{engine.get('decode', 0)}/{engine.get('decode_limit', '?')}  {where}"
            )
        started = [wave for wave in self.waves.values() if wave.get("in_maintenance")]
        if started:
            out += ["", f"{bold}maintenance{reset}"]
            for wave in started:
                done = "drained" if wave.get("drained") else f"{wave.get('running', 0)} running"
                out.append(f"  wave {wave['wave']}: {', '.join(wave['engines'])}: {done}")
        if self.events:
            out += ["", f"{bold}events{reset}", *(f"  {event}" for event in self.events)]
        return out


# -- the connection --------------------------------------------------------------------------------


@asynccontextmanager
async def open_feed(
    url: str, *, token: str | None = None, timeout_s: float = 10.0
) -> AsyncIterator[WebSocketConnection]:
    """A WebSocket client of the feed at ``url`` (``ws://`` or ``wss://``), open while the
    block runs.

    The TCP stream is opened and closed here, around trio-websocket's connection: trio-websocket
    0.12 leaves a client's socket open when the server closes first (as a draining router
    does), waiting for a TCP close it never closes the socket after.

    Raises:
        trio.TooSlowError: no connection or no handshake answer within ``timeout_s``.
        OSError: the host cannot be reached.
        trio_websocket.ConnectionRejected: the server answered the handshake with a refusal
            (inside an exception group, as trio-websocket's reader task raises it).
    """
    import trio
    from trio_websocket import wrap_client_stream

    parts = urlsplit(url)
    secure = parts.scheme == "wss"
    host = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
    with trio.fail_after(timeout_s):
        if secure:
            stream = await trio.open_ssl_over_tcp_stream(
                host, port, ssl_context=ssl.create_default_context()
            )
        else:
            stream = await trio.open_tcp_stream(host, port)
    async with stream:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(timeout_s):
                feed = await wrap_client_stream(
                    nursery, stream, parts.netloc, resource, extra_headers=headers
                )
            try:
                yield feed
            finally:
                with trio.move_on_after(1.0) as closing:
                    closing.shield = True
                    await feed.aclose()
                nursery.cancel_scope.cancel()


def _refusal(status: int, body: bytes | None) -> str:
    """Why the server refused the upgrade, from its envelope when it sent one."""
    try:
        error = json.loads(body or b"")["error"]
        message, code = str(error["message"]), str(error["code"])
    except (ValueError, KeyError, TypeError):
        return f"the server answered HTTP {status}: not a Narwhal event feed"
    return f"refused (HTTP {status} {code}): {message}"


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _why(error: BaseException, url: str, timeout_s: float) -> str:
    """What went wrong, as one line, from whatever the connection raised."""
    import trio
    from trio_websocket import ConnectionRejected, HandshakeError

    leaves = [leaf for leaf in _leaves(error) if not isinstance(leaf, trio.Cancelled)]
    leaf = leaves[0] if leaves else error
    if isinstance(leaf, TopError):
        return str(leaf)
    if isinstance(leaf, ConnectionRejected):
        return _refusal(leaf.status_code, leaf.body)
    if isinstance(leaf, trio.TooSlowError):
        return f"{url} did not answer the WebSocket handshake in {timeout_s:g} s"
    if isinstance(leaf, OSError):
        return f"cannot reach {url}: {leaf.strerror or leaf}"
    if isinstance(leaf, trio.BrokenResourceError | HandshakeError):
        return f"{url}: the connection was lost during the handshake"
    return f"{url} is not a Narwhal event feed ({type(leaf).__name__})"


async def _follow(
    feed: WebSocketConnection, view: View, *, once: bool, timeout_s: float, out: TextIO, ansi: bool
) -> str | None:
    """Show the feed's messages; why it ended (``None``: ``--once`` is done)."""
    import trio
    from trio_websocket import ConnectionClosed

    while True:
        try:
            with trio.move_on_after(timeout_s) as waiting:
                raw = await feed.get_message()
        except ConnectionClosed as exc:
            if view.hello is None:
                raise TopError("the server closed the WebSocket before greeting") from None
            said = exc.reason.reason if exc.reason is not None else None
            return "the router closed the feed" + (f": {said}" if said else "")
        if waiting.cancelled_caught:
            raise TopError(f"nothing came from the feed for {timeout_s:g} s")
        try:
            message = json.loads(raw)
            if not isinstance(message, dict):
                raise TypeError(type(message).__name__)
            happened = view.feed(message)
        except (ValueError, TypeError, KeyError) as exc:
            raise TopError("the server's WebSocket is not a Narwhal event feed") from exc
        if once:
            if view.summary is not None:
                print("\n".join(view.lines()), file=out, flush=True)
                return None
        elif ansi:
            if view.summary is not None:
                print(CLEAR + "\n".join(view.lines(ansi=True)), file=out, flush=True)
        elif happened is not None:
            print(happened, file=out, flush=True)
        elif message["type"] == "summary":
            print(view.line(), file=out, flush=True)


async def _watch(
    url: str, token: str | None, *, once: bool, timeout_s: float, out: TextIO, ansi: bool
) -> str | None:
    """Follow the feed at ``url``; why it ended (``None``: ``--once`` is done).

    Raises:
        TopError: it could not be followed (the one line that says why).
    """
    try:
        async with open_feed(url, token=token, timeout_s=timeout_s) as feed:
            return await _follow(feed, View(), once=once, timeout_s=timeout_s, out=out, ansi=ansi)
    except Exception as exc:  # groups included: one line, never a traceback
        raise TopError(_why(exc, url, timeout_s)) from None


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """``narwhal top``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="narwhal top",
        description="A live terminal view of a running router (its /admin/events feed).",
        epilog=f"The token may also come from the environment variable {TOKEN_ENV}.",
    )
    parser.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    parser.add_argument("--token", help=f"admin.token (default: ${TOKEN_ENV})")
    parser.add_argument(
        "--once", action="store_true", help="print one view after the first summary and exit"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the handshake, and for each message (default %(default)s)",
    )
    args = parser.parse_args(argv)
    stream = sys.stdout if out is None else out
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not args.timeout > 0:
        print("narwhal top: --timeout must be more than 0", file=sys.stderr)
        return 2
    try:
        url = feed_url(args.url)
        import trio

        ended = trio.run(
            lambda: _watch(
                url,
                token,
                once=args.once,
                timeout_s=args.timeout,
                out=stream,
                ansi=stream.isatty() and not args.once,
            )
        )
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:  # a Ctrl-C that met a task of the connection's
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in _leaves(group)):
            return 130
        raise
    except TopError as exc:
        print(f"narwhal top: {exc}", file=sys.stderr)
        return 2
    if ended is not None:
        print(f"narwhal top: {ended}", file=sys.stderr)
    return 0
