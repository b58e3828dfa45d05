"""A load generator for OpenAI-compatible streaming endpoints, reusable by every benchmark.

Three layers, from pure to Trio:

- :class:`StreamTimer` reads a response's bytes as they arrive (sans-IO: the caller supplies the
  clock) and notes when the first SSE data event carrying output arrived (TTFT), when
  ``data: [DONE]`` arrived (end-to-end latency), how many output events came, and any in-band
  error frame.
- :func:`percentile` and :class:`LatencySummary` turn samples into the figures reports print.
- :func:`send_one`, :func:`run_closed_loop` and :func:`run_open_loop` drive requests through a
  :class:`ClientPool` (one connection per request in flight). A closed loop keeps
  ``concurrency`` requests in flight, each worker sending its next request as soon as the
  previous one finished (the overhead benchmark); an open loop sends at given arrival times
  whatever the responses do (trace replay), so a slow server builds a queue instead of slowing
  the load down.

Timing uses :func:`time.perf_counter` at the moment a read returns, so one read holding several
events dates them all to that read: the resolution is the client's, the same for every target.
"""

from __future__ import annotations

import itertools
import math
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import attrs
import httpx
import orjson
import trio

__all__ = [
    "BodyFactory",
    "ClientPool",
    "LatencySummary",
    "RequestRecord",
    "StreamTimer",
    "chat_body",
    "percentile",
    "run_closed_loop",
    "run_open_loop",
    "send_one",
    "single_connection_client",
]

BodyFactory = Callable[[int], bytes]
"""Builds the JSON body of request number ``i`` (0-based, in the order requests are sent)."""

_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
_OUTPUT_KEYS = ("content", "reasoning", "reasoning_content", "refusal")
_ERROR_BODY_LIMIT = 65536


# -- pure: one stream's timing ------------------------------------------------------------------


@attrs.frozen
class RequestRecord:
    """What one request measured. Times are seconds from when the request was sent.

    Attributes:
        index: the request's number within its run.
        sent_s: when it was sent, on :func:`time.perf_counter`'s clock.
        ttft_s: time to the first data event carrying output, or ``None``.
        e2e_s: time to ``data: [DONE]``, or ``None``.
        output_events: data events that carried output (one per token for vLLM's chunking).
        error: ``None`` for a complete, error-free stream; otherwise a short kind such as
            ``http_429:admission_queue_full``, ``in_band:engine_error``, ``no_done`` or the name
            of the transport exception.
    """

    index: int
    sent_s: float
    ttft_s: float | None
    e2e_s: float | None
    output_events: int
    error: str | None

    @property
    def ok(self) -> bool:
        """A complete stream without error."""
        return self.error is None


class StreamTimer:
    """Incremental SSE reader that times a response (pure: no I/O, the caller passes ``now``).

    Feed each read with the time it returned, then call :meth:`finish`. Accepts LF and CRLF
    framing, comments and multi-line data fields. An output event is a data event whose
    choices carry a non-empty ``content``, ``reasoning``, ``reasoning_content``, ``refusal`` or
    ``text``, or any ``tool_calls``/``function_call`` fragment; role-only and empty deltas are
    not output.

    Args:
        index: the request's number, copied into the record.
        sent_s: when the request was sent (same clock as the ``now`` values).
    """

    __slots__ = (
        "_buffer",
        "_done_s",
        "_error",
        "_first_output_s",
        "_index",
        "_output_events",
        "_pending_cr",
        "_sent_s",
    )

    def __init__(self, index: int, sent_s: float) -> None:
        self._index = index
        self._sent_s = sent_s
        self._buffer = b""
        self._pending_cr = False
        self._first_output_s: float | None = None
        self._done_s: float | None = None
        self._output_events = 0
        self._error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        """Add the bytes of one read that returned at ``now``."""
        if self._pending_cr:
            data = b"\r" + data
            self._pending_cr = False
        if b"\r" in data:
            if data.endswith(b"\r"):
                # Possibly the first half of a CRLF: it waits for the next read.
                data = data[:-1]
                self._pending_cr = True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._buffer + data if self._buffer else data
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            self._event(buffer[start:end], now)
            start = end + 2
        self._buffer = buffer[start:]

    def finish(self, now: float) -> RequestRecord:
        """The record of a response whose body ended at ``now``."""
        rest = self._buffer.strip(b"\n")
        self._buffer = b""
        if rest:
            self._event(rest, now)
        error = self._error
        if error is None and self._done_s is None:
            error = "no_done"
        elif error is None and self._first_output_s is None:
            error = "no_output"
        return self._record(error)

    def fail(self, error: str) -> RequestRecord:
        """The record of a request that failed with ``error`` (times measured so far kept)."""
        return self._record(self._error or error)

    def _record(self, error: str | None) -> RequestRecord:
        return RequestRecord(
            index=self._index,
            sent_s=self._sent_s,
            ttft_s=None if self._first_output_s is None else self._first_output_s - self._sent_s,
            e2e_s=None if self._done_s is None else self._done_s - self._sent_s,
            output_events=self._output_events,
            error=error,
        )

    def _event(self, block: bytes, now: float) -> None:
        if block.startswith(b"data: ") and b"\n" not in block:
            data = block[6:]
        else:
            lines = [
                line[5:].removeprefix(b" ")
                for line in block.split(b"\n")
                if line.startswith(b"data:")
            ]
            if not lines:
                return  # a comment or a block without data
            data = b"\n".join(lines)
        if data == b"[DONE]":
            if self._done_s is None:
                self._done_s = now
            return
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._error = self._error or "malformed_event"
            return
        if not isinstance(payload, dict):
            self._error = self._error or "malformed_event"
            return
        if "error" in payload:
            self._error = self._error or f"in_band:{_error_code(payload)}"
            return
        if _carries_output(payload):
            self._output_events += 1
            if self._first_output_s is None:
                self._first_output_s = now


