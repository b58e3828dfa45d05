"""The chaos suite's plumbing: what every check asserts after an attack, and how it attacks.

Every chaos test ends with the same questions, asked here once:

* :func:`check_answer`: was the answer acceptable? Never a 500; every non-2xx body is the
  OpenAI envelope (all four keys, a string ``code``) whose message carries no exception repr or
  internal address; a stream ends with ``data: [DONE]``, an in-band error being an envelope too.
* :class:`Tally`: the conservation law counted from the client's side, independently of the
  router's counters: requests sent on completion routes, the ones still live (sent and not yet
  ended), and the terminal class each answer implies.
* :func:`settle_and_check`: once the client side is idle, the router's own books balance
  (``offered = sum(terminals) + in_flight``, ``in_flight`` 0) and agree with the tally, and every
  gauge (retention in use, queue depth, engine prefill and decode occupancy, ``/metrics``) is back
  to zero.

Fleets: :func:`open_fleet` is a router before in-process simulated engines (virtual time under
``autojump_clock``); :func:`serve_router` the same router served by Hypercorn on a free loopback
port (real clock).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import httpx
import trio

from narwhal.bench.inprocess import ASGIStreamTransport
from narwhal.config import Config, EngineConfig, MonitoringConfig, ServingConfig, UpstreamConfig
from narwhal.router import Router
from narwhal.scheduling.profiles import get_profile
from narwhal.server import serve
from narwhal.sim.engine import SimEngine
from narwhal.sim.timing import StepTiming
from narwhal.sim.transport import SimTransport
from narwhal.web.app import create_app, get_router
from tests.conftest import MODEL, Fleet, engine_config
from tests.support import Pluggable, sse_payloads, wait_ready

ENVELOPE_KEYS = frozenset({"message", "type", "param", "code"})
# What a client must never read in an error message: exception reprs, tracebacks, addresses.
LEAKS = ("Error(", "Exception", "Traceback", "127.0.0.1:", "localhost:", "Cancelled")
_REPR = re.compile(r"\b[A-Z][A-Za-z]+\((['\"]|\))")  # ReadTimeout('...'), Foo()

# The terminal class a final status implies (SPEC: Errors, Admission counters).
CLASS_OF_STATUS = {
    200: "completed",
    400: "invalid_requests",
    404: "invalid_requests",
    413: "invalid_requests",
    422: "invalid_requests",
    502: "failed",
    503: "unavailable",
    504: "expired",
}
CLASS_OF_CODE = {
    "http_retention_full": "rejected",
    "admission_queue_full": "rejected",
    "ttft_budget_exceeded": "refused",
    "prompt_exceeds_ttft_budget": "refused",
    "request_deadline_expired": "expired",
    "admission_wait_expired": "expired",
    # Shutdown: refused while draining, or cut in-band at the drain deadline (SPEC: unavailable,
    # reason shutdown).
    "router_draining": "unavailable",
    "shutdown": "unavailable",
    "router_shutdown": "unavailable",
}


# Figures for the closing note, by check class (see conftest.py): cases, statuses, latency.
FIGURES: dict[str, Any] = {}


def count_case(kind: str, status: int | str, *, latency_s: float | None = None) -> None:
    """Record one case of ``kind`` and what it came to."""
    entry = FIGURES.setdefault(kind, {"cases": 0, "outcomes": {}, "worst_latency_s": 0.0})
    entry["cases"] += 1
    entry["outcomes"][str(status)] = entry["outcomes"].get(str(status), 0) + 1
    if latency_s is not None:
        entry["worst_latency_s"] = round(max(entry["worst_latency_s"], latency_s), 4)


class ChaosFailure(AssertionError):
    """An answer the router must never give."""


# Where leak findings go instead of raising, while a test collects them (see ``collect_leaks``).
_LEAK_SINK: list[list[str]] = []


@contextlib.contextmanager
def collect_leaks() -> Any:
    """Within the block, a message that leaks is recorded (not raised): the test goes on to its
    structural checks, then asserts the list is empty (issue item 10 apart from the rest)."""
    found: list[str] = []
    _LEAK_SINK.append(found)
    try:
        yield found
    finally:
        _LEAK_SINK.remove(found)


def _leak(text: str) -> None:
    if _LEAK_SINK:
        _LEAK_SINK[-1].append(text)
        return
    raise ChaosFailure(text)


def check_error(error: Any, where: str) -> dict[str, Any]:
    """``error`` is the inside of an OpenAI envelope with a clean message."""
    if not isinstance(error, dict) or set(error) != ENVELOPE_KEYS:
        raise ChaosFailure(f"{where}: not the four envelope keys: {error!r}")
    if not isinstance(error["code"], str) or not error["code"]:
        raise ChaosFailure(f"{where}: code is not a string: {error!r}")
    message = error["message"]
    if not isinstance(message, str) or not message:
        raise ChaosFailure(f"{where}: message is not a non-empty string: {error!r}")
    for leak in LEAKS:
        if leak in message:
            _leak(f"{where}: message leaks {leak!r}: {message!r}")
            return error
    if found := _REPR.search(message):
        _leak(f"{where}: message leaks a repr {found.group()!r}: {message!r}")
    return error


def check_envelope(content: bytes, where: str) -> dict[str, Any]:
    """``content`` is exactly ``{"error": {...}}`` with a clean message; returns the inside."""
    try:
        body = json.loads(content)
    except ValueError:
        raise ChaosFailure(f"{where}: error body is not JSON: {content[:300]!r}") from None
    if not isinstance(body, dict) or set(body) != {"error"}:
        raise ChaosFailure(f"{where}: error body is not the envelope: {content[:300]!r}")
    return check_error(body["error"], where)


@attrs.frozen
class Answer:
    """What one request came to, as the client saw it."""

    status: int
    terminal: str  # the terminal class the answer implies
    code: str | None = None  # the error code (in-band or not)


def check_answer(
    status: int, content: bytes, *, streamed: bool | None = None, where: str = ""
) -> Answer:
    """Judge one complete answer; raises :class:`ChaosFailure` for anything unacceptable.

    ``streamed`` (the request asked for a stream) decides how a 200 is read; ``None`` guesses
    from the body.
    """
    where = where or f"status {status}"
    if status >= 500 and status not in (502, 503, 504):
        raise ChaosFailure(f"{where}: status {status}: {content[:500]!r}")
    if status >= 300:
        error = check_envelope(content, where)
        code = error["code"]
        terminal = CLASS_OF_CODE.get(code) or CLASS_OF_STATUS.get(status)
        if terminal is None:
            terminal = "invalid_requests" if 400 <= status < 500 else "failed"
        return Answer(status, terminal, code)
    if streamed is None:
        streamed = content.startswith(b"data:")
    if not streamed:
        try:
            body = json.loads(content)
        except ValueError:
            raise ChaosFailure(f"{where}: a 200 that is not JSON: {content[:300]!r}") from None
        if not isinstance(body, dict) or "choices" not in body:
            raise ChaosFailure(f"{where}: a 200 without choices: {content[:300]!r}")
        return Answer(status, "completed")
    payloads = sse_payloads(content.decode("utf-8", "replace"))
    if not payloads or payloads[-1] != "[DONE]":
        raise ChaosFailure(f"{where}: a stream not ended by [DONE]: ...{content[-300:]!r}")
    if not content.endswith(b"\n\n"):
        raise ChaosFailure(f"{where}: a stream cut after [DONE]: ...{content[-100:]!r}")
    code = None
    for payload in payloads[:-1]:
        try:
            event = json.loads(payload)
        except ValueError:
            raise ChaosFailure(f"{where}: a relayed event is not JSON: {payload[:200]!r}") from None
        if isinstance(event, dict) and "error" in event:
            if code is not None:
                raise ChaosFailure(f"{where}: two in-band errors")
            code = check_error(event["error"], f"{where} (in-band)")["code"]
    if code is None:
        return Answer(status, "completed")
    if payloads[-2].find('"error"') < 0:
        raise ChaosFailure(f"{where}: events after the in-band error")
    terminal = CLASS_OF_CODE.get(code, "failed")
    return Answer(status, terminal, code)


@attrs.define
class Tally:
    """The client's own books: what it sent, what is live, what each answer implies."""

    sent: int = 0
    live: int = 0
    ended: Counter[str] = attrs.field(factory=Counter)
    worst_latency_s: float = 0.0

    @contextlib.contextmanager
    def request(self) -> Any:
        """Count a request live from sending until the block ends (however it ends)."""
        self.sent += 1
        self.live += 1
        start = trio.current_time()
        try:
            yield
        finally:
            self.live -= 1
            self.worst_latency_s = max(self.worst_latency_s, trio.current_time() - start)

    def end(self, terminal: str) -> None:
        self.ended[terminal] += 1

    def expected_counters(self) -> dict[str, int]:
        return dict(self.ended)


