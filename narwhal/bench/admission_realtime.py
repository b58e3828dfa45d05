"""``narwhal bench admission --real-time``: confirm the virtual-time figures on real sockets.

Two ``narwhal sim`` engines run as processes with ``--time-scale`` > 1 (every simulated duration
multiplied: slower engines, so the token rate stays within what a few CPU cores can relay while
the queueing dynamics stay those of the profile), Narwhal runs under Hypercorn (``narwhal
serve``) in front of them in ``predictive`` mode, and the load generator
(:func:`narwhal.bench.load.run_open_loop`) replays the trace open-loop at multiples of the
engines' capacity. Everything engine-related is ``time_scale`` times slower, so the TTFT budget
is too: the router runs with ``budget_s * time_scale``, and the capacity is the virtual-time
measurement divided by the scale.

Before the measured loads, a short warm-up at half the capacity lets the router learn how much
slower the engines are than their profile says (its prefill forecast's ``scale``).

Engine work is read from the engines' own step ledgers, as in virtual time: the engines run with
``--ledger`` (:class:`narwhal.sim.ledger.SimLedger`), every request is sent with its own
``X-Request-Id`` (which Narwhal forwards to the engine), and after each measured load the
benchmark fetches ``GET /sim/ledger`` from each engine and cuts it to the load's measurement
window (:func:`ledger_in_window`, :func:`ledgered_figures`): each request's charge inside the
window is its ``engine_work_s``, and the engines' busy time is the ledger's. The ledger is on
``time.monotonic``, the load generator on ``time.perf_counter``; both are sampled together once to
put the window on the ledger's clock. The engine seconds are the engines' wall seconds: a step
lasts ``time_scale`` times its calibrated cost and is charged that, so an engine is still busy at
most one second per second, and the bound's capacity is the engines' count: goodput <= charged
<= busy <= engines, by construction. Requests that never ran (refused) are weighed by the cost
model times the time scale, in the same unit. Before the ledger, engine work here was the cost
model's estimate spread over each request's life against the capacity loop's cost-model rate,
and a policy could beat that bound (102.4 % at 2x at ``6832923``).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from narwhal.bench import load
from narwhal.bench.goodput import (
    Bar,
    Capacity,
    Check,
    Outcome,
    ReplayFigures,
    Window,
    Work,
    evaluate,
    overall_verdict,
)
from narwhal.bench.goodput import replay_figures as figures_of
from narwhal.bench.replay import chat_body
from narwhal.bench.services import Service, free_port, lists_model, start_service, status_ok
from narwhal.bench.trace import TraceRequest, load_trace, scale_to_rate
from narwhal.config import Config, EngineConfig, config_to_toml
from narwhal.sim.calibration import engine_type

__all__ = [
    "EngineLedger",
    "RealtimeReport",
    "RealtimeSettings",
    "ledger_in_window",
    "ledgered_figures",
    "outcome_of",
    "realtime_checks",
    "run_realtime",
]

Echo = Callable[[str], None]

# Errors of a response that did arrive (status 200) but ended badly.
_STREAM_ERRORS = frozenset({"no_done", "no_output", "malformed_event"})


@attrs.frozen
class RealtimeSettings:
    """What shapes the real-time confirmation.

    Attributes:
        router: the router's configuration (its engines are replaced by the started ones; the
            mode is ``predictive`` and the budget ``budget_s * time_scale``).
        capacity: the engines' capacity at time scale 1 (the virtual-time measurement).
        loads: offered loads, multiples of the scaled capacity.
        duration_s: wall seconds of load per level.
        warmup_s: wall seconds of warm-up at half the capacity, not measured.
        time_scale: the engines' ``--time-scale``.
        budget_s: the TTFT budget at time scale 1.
        profile: the engines' profile.
        trace: the trace's short name.
        seed: the engines' seeds start here.
        max_in_flight: the load generator's own limit.
        startup_timeout_s: how long each process may take to become ready.
        log_dir: where the processes' logs and the configuration go (a temporary folder when
            ``None``).
        warmup_fraction: share of each level's span left out of its goodput window.
    """

    router: Config
    capacity: Capacity
    loads: tuple[float, ...] = (1.0, 2.0)
    duration_s: float = 120.0
    warmup_s: float = 20.0
    time_scale: float = 4.0
    budget_s: float = 2.0
    profile: str = "h100-llama3-8b"
    trace: str = "conv"
    seed: int = 0
    max_in_flight: int = 2048
    startup_timeout_s: float = 60.0
    log_dir: Path | None = None
    warmup_fraction: float = 0.2

    @property
    def scaled_capacity(self) -> Capacity:
        """The capacity of the slowed engines: the load axis's request rate over the time
        scale; in engine time the engines' count, as in virtual time. The engines' ledgers
        count the wall seconds their steps last (``time_scale`` times the calibrated cost), and
        an engine is busy at most one of them a second: an exact bound, no noise allowed for.
        The rates in engine-seconds per second do not change with the scale (a request weighs
        ``time_scale`` times as much, the engines do a ``time_scale``-th as many a second)."""
        return attrs.evolve(
            self.capacity,
            rps=self.capacity.rps / self.time_scale,
            engines=len(self.router.engines),
        )

    def work(self) -> Work:
        """How a request that never ran is weighed: its cost on each engine's type (``narwhal
        sim --profile``: the nominal type, no variation), times the time scale, so in the
        ledgers' unit (wall seconds of the slowed engines)."""
        costs = engine_type(self.profile)
        count = len(self.router.engines)
        return Work(((costs, self.time_scale),) * count, (costs.name,) * count)

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {
            "loads": list(self.loads),
            "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "time_scale": self.time_scale,
            "budget_s": self.budget_s,
            "router_budget_s": self.budget_s * self.time_scale,
            "capacity_rps": self.scaled_capacity.rps,
            "engine_time": "wall seconds of the slowed engines, from their step ledgers "
            "(narwhal sim --ledger)",
            "profile": self.profile,
            "trace": self.trace,
            "engines": len(self.router.engines),
        }