def _carries_output(payload: dict[str, Any]) -> bool:
    choices = payload.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        if isinstance(text, str) and text:
            return True
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        for key in _OUTPUT_KEYS:
            value = delta.get(key)
            if isinstance(value, str) and value:
                return True
        if delta.get("tool_calls") or delta.get("function_call"):
            return True
    return False


def _error_code(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        if code is not None:
            return str(code)
    return "unknown"


# -- pure: percentiles --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) by linear interpolation between closest ranks.

    This is the usual definition (NumPy's default, "type 7"): the sorted samples sit at ranks
    0 to n-1 and the percentile lies at rank ``q / 100 * (n - 1)``.

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside 0 to 100.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be between 0 and 100, got {q!r}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


@attrs.frozen
class LatencySummary:
    """Count, mean, p50, p90, p99 and max of a set of durations (``None`` when empty)."""

    count: int
    mean_s: float | None
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    max_s: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        """Summarise ``values`` (seconds)."""
        if not values:
            return cls(0, None, None, None, None, None)
        return cls(
            count=len(values),
            mean_s=sum(values) / len(values),
            p50_s=percentile(values, 50),
            p90_s=percentile(values, 90),
            p99_s=percentile(values, 99),
            max_s=max(values),
        )

    def as_json(self) -> dict[str, Any]:
        """Plain values for a JSON report."""
        return attrs.asdict(self)


# -- the Trio shell -----------------------------------------------------------------------------

#: Longest a client's connection is kept idle for reuse. A server may close an idle keep-alive
#: connection (Narwhal after ``serving.header_timeout_s``, 10 s by default), and a request sent
#: on it as it closes fails (httpx: ``RemoteProtocolError``, not retried, since a POST is not
#: idempotent). Real clients stay below such limits: 5 s is httpx's default, and so the openai
#: client's.
KEEPALIVE_S = 5.0


def single_connection_client(
    *, timeout_s: float = 60.0, verify: ssl.SSLContext | bool = True
) -> httpx.AsyncClient:
    """A client holding one keep-alive connection, with no proxies from the environment (the
    targets are local) and a read timeout bounding a stalled stream.

    Pass one ``verify`` context to many clients: httpx otherwise builds (and loads the CA
    certificates into) a new one for every client.
    """
    return httpx.AsyncClient(
        verify=verify,
        limits=httpx.Limits(
            max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_S
        ),
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
        trust_env=False,
    )


class ClientPool:
    """Clients of one connection each, lent one per request in flight; use one pool per target.

    Why not one client with a large pool: httpcore's pool walks every connection it holds, and
    polls each idle socket, whenever a request starts or a response ends. With 64 streams in
    flight that walk was half of the load generator's CPU, CPU that on a shared machine is taken
    from the servers being measured. A client that holds one connection and serves one request
    at a time makes the walk trivial. The most recently returned client is lent first, so in a
    closed loop exactly ``concurrency`` connections are opened (during warm-up) and stay warm;
    :meth:`drop_stale` closes those left idle too long to be reused safely.

    Args:
        factory: makes a new client (tests pass one over a mock transport).
        timeout_s: the read timeout of the default factory's clients.
    """

    def __init__(
        self,
        factory: Callable[[], httpx.AsyncClient] | None = None,
        *,
        timeout_s: float = 60.0,
    ) -> None:
        if factory is None:
            context = ssl.create_default_context()
            factory = partial(single_connection_client, timeout_s=timeout_s, verify=context)
        self._factory = factory
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []
        self._returned_at: dict[httpx.AsyncClient, float] = {}

    @property
    def size(self) -> int:
        """Clients created so far."""
        return len(self._all)

    async def send(
        self, url: str, body: bytes, index: int, *, request_id: str | None = None
    ) -> RequestRecord:
        """:func:`send_one` on an idle client (a new one when none is idle)."""
        if self._idle:
            client = self._idle.pop()
        else:
            client = self._factory()
            self._all.append(client)
        try:
            return await send_one(client, url, body, index, request_id=request_id)
        finally:
            self._idle.append(client)
            self._returned_at[client] = trio.current_time()

    async def drop_stale(self, idle_s: float = KEEPALIVE_S) -> int:
        """Close the idle clients returned more than ``idle_s`` ago (their connections would
        not be reused: see :data:`KEEPALIVE_S`); return how many."""
        oldest = trio.current_time() - idle_s
        stale = [client for client in self._idle if self._returned_at[client] < oldest]
        if not stale:
            return 0
        gone = set(stale)
        self._idle = [client for client in self._idle if client not in gone]
        self._all = [client for client in self._all if client not in gone]
        for client in stale:
            del self._returned_at[client]
            await client.aclose()
        return len(stale)

    async def aclose(self) -> None:
        """Close every client."""
        clients, self._all, self._idle = self._all, [], []
        self._returned_at.clear()
        for client in clients:
            await client.aclose()

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def chat_body(
    model: str, *, output_tokens: int, prompt: str = "Say something.", index: int = 0
) -> bytes:
    """A streaming chat completion of exactly ``output_tokens`` tokens.

    ``max_tokens`` caps real engines; the ``narwhal_sim`` directive makes the simulator produce
    exactly that many, so every target streams the same number of events.
    """
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": f"{prompt} (request {index})"}],
            "max_tokens": output_tokens,
            "stream": True,
            "narwhal_sim": {"output_tokens": output_tokens},
        }
    )


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    index: int,
    *,
    request_id: str | None = None,
) -> RequestRecord:
    """Send one streaming request and time its response; never raises for HTTP failures.

    ``request_id``: sent as its ``X-Request-Id`` (Narwhal passes it on to the engine).
    """
    headers = _HEADERS if request_id is None else {**_HEADERS, "x-request-id": request_id}
    sent = time.perf_counter()
    timer = StreamTimer(index, sent)
    try:
        async with client.stream("POST", url, content=body, headers=headers) as response:
            if response.status_code != 200:
                raw = b""
                async for chunk in response.aiter_raw():
                    raw += chunk
                    if len(raw) > _ERROR_BODY_LIMIT:
                        break
                return timer.fail(f"http_{response.status_code}:{_body_code(raw)}")
            async for chunk in response.aiter_raw():
                timer.feed(chunk, time.perf_counter())
            return timer.finish(time.perf_counter())
    except httpx.HTTPError as exc:
        return timer.fail(type(exc).__name__)