def gauges(router: Router) -> dict[str, int]:
    """Every gauge that must be zero when nothing runs, read from the router's state."""
    stats = router.statistics()
    values = {
        "in_flight": stats.accounting.in_flight,
        "retention_in_use": stats.retention.in_use,
        "queue_depth": stats.queue.depth,
    }
    for engine in stats.engines:
        values[f"{engine.name}.prefill"] = engine.prefill
        values[f"{engine.name}.decode"] = engine.decode
    return values


_GAUGE_LINE = re.compile(
    rb"^(narwhal_in_flight|narwhal_queue_depth|narwhal_http_retention_in_use|"
    rb"narwhal_engine_occupancy)(\{[^}]*\})? (\S+)$",
    re.M,
)


def metrics_gauges(text: bytes) -> dict[str, float]:
    """The same gauges, as ``/metrics`` exposes them."""
    return {
        (name + (labels or b"")).decode(): float(value)
        for name, labels, value in _GAUGE_LINE.findall(text)
    }


def books_balance(router: Router) -> None:
    """``offered = sum(terminals) + in_flight``, from the counters as ``/ready`` shows them."""
    counters = router.statistics().as_json()["counters"]
    terminals = sum(
        value
        for key, value in counters.items()
        if key not in ("offered", "unsized_offered", "in_flight")
    )
    assert counters["offered"] - terminals == counters["in_flight"], counters
    assert counters["in_flight"] >= 0, counters