@attrs.frozen
class RealtimeReport:
    """The real-time confirmation's figures and verdicts."""

    settings: dict[str, Any]
    runs: tuple[ReplayFigures, ...]
    checks: tuple[Check, ...]
    wall_s: float

    @property
    def verdict(self) -> str:
        """``PASS`` (every check ran and passed), ``FAIL`` or ``INCOMPLETE``."""
        return overall_verdict(check.passed for check in self.checks)

    @property
    def passed(self) -> bool:
        """Every check ran and passed."""
        return self.verdict == "PASS"

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {
            "settings": self.settings,
            "runs": [run.as_json() for run in self.runs],
            "checks": [check.as_json() for check in self.checks],
            "wall_s": self.wall_s,
            "verdict": self.verdict,
            "passed": self.passed,
        }


def outcome_of(record: load.RequestRecord, row: TraceRequest, origin: float) -> Outcome:
    """A load generator's record as an :class:`Outcome` (times from ``origin``)."""
    error = record.error
    status, code = 200, error
    if error is None:
        pass
    elif error.startswith("http_"):
        head, _, code = error.partition(":")
        status = int(head.removeprefix("http_"))
    elif error.startswith("in_band:"):
        code = error.removeprefix("in_band:")
    elif error not in _STREAM_ERRORS:
        status = 0  # a transport error, or the load generator's own limit: no response
    arrival = record.sent_s - origin
    return Outcome(
        index=row.index,
        arrival_s=arrival,
        prompt_tokens=row.prompt_tokens,
        output_tokens=row.output_tokens,
        status=status,
        code=code,
        ttft_s=record.ttft_s,
        end_s=None if record.e2e_s is None else arrival + record.e2e_s,
    )


@attrs.frozen
class EngineLedger:
    """One engine's step ledger, as ``GET /sim/ledger`` answers it
    (:meth:`narwhal.sim.ledger.SimLedger.as_json`).

    Attributes:
        bucket_s: the buckets' length; bucket ``k`` is ``[k * bucket_s, (k + 1) * bucket_s)``
            on ``time.monotonic``.
        busy_s: the engine's busy seconds, by bucket.
        charged_s: each request tag's charged seconds, by bucket (a tag with none: it was
            submitted and no step charged it yet).
    """

    bucket_s: float
    busy_s: Mapping[int, float]
    charged_s: Mapping[str, Mapping[int, float]]

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> EngineLedger:
        """From the route's JSON.

        Raises:
            ValueError: it is not a ledger on ``time.monotonic``.
        """
        if data.get("clock") != "time.monotonic":
            raise ValueError(f"not a ledger on time.monotonic: clock {data.get('clock')!r}")
        return cls(
            bucket_s=float(data["bucket_s"]),
            busy_s={int(bucket): float(s) for bucket, s in data["busy_s"].items()},
            charged_s={
                tag: {int(bucket): float(s) for bucket, s in account.items()}
                for tag, account in data["charged_s"].items()
            },
        )


