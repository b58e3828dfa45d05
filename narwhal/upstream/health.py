"""Engine health over HTTP: the polls and probes around the pure machine.

One :class:`HealthPoller` task per engine runs in the router's nursery. Each poll asks
``/health`` and ``/v1/models`` under one short cancel scope (``monitoring.poll_timeout_s``),
never the upstream read timeout, and reports the result to the engine's
:class:`~narwhal.scheduling.health.EngineHealth`; an engine that has not joined yet is also
given the token-ID probe. Every good poll keeps the engine's own object for the served model
(its ``/v1/models`` entry) as :attr:`~narwhal.scheduling.engines.Engine.model_card`, which the
router's ``/v1/models`` serves. A good poll of an engine whose dialect publishes queue gauges
(``vllm``, ``sglang``) also reads its ``/metrics`` under its own ``monitoring.poll_timeout_s``
(:mod:`narwhal.upstream.engine_metrics`): the readings and their time go to the engine
(:meth:`~narwhal.scheduling.engines.Engine.metrics_polled`), which the watchdog
(:mod:`narwhal.control.watchdog`) reads for freshness. A failed metrics poll (no answer, an
error status, unreadable text, a body over :data:`METRICS_LIMIT_BYTES`) says nothing of the
engine's health: it only lets the readings age. A 404, or text without any of the gauges, says
the engine publishes none: it is not asked again. Polls run every
``monitoring.poll_interval_s``; while an engine's circuit is open they wait for the end of its
cool-down, and the first poll after it is the half-open probe.

Profiling (:mod:`narwhal.upstream.profiling`): an engine that passed its poll and token-ID
probe is profiled before it joins; a profiling that fails keeps it out (reason
``profiling_failed: ...``) and is tried again at the next poll. A joined engine whose drift asks
for it, or that a hold keeps out of placement, is re-profiled at the first poll that finds it
holding no placed request, unless it is the only eligible engine (its probes would hold the
pool's last engine out of placement: it is left to its online learning). Each poll also takes
an engine in severe drift out of placement (reason ``drift: ...``, never the last eligible
one: :meth:`~narwhal.scheduling.engines.Engine.hold_for_drift`, which the engine also does
itself at the request that made its drift severe); it drains, and the first poll that finds it
idle re-profiles it, which ends the hold. ``monitoring.profiling = false`` turns
profiling off (the engine joins on the profile's constants, and drift only penalises its
placement: nothing would bring a held engine back).

Requests report here too: :func:`open_stream` tells the engine it answered,
:func:`record_failure` turns an attempt's failure into a health report when it says the engine
is unresponsive (no connection, a timeout, a broken connection).

What is logged: an engine that has not joined yet, once, as a warning (so that a router whose
engines are all unreachable says so on its console); an engine leaving placement, and coming
back after a warning, as warnings; other changes at ``INFO``. Reasons shown in ``/ready`` carry
no exception repr and no address; the detail goes to the log at ``DEBUG``.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Iterator, Mapping
from typing import Literal

import attrs
import httpx
import orjson
import trio

from narwhal.config import Config
from narwhal.errors import EngineRejectedRequest, EngineUnreachable, NarwhalError
from narwhal.scheduling.engines import Engine, TokenAccounting
from narwhal.scheduling.health import Change, Failure
from narwhal.upstream.client import (
    ChunkEvent,
    DoneEvent,
    EngineClient,
    ErrorFrameEvent,
    UpstreamStream,
    transport_kind,
)
from narwhal.upstream.engine_metrics import MetricsUnreadable, parse_engine_metrics
from narwhal.upstream.profiling import ProfilingFailed, profile_engine

__all__ = [
    "METRICS_LIMIT_BYTES",
    "HealthPoller",
    "client_of",
    "open_stream",
    "record_failure",
    "report_failure",
    "transport_failure",
]

METRICS_LIMIT_BYTES = 4 * 1024 * 1024
"""The most of a ``/metrics`` body read (vLLM's is some 60 kB): more is a failed poll."""

log = logging.getLogger(__name__)


def client_of(engine: Engine) -> EngineClient:
    """The upstream client of ``engine`` (the pool holds it without knowing its type)."""
    client = engine.client
    if not isinstance(client, EngineClient):
        raise TypeError(f"engine {engine.name} has no upstream client")
    return client


async def open_stream(
    engine: Engine,
    route: Literal["chat", "completions"],
    body: bytes,
    *,
    ids_required: bool,
    headers: Mapping[str, str] | None = None,
) -> UpstreamStream:
    """:meth:`EngineClient.open_stream` on ``engine``, telling its health that it answered."""
    stream = await client_of(engine).open_stream(
        route, body, ids_required=ids_required, headers=headers
    )
    engine.request_answered(trio.current_time())
    return stream


def record_failure(engine: Engine, exc: BaseException) -> None:
    """An attempt on ``engine`` failed with ``exc``: report it if the engine is unresponsive.

    A connection that could not be made opens the engine's circuit at once; a timeout or a
    broken connection counts toward ``monitoring.failure_threshold``. Other failures (an error
    answer, a malformed event) say nothing about the engine's health and are not reported.
    """
    failure = transport_failure(exc)
    if failure is not None:
        report_failure(engine, failure)


def report_failure(engine: Engine, failure: Failure) -> None:
    """A request met ``failure`` on ``engine``: tell its health, and log what that changed."""
    _log_change(engine, engine.request_failed(trio.current_time(), failure))


def transport_failure(exc: BaseException) -> Failure | None:
    """What ``exc`` (a Narwhal or httpx error) says of the engine's transport, if anything."""
    chain = list(_causes(exc))
    for cause in chain:
        if not isinstance(cause, httpx.HTTPError):
            continue
        kind = transport_kind(cause)
        if kind is None:
            continue
        if kind == "pool":
            return None
        if kind == "connect":
            timed_out = isinstance(cause, httpx.ConnectTimeout)
            detail = "connect timed out" if timed_out else _connect_detail(chain)
            return Failure("connect", f"unreachable ({detail})")
        return Failure(kind, _KIND_DETAIL[kind])
    if isinstance(exc, EngineUnreachable):
        return Failure("connect", f"unreachable ({_connect_detail(chain)})")
    return None


_KIND_DETAIL = {
    "timeout": "timed out",
    "protocol": "malformed HTTP answer",
    "disconnect": "connection lost",
}


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)