async def settle(router: Router, *, within_s: float = 5.0) -> None:
    """Wait (on the Trio clock, bounded) until every gauge reads zero; don't fail here."""
    with trio.move_on_after(within_s):
        while any(gauges(router).values()):  # noqa: ASYNC110 - gauges have no event
            await trio.sleep(0.005)


async def settle_and_check(
    router: Router,
    tally: Tally | None = None,
    *,
    client: httpx.AsyncClient | None = None,
    within_s: float = 5.0,
    exact_classes: bool = True,
) -> dict[str, int]:
    """After a run: the books balance, agree with ``tally``, and every gauge is zero.

    ``client`` (the router's own) reads ``/ready`` and ``/metrics`` too, as an operator would.
    ``exact_classes`` compares each terminal class with the tally (off where the client cannot
    know, e.g. a disconnect racing the last byte). Returns the counters.
    """
    await settle(router, within_s=within_s)
    books_balance(router)
    values = gauges(router)
    assert not any(values.values()), f"gauges not back to zero: {values}"
    counters = router.statistics().as_json()["counters"]
    if client is not None:
        ready = (await client.get("/ready")).json()["counters"]
        assert ready == counters, (ready, counters)
        metrics = metrics_gauges((await client.get("/metrics")).content)
        assert metrics and not any(metrics.values()), f"/metrics gauges: {metrics}"
    if tally is not None:
        assert tally.live == 0, "the client still has live requests"
        assert counters["offered"] == tally.sent, (counters, tally)
        terminals = {
            key: value
            for key, value in counters.items()
            if key not in ("offered", "unsized_offered", "in_flight") and value
        }
        if exact_classes:
            assert terminals == tally.expected_counters(), (terminals, dict(tally.ended))
        else:
            assert sum(terminals.values()) == tally.sent, (terminals, tally)
    return counters


# -- fleets -------------------------------------------------------------------------------------


def sim_transports(
    configs: Sequence[EngineConfig],
    directives: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    time_scale: float = 1.0,
) -> dict[str, SimTransport]:
    sims = {
        engine.name: SimTransport(
            SimEngine(
                MODEL,
                dialect=engine.dialect,
                timing=StepTiming(get_profile("h100-llama3-8b"), time_scale=time_scale),
                seed=index,
                name=engine.name,
            ),
            record=False,
        )
        for index, engine in enumerate(configs)
    }
    for name, values in (directives or {}).items():
        sims[name].engine.set_directives(values)
    return sims