def ledger_in_window(
    ledgers: Sequence[EngineLedger], window: Window
) -> tuple[dict[str, float], float, float]:
    """The engines' ledgers cut to ``window`` (on the ledgers' clock): each tag's charge inside
    it (summed over the engines; every tag a ledger holds, 0 for one charged only outside), and
    the engines' busy and charged seconds inside it.

    A bucket counts by its share inside the window (its time spread evenly over it), its busy
    time and its charges alike, so the charges inside are at most the busy time inside, which
    is at most the window's length per engine (a bucket is busy at most its length).
    """
    charges: dict[str, float] = {}
    busy = charged = 0.0
    for ledger in ledgers:
        size = ledger.bucket_s
        shares: dict[int, float] = {}

        def share(bucket: int, size: float = size, shares: dict[int, float] = shares) -> float:
            value = shares.get(bucket)
            if value is None:
                value = shares[bucket] = window.share(bucket * size, size)
            return value

        busy += sum(seconds * share(bucket) for bucket, seconds in ledger.busy_s.items())
        for tag, account in ledger.charged_s.items():
            inside = sum(seconds * share(bucket) for bucket, seconds in account.items())
            charges[tag] = charges.get(tag, 0.0) + inside
            charged += inside
    return charges, busy, charged


def ledgered_figures(
    tagged: Sequence[tuple[str, Outcome]],
    ledgers: Sequence[EngineLedger],
    *,
    clock_s: float,
    load: float,
    budget_s: float,
    offered_rps: float,
    capacity: Capacity,
    work: Work,
    warmup_fraction: float,
    wall_s: float = 0.0,
) -> ReplayFigures:
    """One load's figures, engine work read from the engines' ledgers (pure).

    ``tagged``: each outcome with the ``X-Request-Id`` it was sent with; ``clock_s``: the
    ledgers' clock (``time.monotonic``) at the outcomes' time 0. Each outcome's
    ``engine_work_s`` is its tag's charge inside the measurement window (:meth:`Window.of` the
    outcomes), ``None`` for a tag no engine took (it never ran: ``work`` weighs it); the
    engines' busy and charged time per second of the window are the ledgers'.
    """
    outcomes = [outcome for _, outcome in tagged]
    window = Window.of(outcomes, warmup_fraction)
    on_clock = Window(window.start_s + clock_s, window.end_s + clock_s)
    charges, busy, charged = ledger_in_window(ledgers, on_clock)
    ledgered = sorted(
        (attrs.evolve(outcome, engine_work_s=charges.get(tag)) for tag, outcome in tagged),
        key=lambda outcome: outcome.arrival_s,
    )
    figure = figures_of(
        ledgered,
        load=load,
        mode="predictive",
        budget_s=budget_s,
        offered_rps=offered_rps,
        capacity=capacity,
        work=work,
        window=window,
        wall_s=wall_s,
        virtual_s=wall_s,
    )
    length = window.length_s
    return attrs.evolve(
        figure,
        busy_engine=busy / length if length > 0 else 0.0,
        work_engine=charged / length if length > 0 else 0.0,
    )


def run_realtime(settings: RealtimeSettings, *, echo: Echo = print) -> RealtimeReport:
    """Start the processes, replay each load, stop the processes, and return the report.

    Raises:
        narwhal.bench.services.ServiceError: a process could not start or become ready.
    """
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if settings.log_dir is not None:
            log_dir = settings.log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nwadm-")))
        router, engines = _start(settings, log_dir, stack, echo)
        runs = trio.run(_measure, settings, router.url, engines, echo)
    return RealtimeReport(
        settings=settings.as_json(),
        runs=tuple(runs),
        checks=tuple(realtime_checks(runs, settings.loads)),
        wall_s=time.perf_counter() - started,
    )


def realtime_checks(runs: Sequence[ReplayFigures], loads: Sequence[float]) -> list[Check]:
    """The real-time confirmation's own targets: goodput at the ``loads`` it runs, in budget at
    2x and above, goodput within the bound. No false refusals, prediction, memory or baselines:
    those are virtual time's (it runs predictive mode only, so a baseline check would never
    run, and the verdict never pass)."""
    bar = Bar(
        goodput_loads=tuple(loads),
        in_budget_loads=tuple(load for load in loads if load >= 2.0),
        false_refusal_loads=(),
        memory_bytes=None,
        baselines=(),
    )
    return [check for check in evaluate(runs, bar) if not check.name.startswith("TTFT")]