def _connect_detail(chain: list[BaseException]) -> str:
    for cause in chain:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, socket.gaierror):
            return "name not resolved"
        if isinstance(cause, TimeoutError | trio.TooSlowError):
            return "connect timed out"
        if "refused" in str(cause).lower():
            return "connection refused"
    return "cannot connect"


def _log_change(engine: Engine, change: Change | None, *, warned: bool = False) -> None:
    reason = engine.health.reason(trio.current_time())
    if change == "opened":
        log.warning("engine %s left placement: %s", engine.name, reason)
    elif change == "reopened":
        log.info("engine %s stays out of placement: %s", engine.name, reason)
    elif change == "closed":
        log.warning("engine %s is back in placement (circuit closed)", engine.name)
    elif change == "held":
        log.info("engine %s out of placement: %s", engine.name, reason)
    elif change == "released":
        log.info("engine %s is back in placement (profiled)", engine.name)
    elif change == "joined":
        log.log(
            logging.WARNING if warned else logging.INFO,
            "engine %s joined (token_accounting=%s)",
            engine.name,
            engine.token_accounting,
        )


class _PollFailed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.detail)
        self.failure = failure


@attrs.define(eq=False)
class HealthPoller:
    """Polls one engine for ever and reports to its health (run it in the router's nursery).

    Args:
        engine: the engine.
        model: ``serving.model``, which the engine's ``/v1/models`` must list.
        interval_s: ``monitoring.poll_interval_s``, from the start of one poll to the next.
        timeout_s: ``monitoring.poll_timeout_s``, the longest a poll waits.
        probe_timeout_s: the longest the token-ID probe (a two-token completion) and each
            profiling probe wait.
        profiling: ``monitoring.profiling``: profile the engine before it joins, and again
            when it drifts.
    """

    engine: Engine
    model: str
    interval_s: float
    timeout_s: float
    probe_timeout_s: float
    profiling: bool = True
    _warned: bool = attrs.field(default=False, init=False)
    _told: str | None = attrs.field(default=None, init=False)
    _profilings: int = attrs.field(default=0, init=False)
    _profiling_told: str | None = attrs.field(default=None, init=False)
    _metrics_told: str | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        # This poller re-profiles the engine: severe drift may take it out of placement.
        self.engine.reprofiled_on_drift = self.profiling

    @classmethod
    def for_engine(cls, engine: Engine, config: Config) -> HealthPoller:
        """A poller set up from ``[monitoring]`` and ``[upstream]``."""
        monitoring = config.monitoring
        return cls(
            engine,
            config.serving.model,
            interval_s=monitoring.poll_interval_s,
            timeout_s=monitoring.poll_timeout_s,
            probe_timeout_s=config.upstream.read_timeout_s,
            profiling=monitoring.profiling,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll every ``interval_s``, waiting out open circuits' cool-downs; never returns."""
        task_status.started()
        last_start = -math.inf
        while True:
            # A report may open the circuit while we sleep: look again after every wake-up.
            due = max(last_start + self.interval_s, self.engine.health.probe_at() or -math.inf)
            if trio.current_time() < due:
                await trio.sleep_until(due)
                continue
            last_start = trio.current_time()
            await self.poll()

    async def poll(self) -> None:
        """One poll (with the token-ID probe and the profiling while the engine has not
        joined; a re-profiling when it is due and the engine idle), reported."""
        engine = self.engine
        failure = await self._check()
        now = trio.current_time()
        if failure is not None:
            change = engine.poll_failed(now, failure)
            if not engine.health.joined:
                self._not_joined(failure)
            else:
                _log_change(engine, change)
            return
        if engine.metrics_expected:
            await self.poll_metrics()
        if not engine.health.joined:
            if self.profiling and not await self.profile():
                return  # joins once a profiling succeeds
            now = trio.current_time()
        _log_change(engine, engine.poll_succeeded(now), warned=self._warned)
        if not self.profiling:
            return  # nothing would re-profile it: drift only penalises placement
        _log_change(engine, engine.hold_for_drift())
        if (
            engine.wants_profile
            and not engine.slots
            and engine.health.state(trio.current_time()) == "ready"
            and (engine.others_eligible(engine) or not engine.eligible)
        ):
            await self.profile()

    async def poll_metrics(self) -> None:
        """Read the engine's ``/metrics`` once (module doc); a failure is logged, once."""
        with trio.move_on_after(self.timeout_s) as polling:
            detail = await self._read_metrics()
        if polling.cancelled_caught:
            detail = f"no answer within {self.timeout_s:g} s"
        if detail is not None and detail != self._metrics_told:
            log.info("engine %s: metrics poll failed: %s", self.engine.name, detail)
        self._metrics_told = detail

    async def _read_metrics(self) -> str | None:
        engine = self.engine
        body = bytearray()
        try:
            async with client_of(engine).http.stream("GET", "/metrics") as response:
                status = response.status_code
                if status == 404:
                    log.info("engine %s has no /metrics: its queue is not watched", engine.name)
                    engine.metrics_expected = False
                    return None
                if status != 200:
                    return f"/metrics answered {status}"
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > METRICS_LIMIT_BYTES:
                        return f"/metrics answered more than {METRICS_LIMIT_BYTES} bytes"
        except httpx.HTTPError as exc:
            log.debug("engine %s: GET /metrics failed: %r", engine.name, exc)
            failure = transport_failure(exc)
            return f"/metrics: {failure.detail if failure else 'malformed HTTP answer'}"
        try:
            metrics = parse_engine_metrics(body.decode("utf-8"))
        except UnicodeDecodeError:
            return "/metrics: not UTF-8 text"
        except MetricsUnreadable as exc:
            return f"/metrics: {exc}"
        if metrics.empty:
            log.info("engine %s publishes no queue gauges: its queue is not watched", engine.name)
        engine.metrics_polled(trio.current_time(), metrics)
        return None

    async def profile(self) -> bool:
        """Profile the engine now (held out of placement meanwhile); whether it succeeded."""
        engine = self.engine
        _log_change(engine, engine.hold("profiling"))
        self._profilings += 1
        try:
            fit = await profile_engine(
                engine,
                client_of(engine),
                self.model,
                timeout_s=self.probe_timeout_s,
                attempt=self._profilings,
            )
        except ProfilingFailed as failed:
            engine.hold(f"profiling_failed: {failed.detail}")
            if failed.detail != self._profiling_told:
                log.warning(
                    "engine %s: profiling failed: %s; retrying at the next poll",
                    engine.name,
                    failed.detail,
                )
            self._profiling_told = failed.detail
            return False
        self._profiling_told = None
        engine.forecast.calibrate(
            scale=fit.scale,
            latency_s=fit.latency_s,
            decode_scale=fit.decode_scale,
            decode_slope=fit.decode_slope,
        )
        log.info(
            "engine %s profiled: prefill scale %.3g, latency %.3g s, decode scale %.3g, "
            "slope %.3g (%s; decode %s)",
            engine.name,
            engine.forecast.scale,
            engine.forecast.latency_s,
            engine.forecast.decode_scale,
            engine.forecast.decode_slope,
            ", ".join(
                f"{tokens} tokens {seconds * 1000:.1f} ms" for tokens, seconds in fit.prefill
            ),
            ", ".join(f"{batch} at once {s * 1000:.2f} ms/token" for batch, s in fit.decode),
        )
        _log_change(engine, engine.profiled_now())
        return True

    def _not_joined(self, failure: Failure) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "engine %s has not joined yet: %s; retrying every %g s",
                self.engine.name,
                failure.detail,
                self.interval_s,
            )
        elif failure.detail != self._told:
            log.info("engine %s has not joined yet: %s", self.engine.name, failure.detail)
        self._told = failure.detail

    async def _check(self) -> Failure | None:
        try:
            with trio.move_on_after(self.timeout_s) as polling:
                await self._poll_routes()
            if polling.cancelled_caught:
                return Failure("timeout", f"no answer within {self.timeout_s:g} s")
            if not self.engine.health.joined:
                with trio.move_on_after(self.probe_timeout_s) as probing:
                    await self._probe_token_ids()
                if probing.cancelled_caught:
                    return Failure(
                        "timeout",
                        f"no answer to the token probe within {self.probe_timeout_s:g} s",
                    )
        except _PollFailed as failed:
            return failed.failure
        return None

    async def _get(self, path: str) -> bytes:
        try:
            response = await client_of(self.engine).http.get(path)
        except httpx.HTTPError as exc:
            log.debug("engine %s: GET %s failed: %r", self.engine.name, path, exc)
            failure = transport_failure(exc) or Failure("protocol", "malformed HTTP answer")
            raise _PollFailed(failure) from exc
        status = response.status_code
        if status in (401, 403):  # vLLM started with --api-key guards /v1/models
            told = (
                f"the engine refused the API key in {self.engine.config.api_key_env}"
                if self.engine.config.api_key_env
                else "the engine wants an API key: set engines[].api_key_env"
            )
            raise _PollFailed(Failure("unhealthy", f"{path} answered {status} ({told})"))
        if status != 200:
            raise _PollFailed(Failure("unhealthy", f"{path} answered {status}"))
        return response.content

    async def _poll_routes(self) -> None:
        await self._get("/health")
        content = await self._get("/v1/models")
        try:
            listing = orjson.loads(content)
        except orjson.JSONDecodeError:
            listing = None
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list):
            raise _PollFailed(Failure("unhealthy", "/v1/models answered no model list"))
        card = next(
            (
                entry
                for entry in entries
                if isinstance(entry, dict) and entry.get("id") == self.model
            ),
            None,
        )
        if card is None:
            raise _PollFailed(Failure("unhealthy", f"/v1/models does not list {self.model!r}"))
        # The engine's own object for the model (vLLM's has max_model_len, root, owned_by...):
        # what the router's /v1/models serves, refreshed by every good poll.
        self.engine.model_card = card

    async def _probe_token_ids(self) -> None:
        engine = self.engine
        if engine.config.wants_token_ids:
            engine.token_accounting = await self._token_accounting()

    async def _token_accounting(self) -> TokenAccounting:
        body = orjson.dumps(
            {
                "model": self.model,
                "prompt": "Narwhal token probe",
                "max_tokens": 2,
                "stream": True,
                "return_token_ids": True,
                "stream_interval": 1,
            }
        )
        client = client_of(self.engine)
        saw_ids = False
        try:
            async with await client.open_stream("completions", body, ids_required=False) as stream:
                while True:
                    event = await stream.next_event()
                    if isinstance(event, DoneEvent):
                        break
                    if isinstance(event, ErrorFrameEvent):
                        rejected = event.rejection()
                        if rejected is not None:  # a refusal in-band, as a 4xx answer below
                            raise rejected
                        log.info(
                            "engine %s: token probe error: %s", self.engine.name, event.message()
                        )
                        raise _PollFailed(Failure("unhealthy", "the token probe got an error"))
                    assert isinstance(event, ChunkEvent)
                    # A token whose text the engine holds back (part of a character) comes as
                    # a chunk with IDs and no text: IDs anywhere show the engine provides them.
                    saw_ids = saw_ids or event.facts.has_token_ids
                    if event.facts.output and not event.facts.has_token_ids:
                        return "unavailable"
        except EngineRejectedRequest as exc:
            # The engine refuses the field: it joins, without token accounting.
            log.info("engine %s refused the token probe: %s", self.engine.name, exc.message)
            return "unavailable"
        except NarwhalError as exc:
            log.debug("engine %s: token probe failed: %r", self.engine.name, exc)
            failure = transport_failure(exc) or Failure("unhealthy", "the token probe failed")
            raise _PollFailed(failure) from exc
        return "token_ids" if saw_ids else "unavailable"