def chaos_config(engines: Sequence[EngineConfig] | None = None, **sections: Any) -> Config:
    """A config for the chaos fleets: two vLLM engines, a long upstream read timeout, and a
    watchdog that a loaded machine does not trip (the in-loop engines share the router's
    loop: on a busy CI its lag is theirs, and the router would refuse with 503
    ``router_monitoring_degraded``, which is not what these tests look at)."""
    if engines is None:
        engines = (engine_config("sim-a"), engine_config("sim-b"))
    sections.setdefault("serving", ServingConfig(model=MODEL))
    sections.setdefault("monitoring", MonitoringConfig(lag_sustain_s=3600.0))
    sections.setdefault("upstream", UpstreamConfig(read_timeout_s=600))
    return Config(engines=tuple(engines), **sections)


@contextlib.asynccontextmanager
async def open_fleet(
    config: Config | None = None,
    *,
    directives: Mapping[str, Mapping[str, Any]] | None = None,
    simulated: bool = True,
) -> AsyncIterator[Fleet]:
    """A router before in-process simulated engines, ready; everything stops on exit.

    With ``simulated`` false the engines are reached by their URLs, through the router's own
    upstream transport (a stand-in engine on a loopback port).
    """
    config = config or chaos_config()
    sims = sim_transports(config.engines, directives) if simulated else {}
    plugs = {name: Pluggable(sim) for name, sim in sims.items()}
    app = create_app(config, transports=plugs or None)
    async with lifespan(app), trio.open_nursery() as requests:
        client = httpx.AsyncClient(
            transport=ASGIStreamTransport(app, requests), base_url="http://narwhal.test"
        )
        fleet = Fleet(get_router(app), client, sims, plugs)  # type: ignore[arg-type]
        try:
            with trio.fail_after(60):
                await fleet.router.wait_ready()
            fleet.baseline = fleet.completions_received()
            yield fleet
        finally:
            requests.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await client.aclose()


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """The app's ASGI lifespan: startup, and on exit a clean shutdown *before* anything is
    cancelled (so the router closes its engine connections).

    Not :func:`narwhal.bench.inprocess.run_lifespan`: cancelled, that one cancels the app's
    lifespan task too, then waits five seconds for a shutdown nobody is left to perform, and the
    router's connections are never closed (invisible under the MockClock, five seconds and a
    ResourceWarning per fleet on the real clock).
    """
    to_app, from_runner = trio.open_memory_channel[dict[str, Any]](4)
    to_runner, from_app = trio.open_memory_channel[dict[str, Any]](4)

    async def expect(kind: str) -> None:
        message = await from_app.receive()
        assert message["type"] == kind, message

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            app,
            {"type": "lifespan", "asgi": {"version": "3.0"}},
            from_runner.receive,
            to_runner.send,
        )
        await to_app.send({"type": "lifespan.startup"})
        await expect("lifespan.startup.complete")
        try:
            yield
        finally:
            with trio.CancelScope(shield=True), trio.fail_after(10):
                await to_app.send({"type": "lifespan.shutdown"})
                await expect("lifespan.shutdown.complete")
            nursery.cancel_scope.cancel()


async def serve_router(
    nursery: trio.Nursery,
    config: Config,
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    *,
    ready: bool = True,
) -> tuple[str, int]:
    """Serve ``config`` with Hypercorn on a free loopback port in ``nursery``; the URL and port.

    The router is reached only over HTTP, as an operator would (``/ready``, ``/metrics``).
    """
    urls = await nursery.start(partial(serve, config, bind="127.0.0.1:0", transports=transports))
    url: str = urls[0]
    if ready:
        await wait_ready(url)
    return url, int(url.rpartition(":")[2])