def _body_code(raw: bytes) -> str:
    try:
        return _error_code(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return "unknown"


async def run_closed_loop(
    clients: ClientPool,
    url: str,
    body_for: BodyFactory,
    *,
    concurrency: int,
    requests: int,
    first_index: int = 0,
) -> list[RequestRecord]:
    """Send ``requests`` requests with ``concurrency`` in flight at once.

    Each of ``concurrency`` workers sends its next request as soon as its previous response
    ended, until ``requests`` have been sent. Records come back in the order requests finished.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency!r}")
    records: list[RequestRecord] = []
    numbers = iter(range(first_index, first_index + requests))

    async def worker() -> None:
        for index in numbers:  # shared iterator: each number goes to exactly one worker
            records.append(await clients.send(url, body_for(index), index))

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(worker)
    return records


async def run_open_loop(
    clients: ClientPool,
    url: str,
    body_for: BodyFactory,
    *,
    arrivals_s: Iterable[float],
    max_in_flight: int,
    first_index: int = 0,
    request_ids: str | None = None,
) -> list[RequestRecord]:
    """Send one request at each arrival time (seconds from the start), whatever the responses do.

    An open loop must not slow down when the server does, so a request due while
    ``max_in_flight`` are already running is not delayed: it is recorded at once with the error
    ``loadgen_saturated`` (the load generator's limit, not the server's).

    ``request_ids``: a prefix; request ``i`` is sent with ``X-Request-Id: <prefix><i>`` (``None``:
    none is sent, and the server makes its own).
    """
    records: list[RequestRecord] = []
    in_flight = 0
    start = trio.current_time()
    perf_start = time.perf_counter()

    async def one(index: int) -> None:
        nonlocal in_flight
        request_id = None if request_ids is None else f"{request_ids}{index}"
        try:
            records.append(await clients.send(url, body_for(index), index, request_id=request_id))
        finally:
            in_flight -= 1

    async with trio.open_nursery() as nursery:
        for index, at in zip(itertools.count(first_index), arrivals_s, strict=False):
            await trio.sleep_until(start + at)
            if in_flight >= max_in_flight:
                sent = perf_start + (trio.current_time() - start)
                records.append(RequestRecord(index, sent, None, None, 0, "loadgen_saturated"))
                continue
            in_flight += 1
            nursery.start_soon(one, index)
    return records