def _start(
    settings: RealtimeSettings, log_dir: Path, stack: contextlib.ExitStack, echo: Echo
) -> tuple[Service, list[str]]:
    """Start the engines and the router; return the router and the engines' URLs."""
    model = settings.router.serving.model
    engines = []
    for index, engine in enumerate(settings.router.engines):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "narwhal", "sim", "--bind", f"127.0.0.1:{port}"]
        argv += ["--model", model, "--dialect", engine.dialect, "--profile", settings.profile]
        argv += ["--seed", str(settings.seed + index), "--time-scale", f"{settings.time_scale:g}"]
        argv += ["--ledger"]
        service = start_service(engine.name, argv, url=url, log_dir=log_dir)
        stack.callback(service.stop)
        engines.append((engine, service))
    for _, service in engines:
        service.wait_ready(
            [("/health", status_ok), ("/v1/models", lists_model(model))],
            deadline_s=settings.startup_timeout_s,
        )
    echo(
        f"real time: {len(engines)} engines (narwhal sim --profile {settings.profile} "
        f"--time-scale {settings.time_scale:g} --ledger) ready"
    )
    admission = attrs.evolve(
        settings.router.admission,
        mode="predictive",
        ttft_budget_s=settings.budget_s * settings.time_scale,
    )
    config = attrs.evolve(
        settings.router,
        admission=admission,
        engines=tuple(
            EngineConfig(
                name=engine.name,
                url=service.url,
                dialect=engine.dialect,
                profile=engine.profile,
            )
            for engine, service in engines
        ),
    )
    path = log_dir / "narwhal.toml"
    path.write_text(config_to_toml(config))
    port = free_port()
    argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(path)]
    argv += ["--bind", f"127.0.0.1:{port}"]
    router = start_service("narwhal", argv, url=f"http://127.0.0.1:{port}", log_dir=log_dir)
    stack.callback(router.stop)
    router.wait_ready([("/ready", status_ok)], deadline_s=settings.startup_timeout_s)
    echo(
        f"real time: narwhal ready on {router.url} (predictive, budget "
        f"{settings.budget_s * settings.time_scale:g} s)"
    )
    return router, [service.url for _, service in engines]


async def _measure(
    settings: RealtimeSettings, url: str, engines: Sequence[str], echo: Echo
) -> list[ReplayFigures]:
    rows = load_trace(settings.trace)
    capacity = settings.scaled_capacity
    budget = settings.budget_s * settings.time_scale
    work = settings.work()
    model = settings.router.serving.model
    # The load generator's times (time.perf_counter) on the ledgers' clock (time.monotonic):
    # both read together, once.
    to_monotonic = -time.perf_counter() + time.monotonic()
    figures: list[ReplayFigures] = []
    position = 0
    async with (
        load.ClientPool(timeout_s=600.0) as clients,
        httpx.AsyncClient(timeout=60.0, trust_env=False) as admin,
    ):
        levels = [(0.5, settings.warmup_s, False)]
        levels += [(level, settings.duration_s, True) for level in settings.loads]
        for ordinal, (level, duration, measured) in enumerate(levels):
            if duration <= 0:
                continue
            rate = capacity.rps * level
            count = max(2, round(rate * duration))
            chunk = rows[position : position + count]
            if len(chunk) < count:  # wrap around the trace
                chunk = rows[:count]
                position = 0
            position += count
            scaled = scale_to_rate(chunk, rate)

            def body_for(number: int, scaled: list[TraceRequest] = scaled) -> bytes:
                return chat_body(model, scaled[number], max_tokens=2048)

            prefix = f"nwrt-{ordinal}-"  # each request's X-Request-Id: its ledger tag
            wall = time.perf_counter()
            records = await load.run_open_loop(
                clients,
                url + "/v1/chat/completions",
                body_for,
                arrivals_s=[row.arrival_s for row in scaled],
                max_in_flight=settings.max_in_flight,
                request_ids=prefix,
            )
            wall = time.perf_counter() - wall
            if not measured:
                echo(f"real time: warm-up at 0.5x done ({len(records)} requests, {wall:.0f} s)")
                continue
            # Every response has ended: every step of these requests is in the ledgers.
            ledgers = []
            for engine in engines:
                answer = await admin.get(engine + "/sim/ledger")
                answer.raise_for_status()
                ledgers.append(EngineLedger.of(answer.json()))
            origin = min(record.sent_s for record in records)
            figure = ledgered_figures(
                [
                    (f"{prefix}{record.index}", outcome_of(record, scaled[record.index], origin))
                    for record in records
                ],
                ledgers,
                clock_s=origin + to_monotonic,
                load=level,
                budget_s=budget,
                offered_rps=rate,
                capacity=capacity,
                work=work,
                warmup_fraction=settings.warmup_fraction,
                wall_s=wall,
            )
            figures.append(figure)
            echo(
                f"real time: {level:g}x: {figure.offered} offered, "
                f"{_pct(figure.admitted_fraction)} admitted, {_pct(figure.in_budget_fraction)} "
                f"in budget, goodput {_pct(figure.goodput_engine_ratio)} of bound (engines busy "
                f"{_number(figure.busy_engine)} engine-s/s, {_number(figure.work_engine)} "
                f"charged; {wall:.0f} s)"
            )
    return figures


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f} %"