async def served_books(url: str, tally: Tally | None = None, *, within_s: float = 10.0) -> None:
    """The served router's books over HTTP: gauges back to zero, the law, the tally's view."""
    async with httpx.AsyncClient(timeout=10) as client:
        with trio.move_on_after(within_s):
            while True:
                ready = (await client.get(f"{url}/ready")).json()
                metrics = metrics_gauges((await client.get(f"{url}/metrics")).content)
                busy = ready["counters"]["in_flight"] or any(metrics.values())
                if not busy:
                    break
                await trio.sleep(0.02)
    counters = ready["counters"]
    terminals = {
        key: value
        for key, value in counters.items()
        if key not in ("offered", "unsized_offered", "in_flight") and value
    }
    assert counters["offered"] - sum(terminals.values()) == counters["in_flight"] == 0, counters
    for engine in ready["engines"]:
        assert engine["occupancy"] == {"prefill": 0, "decode": 0}, engine
    assert metrics and not any(metrics.values()), f"/metrics gauges: {metrics}"
    if tally is not None:
        assert counters["offered"] == tally.sent, (counters, tally)
        assert terminals == tally.expected_counters(), (terminals, dict(tally.ended))


# -- raw sockets --------------------------------------------------------------------------------


@attrs.frozen
class RawResponse:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def parse_responses(data: bytes) -> list[RawResponse]:
    """Every HTTP/1.1 response in ``data`` (Content-Length, chunked or to the end)."""
    responses = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            raise ChaosFailure(f"an incomplete response head: {data[:300]!r}")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise ChaosFailure(f"not a status line: {lines[0]!r}")
        status = int(parts[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if b"content-length" in headers:
            size = int(headers[b"content-length"])
            body, data = rest[:size], rest[size:]
            if len(body) < size:
                raise ChaosFailure(
                    f"a truncated response: {status}, content-length {size}, {len(body)} bytes "
                    f"came: {head[:200]!r}"
                )
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = b""
            while True:
                line, found, rest = rest.partition(b"\r\n")
                if not found:
                    raise ChaosFailure(f"a cut chunked body: {status}, {body[-200:]!r}")
                size = int(line.split(b";")[0] or b"0", 16)
                if size == 0:
                    _, _, rest = rest.partition(b"\r\n")
                    break
                body += rest[:size]
                rest = rest[size + 2 :]
            data = rest
        else:
            body, data = rest, b""
        responses.append(RawResponse(status, headers, body))
    return responses


async def raw_exchange(
    host: str,
    port: int,
    pieces: Sequence[bytes],
    *,
    gap_s: float = 0.0,
    read_s: float = 5.0,
    half_close: bool = False,
    until_close: bool = False,
) -> bytes:
    """Send ``pieces`` (``gap_s`` apart), then read until the server closes or ``read_s`` passes.

    Unless ``until_close``, reading also stops once a whole response that says
    ``Connection: close`` has come (whether the server then closes is checked elsewhere).
    Returns whatever came back; a reset by the server reads as the end.
    """
    received = bytearray()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        with trio.move_on_after(read_s + gap_s * len(pieces)):
            try:
                async with trio.open_nursery() as nursery:

                    async def write() -> None:
                        for index, piece in enumerate(pieces):
                            if index and gap_s:
                                await trio.sleep(gap_s)
                            await stream.send_all(piece)
                        if half_close:
                            await stream.send_eof()

                    async def read() -> None:
                        while data := await stream.receive_some(65536):
                            received.extend(data)
                            if not until_close and _ends_with_close(bytes(received)):
                                break
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(write)
                    nursery.start_soon(read)
            except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
    return bytes(received)


def _ends_with_close(data: bytes) -> bool:
    try:
        responses = parse_responses(data)
    except (ChaosFailure, ValueError):
        return False
    return bool(responses) and responses[-1].headers.get(b"connection", b"").lower() == b"close"


def chat_bytes(body: Mapping[str, Any] | None = None) -> bytes:
    return json.dumps(
        body or {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}
    ).encode()


async def normal_request(url: str, *, stream: bool = False) -> None:
    """The router still answers a plain request correctly (a fresh connection)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "still there?"}],
        "stream": stream,
        "narwhal_sim": {"output_tokens": 3},
    }
    async with httpx.AsyncClient(timeout=10) as client:
        with trio.fail_after(15):
            response = await client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = check_answer(response.status_code, response.content, streamed=stream)
    assert answer.terminal == "completed", answer
