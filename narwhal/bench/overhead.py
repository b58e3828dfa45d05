"""``narwhal bench overhead``: what a router adds to a zero-delay engine, side by side.

One run starts a simulated engine with the ``zero`` profile (``narwhal sim``), Narwhal in front
of it and vllm-router in front of the same engine, each as a subprocess on a free loopback port.
At each concurrency level it warms every target up, then measures the same closed-loop load
against the direct path and each router in alternating rounds (the target order rotates every
round), so that noise on the shared machine lands on all of them alike. During each target's
rounds it samples the CPU time of that target's process and of the engine from ``/proc``; after
each level, each router's resident memory.

With ``workers`` (``--workers 1,2``), Narwhal runs once per value of ``serving.workers``, each
its own target (``narwhal`` for 1, ``narwhal-wN`` for N relay workers under one admission
controller), measured in the same alternating rounds, and the report adds a relay-workers
table (:class:`WorkerFigures`): its CPU split between the controller (the ``narwhal serve``
process itself) and the workers (the sum of its child processes).

With ``floor`` (``--floor``), one more target, ``floor``: the cheapest relay this stack can be
(:mod:`narwhal.bench.floor`, a subprocess in front of the same engine), measured in the same
rounds, with the Narwhal / floor ratios beside the Narwhal / vllm-router ones. With
``stack_floor`` (``--stack-floor``), two more: ``hypercorn-floor`` and ``stack-floor``, the
cheapest ASGI relay on stock Hypercorn and on Narwhal's own connection shell
(:mod:`narwhal.bench.stack_floor`), with the Narwhal / stack-floor ratios: what the stack's HTTP
server and ASGI boundary cost before Narwhal does anything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from narwhal.bench import load, procstat
from narwhal.bench.procstat import environment
from narwhal.bench.report import (
    DIRECT,
    FLOOR,
    HYPERCORN_FLOOR,
    NARWHAL,
    STACK_FLOOR,
    VLLM_ROUTER,
    LevelReport,
    OverheadReport,
    TargetResult,
    evaluate_checks,
)
from narwhal.bench.services import (
    ReadyCheck,
    Service,
    ServiceError,
    find_vllm_router,
    free_port,
    lists_model,
    start_service,
    status_ok,
)
from narwhal.config import AdmissionConfig, Config, EngineConfig, config_to_toml, load_config

__all__ = [
    "DEFAULT_LEVELS",
    "QUICK_LEVELS",
    "WORKERS_METHOD",
    "Level",
    "OverheadSettings",
    "WorkerFigures",
    "WorkersOverheadReport",
    "narwhal_config_text",
    "narwhal_target",
    "process_tree_cpu",
    "render_workers",
    "run_overhead",
    "split_rounds",
]

Echo = Callable[[str], None]


@attrs.frozen
class Level:
    """One concurrency level: requests in flight, and requests measured per target."""

    concurrency: int
    requests: int


DEFAULT_LEVELS = (Level(1, 400), Level(16, 1600), Level(64, 1600), Level(256, 1024))
QUICK_LEVELS = (Level(1, 60), Level(16, 160), Level(64, 256), Level(256, 512))


@attrs.frozen
class OverheadSettings:
    """Everything that shapes a run of the overhead benchmark.

    Attributes:
        model: the model name the engine serves and the requests ask for.
        levels: the concurrency levels, measured in this order.
        warmup: requests per target before each level's measurement (at least the level's
            concurrency, so that every connection is open before the clock starts).
        rounds: alternating rounds each level's requests are split into.
        output_tokens: tokens per response (``max_tokens`` and the simulator directive).
        vllm_router: whether to include vllm-router.
        vllm_router_path: its launcher; found beside the interpreter or on PATH when ``None``.
        vllm_router_policy: its load-balancing policy.
        engine_url: an engine already running to use instead of starting ``narwhal sim``
            (its CPU is then not measured).
        sim_profile: the simulator's timing profile.
        narwhal_config: a configuration file whose settings Narwhal runs with (its engines and
            model are replaced by the benchmark's).
        request_timeout_s: longest silence inside one response before it counts as an error.
        startup_timeout_s: how long each process may take to become ready.
        log_dir: where the processes' logs and Narwhal's configuration go (a temporary folder,
            removed at the end, when ``None``).
        ttft_bound_s: the bar for Narwhal's added p50 TTFT at c=1.
        workers: the values of ``serving.workers`` to run Narwhal with, each a target of its
            own (:func:`narwhal_target`), and the relay-workers table; ``None``: one Narwhal,
            with the configuration's value, and no such table.
        floor: whether to include the floor (:mod:`narwhal.bench.floor`), the cheapest relay
            in this stack, as a target.
        stack_floor: whether to include the stack floors (:mod:`narwhal.bench.stack_floor`),
            the cheapest ASGI relay on Hypercorn, as two targets: on stock Hypercorn
            (``hypercorn-floor``) and on Narwhal's own connection shell (``stack-floor``).
    """

    model: str = "llama-3.1-8b-instruct"
    levels: tuple[Level, ...] = DEFAULT_LEVELS
    warmup: int = 100
    rounds: int = 4
    output_tokens: int = 64
    vllm_router: bool = True
    vllm_router_path: str | None = None
    vllm_router_policy: str = "round_robin"
    engine_url: str | None = None
    sim_profile: str = "zero"
    narwhal_config: Path | None = None
    request_timeout_s: float = 60.0
    startup_timeout_s: float = 60.0
    log_dir: Path | None = None
    ttft_bound_s: float = 0.001
    workers: tuple[int, ...] | None = None
    floor: bool = False
    stack_floor: bool = False

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        data = attrs.asdict(self, recurse=True)
        data["levels"] = [attrs.asdict(level) for level in self.levels]
        for key in ("narwhal_config", "log_dir"):
            data[key] = None if data[key] is None else str(data[key])
        return data


@attrs.define(eq=False)
class _Target:
    """Where requests go, and the process to charge for them (none for the direct path)."""

    name: str
    url: str
    service: Service | None
    workers: int | None = None  # serving.workers, for a Narwhal target of --workers

    def cpu_seconds(self) -> float | None:
        return None if self.service is None else self.service.cpu_seconds()

    def cpu_split(self) -> tuple[float, float] | None:
        """CPU seconds so far of the process itself and of its descendants (a Narwhal with
        relay workers: the controller and the workers)."""
        return None if self.service is None else process_tree_cpu(self.service.pid)


@attrs.define
class _Tally:
    """A target's measured records and costs at one level, summed over rounds."""

    records: list[load.RequestRecord] = attrs.Factory(list)
    wall_s: float = 0.0
    cpu_s: float | None = None
    engine_cpu_s: float | None = None
    loadgen_cpu_s: float = 0.0
    own_cpu_s: float = 0.0
    children_cpu_s: float = 0.0


def split_rounds(requests: int, rounds: int) -> list[int]:
    """``requests`` split into ``rounds`` near-equal shares (the first ones one larger)."""
    rounds = max(1, min(rounds, requests)) if requests > 0 else 1
    share, extra = divmod(requests, rounds)
    return [share + (1 if index < extra else 0) for index in range(rounds)]


def narwhal_target(workers: int) -> str:
    """The target name of Narwhal with ``workers`` relay workers (``narwhal`` for one)."""
    return NARWHAL if workers == 1 else f"{NARWHAL}-w{workers}"


def narwhal_config_text(
    model: str, engine_url: str, base: Path | None = None, *, workers: int | None = None
) -> str:
    """Narwhal's TOML for the run: ``base``'s settings with one engine (and
    ``serving.workers`` = ``workers`` when given).

    Without ``base``, the defaults with the per-engine phase limits lifted and admission in
    ``shadow`` mode: a zero-delay engine has no capacity to protect, and this benchmark
    measures the relay, not admission queueing. Shadow mode computes everything predictive
    admission does (the projection, the would-be refusal, the learning), so its cost is
    measured, and refuses nothing: on a CPU-starved machine the router's own delays read as
    engine waits, and predictive refusals would leave a level with nothing to compare.

    Raises:
        narwhal.config.ConfigError: ``base`` is not a valid configuration.
    """
    if base is not None:
        config = load_config(base, engines_required=False)
    else:
        config = Config(
            admission=AdmissionConfig(
                mode="shadow", prefill_concurrency=4096, decode_concurrency=4096
            )
        )
    serving = attrs.evolve(config.serving, model=model)
    if workers is not None:
        serving = attrs.evolve(serving, workers=workers)
    config = attrs.evolve(
        config,
        serving=serving,
        engines=(EngineConfig(name="sim", url=engine_url, dialect="vllm"),),
    )
    return config_to_toml(config)


def run_overhead(settings: OverheadSettings, *, echo: Echo = print) -> OverheadReport:
    """Start the processes, measure every level, stop the processes, and return the report.

    Args:
        settings: what to run.
        echo: where progress lines go.

    Raises:
        ServiceError: a process could not start or become ready.
    """
    with contextlib.ExitStack() as stack:
        if settings.log_dir is not None:
            log_dir = settings.log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nwbench-")))
        engine, targets = _start(settings, log_dir, stack, echo)
        measured = trio.run(_measure, settings, targets, engine, echo)
    environment = _environment(settings, engine_started=engine is not None)
    levels = [level for level, _ in measured]
    fields: dict[str, Any] = {
        "settings": settings.as_json(),
        "environment": environment,
        "levels": tuple(levels),
        "checks": evaluate_checks(levels, ttft_bound_s=settings.ttft_bound_s),
    }
    if settings.workers is None:
        return OverheadReport(**fields)
    figures = tuple(figure for _, level_figures in measured for figure in level_figures)
    return WorkersOverheadReport(**fields, workers=figures)


def _start(
    settings: OverheadSettings, log_dir: Path, stack: contextlib.ExitStack, echo: Echo
) -> tuple[Service | None, list[_Target]]:
    model_ready: list[ReadyCheck] = [
        ("/health", status_ok),
        ("/v1/models", lists_model(settings.model)),
    ]
    engine: Service | None = None
    if settings.engine_url is not None:
        engine_url = settings.engine_url.rstrip("/")
    else:
        port = free_port()
        engine_url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "narwhal", "sim", "--bind", f"127.0.0.1:{port}"]
        argv += ["--model", settings.model, "--dialect", "vllm", "--profile", settings.sim_profile]
        argv += ["--seed", "1"]
        engine = _launch("engine", argv, engine_url, log_dir, stack)
        echo(f"engine: narwhal sim --profile {settings.sim_profile} on {engine_url}")
        engine.wait_ready(model_ready, deadline_s=settings.startup_timeout_s)
    targets = [_Target(DIRECT, engine_url, None)]

    floor: Service | None = None
    if settings.floor:
        port = free_port()
        argv = [sys.executable, "-m", "narwhal.bench.floor", "--bind", f"127.0.0.1:{port}"]
        argv += ["--upstream", engine_url]
        floor = _launch(FLOOR, argv, f"http://127.0.0.1:{port}", log_dir, stack)
        targets.append(_Target(FLOOR, floor.url, floor))

    stack_floors: list[Service] = []
    if settings.stack_floor:
        for name, front in ((HYPERCORN_FLOOR, "hypercorn"), (STACK_FLOOR, "narwhal")):
            port = free_port()
            argv = [sys.executable, "-m", "narwhal.bench.stack_floor", "--bind"]
            argv += [f"127.0.0.1:{port}", "--upstream", engine_url, "--front", front]
            service = _launch(name, argv, f"http://127.0.0.1:{port}", log_dir, stack)
            stack_floors.append(service)
            targets.append(_Target(name, service.url, service))

    narwhals: list[Service] = []
    for workers in settings.workers or (None,):
        name = NARWHAL if workers is None else narwhal_target(workers)
        config_path = log_dir / f"{name}.toml"
        config_path.write_text(
            narwhal_config_text(
                settings.model, engine_url, settings.narwhal_config, workers=workers
            )
        )
        port = free_port()
        argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(config_path)]
        argv += ["--bind", f"127.0.0.1:{port}"]
        narwhal = _launch(name, argv, f"http://127.0.0.1:{port}", log_dir, stack)
        narwhals.append(narwhal)
        targets.append(_Target(name, narwhal.url, narwhal, workers))

    vllm_router: Service | None = None
    if settings.vllm_router:
        executable = settings.vllm_router_path or find_vllm_router()
        if executable is None:
            raise ServiceError(
                "vllm-router not found (install the 'bench' extra, or pass --no-vllm-router)"
            )
        port, metrics_port = free_port(), free_port()
        argv = [executable, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", engine_url, "--policy", settings.vllm_router_policy]
        argv += ["--log-level", "warning", "--prometheus-port", str(metrics_port)]
        argv += ["--worker-startup-check-interval", "1"]
        vllm_router = _launch(VLLM_ROUTER, argv, f"http://127.0.0.1:{port}", log_dir, stack)
        targets.append(_Target(VLLM_ROUTER, vllm_router.url, vllm_router))

    if floor is not None:
        floor.wait_ready(model_ready, deadline_s=settings.startup_timeout_s)
        echo(f"floor: ready on {floor.url}")
    for service in stack_floors:
        service.wait_ready(model_ready, deadline_s=settings.startup_timeout_s)
        echo(f"{service.name}: ready on {service.url}")
    for narwhal in narwhals:
        narwhal.wait_ready([("/ready", status_ok)], deadline_s=settings.startup_timeout_s)
        echo(f"{narwhal.name}: ready on {narwhal.url}")
    if vllm_router is not None:
        vllm_router.wait_ready(model_ready, deadline_s=settings.startup_timeout_s)
        echo(f"vllm-router: ready on {vllm_router.url} (policy {settings.vllm_router_policy})")
    return engine, targets


def _launch(
    name: str, argv: Sequence[str], url: str, log_dir: Path, stack: contextlib.ExitStack
) -> Service:
    service = start_service(name, argv, url=url, log_dir=log_dir)
    stack.callback(service.stop)
    return service


async def _measure(
    settings: OverheadSettings, targets: list[_Target], engine: Service | None, echo: Echo
) -> list[tuple[LevelReport, list[WorkerFigures]]]:
    reports: list[tuple[LevelReport, list[WorkerFigures]]] = []

    def body_for(index: int) -> bytes:
        return load.chat_body(settings.model, output_tokens=settings.output_tokens, index=index)

    async with contextlib.AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        if threading.current_thread() is threading.main_thread():
            nursery.start_soon(_interrupt_on_sigterm)
        pools = {
            target.name: await stack.enter_async_context(
                load.ClientPool(timeout_s=settings.request_timeout_s)
            )
            for target in targets
        }
        for level in settings.levels:
            reports.append(await _measure_level(settings, level, targets, engine, pools, body_for))
            echo(f"c={level.concurrency}: done")
        nursery.cancel_scope.cancel()
    return reports


async def _interrupt_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C, through Trio rather than from inside a signal handler
    (which would leave Trio's state broken), so the processes are stopped on the way out."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            raise KeyboardInterrupt


async def _measure_level(
    settings: OverheadSettings,
    level: Level,
    targets: list[_Target],
    engine: Service | None,
    pools: dict[str, load.ClientPool],
    body_for: load.BodyFactory,
) -> tuple[LevelReport, list[WorkerFigures]]:
    concurrency = level.concurrency
    for target in targets:
        await load.run_closed_loop(
            pools[target.name],
            target.url + "/v1/chat/completions",
            body_for,
            concurrency=concurrency,
            requests=max(settings.warmup, concurrency),
        )
    tallies = {target.name: _Tally() for target in targets}
    shares = split_rounds(level.requests, settings.rounds)
    for round_number, share in enumerate(shares):
        turn = round_number % len(targets)
        for target in targets[turn:] + targets[:turn]:
            pool = pools[target.name]
            if await pool.drop_stale():
                # The other targets' rounds left these connections idle past reuse: open new
                # ones before the round, so that no measured request pays for a connection.
                await load.run_closed_loop(
                    pool,
                    target.url + "/v1/chat/completions",
                    body_for,
                    concurrency=concurrency,
                    requests=concurrency,
                )
            tally = tallies[target.name]
            cpu_before = target.cpu_seconds()
            split_before = target.cpu_split() if target.workers is not None else None
            engine_before = None if engine is None else engine.cpu_seconds()
            started, loadgen_before = time.perf_counter(), time.process_time()
            tally.records += await load.run_closed_loop(
                pool,
                target.url + "/v1/chat/completions",
                body_for,
                concurrency=concurrency,
                requests=share,
                first_index=len(tally.records),
            )
            tally.wall_s += time.perf_counter() - started
            tally.loadgen_cpu_s += time.process_time() - loadgen_before
            tally.cpu_s = _add(tally.cpu_s, cpu_before, target.cpu_seconds())
            split_after = target.cpu_split() if split_before is not None else None
            if split_before is not None and split_after is not None:
                tally.own_cpu_s += split_after[0] - split_before[0]
                tally.children_cpu_s += split_after[1] - split_before[1]
            if engine is not None:
                tally.engine_cpu_s = _add(tally.engine_cpu_s, engine_before, engine.cpu_seconds())
    results = []
    for target in targets:
        tally = tallies[target.name]
        memory = None if target.service is None else target.service.memory()
        results.append(
            TargetResult.from_records(
                target.name,
                concurrency,
                tally.records,
                wall_s=tally.wall_s,
                cpu_s=tally.cpu_s,
                engine_cpu_s=tally.engine_cpu_s,
                loadgen_cpu_s=tally.loadgen_cpu_s,
                rss_bytes=None if memory is None else memory.rss_bytes,
                peak_rss_bytes=None if memory is None else memory.peak_rss_bytes,
            )
        )
    level_report = LevelReport(concurrency=concurrency, rounds=len(shares), results=tuple(results))
    figures = [
        WorkerFigures.of(
            level_report,
            target.name,
            target.workers,
            records=tallies[target.name].records,
            controller_cpu_s=tallies[target.name].own_cpu_s,
            workers_cpu_s=tallies[target.name].children_cpu_s,
        )
        for target in targets
        if target.workers is not None
    ]
    return level_report, figures


def _add(total: float | None, before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return total
    return (total or 0.0) + (after - before)


def _environment(settings: OverheadSettings, *, engine_started: bool) -> dict[str, Any]:
    facts = environment(("narwhal", "vllm-router", "httpx", "trio", "hypercorn"))
    facts["shared_cpu"] = (
        "load generator, engine and routers run on the same machine and share its "
        f"{facts['cpu_cores']} CPU cores"
    )
    facts["engine"] = "narwhal sim" if engine_started else settings.engine_url
    return facts


# -- relay workers ------------------------------------------------------------------------------

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

WORKERS_METHOD = (
    "Controller CPU per request: CPU seconds of the `narwhal serve` process itself (the "
    "admission controller) during the target's rounds, divided by its requests; workers' CPU "
    "per request: the same for the sum of its child processes (the relay workers). With one "
    "worker everything runs in one process and counts as the controller. A controller on one "
    "full core keeps up with at most 1 / (controller CPU per request) requests per second, and "
    "a relay worker on one full core relays 1 / (workers' CPU per request), so one controller "
    "can serve about (workers' CPU per request) / (controller CPU per request) workers, each on "
    "a core of its own, before the controller is the bottleneck."
)


def process_tree_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds so far of ``pid`` itself and of all its live descendants together, read in
    one pass over ``/proc`` (a descendant that has exited is no longer counted)."""
    own = children = 0
    for member in procstat.descendants(pid):
        try:
            text = (Path("/proc") / str(member) / "stat").read_text()
            stat = procstat.parse_stat(text)
        except (OSError, ValueError):
            continue  # it ended between the listing and the read
        ticks = stat.utime_ticks + stat.stime_ticks
        if member == pid:
            own += ticks
        else:
            children += ticks
    return own / _TICKS_PER_S, children / _TICKS_PER_S


@attrs.frozen
class WorkerFigures:
    """One Narwhal target of ``--workers`` at one level (see :data:`WORKERS_METHOD`).

    Attributes:
        target: its name (:func:`narwhal_target`).
        workers: ``serving.workers``.
        concurrency: requests in flight at once.
        requests: requests measured.
        errors: of which did not end in a complete, error-free stream.
        added_ttft_p50_s: its p50 TTFT minus the direct path's.
        added_ttft_p99_s: the same at p99.
        throughput_rps: requests per second over its rounds.
        chunks_per_s: output events relayed per second over its rounds.
        controller_cpu_s_per_request: the ``narwhal serve`` process's own CPU per request.
        workers_cpu_s_per_request: its child processes' CPU per request (0 with one worker).
    """

    target: str
    workers: int
    concurrency: int
    requests: int
    errors: int
    added_ttft_p50_s: float | None
    added_ttft_p99_s: float | None
    throughput_rps: float | None
    chunks_per_s: float | None
    controller_cpu_s_per_request: float | None
    workers_cpu_s_per_request: float | None

    @classmethod
    def of(
        cls,
        level: LevelReport,
        target: str,
        workers: int,
        *,
        records: Sequence[load.RequestRecord],
        controller_cpu_s: float,
        workers_cpu_s: float,
    ) -> WorkerFigures:
        """The figures of ``target`` in ``level`` (its records, and its CPU split summed over
        its rounds)."""
        result = level.result(target)
        added = level.added(target)
        requests = len(records)
        wall_s = result.wall_s if result is not None else 0.0
        chunks = sum(record.output_events for record in records if record.ok)
        return cls(
            target=target,
            workers=workers,
            concurrency=level.concurrency,
            requests=requests,
            errors=sum(1 for record in records if not record.ok),
            added_ttft_p50_s=None if added is None else added.ttft_p50_s,
            added_ttft_p99_s=None if added is None else added.ttft_p99_s,
            throughput_rps=requests / wall_s if wall_s > 0 else None,
            chunks_per_s=chunks / wall_s if wall_s > 0 else None,
            controller_cpu_s_per_request=controller_cpu_s / requests if requests else None,
            workers_cpu_s_per_request=workers_cpu_s / requests if requests else None,
        )

    @property
    def workers_per_controller(self) -> float | None:
        """How many relay workers one controller on one core can serve: the workers' CPU per
        request over the controller's (``None`` with one worker, or nothing measured)."""
        controller, workers = self.controller_cpu_s_per_request, self.workers_cpu_s_per_request
        if self.workers < 2 or not controller or workers is None:
            return None
        return workers / controller

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return attrs.asdict(self) | {"workers_per_controller": self.workers_per_controller}


@attrs.frozen
class WorkersOverheadReport(OverheadReport):
    """The overhead report with the relay-workers table (``--workers``)."""

    workers: tuple[WorkerFigures, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The JSON report, with ``workers`` and how its figures are computed."""
        return super().as_json() | {
            "workers": [figure.as_json() for figure in self.workers],
            "workers_method": WORKERS_METHOD,
        }

    def render(self) -> str:
        """The readable tables, the relay-workers one after the levels and before the
        verdicts (the base report's last block)."""
        levels, _, verdicts = super().render().rpartition("\n\n")
        return "\n\n".join((levels, "\n".join(render_workers(self.workers)), verdicts))


def render_workers(figures: Sequence[WorkerFigures]) -> list[str]:
    """The relay-workers table: one row per Narwhal target and level."""
    lines = [
        "Relay workers: Narwhal with each serving.workers value, in the same rounds. CPU in ms "
        "per request,",
        "split between the controller (the narwhal serve process) and the workers (its child "
        "processes).",
        f"{'target':<14}{'c':>5}{'ok':>6}{'err':>5}{'+TTFT p50':>11}{'p99':>9}{'req/s':>8}"
        f"{'chunks/s':>10}{'ctl CPU':>9}{'wrk CPU':>9}{'workers/ctl':>13}",
    ]
    for figure in figures:
        lines.append(
            f"{figure.target:<14}{figure.concurrency:>5}{figure.requests - figure.errors:>6}"
            f"{figure.errors:>5}{_ms(figure.added_ttft_p50_s):>11}"
            f"{_ms(figure.added_ttft_p99_s):>9}{_number(figure.throughput_rps, 0):>8}"
            f"{_number(figure.chunks_per_s, 0):>10}"
            f"{_ms(figure.controller_cpu_s_per_request, signed=False):>9}"
            f"{_ms(figure.workers_cpu_s_per_request, signed=False):>9}"
            f"{_number(figure.workers_per_controller, 1):>13}"
        )
    lines += ["", *textwrap.wrap(WORKERS_METHOD, 100)]
    return lines


def _ms(seconds: float | None, *, signed: bool = True) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:+.2f}" if signed else f"{seconds * 1000:.2f}"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
