"""``narwhal bench overhead``: what a router adds to a zero-delay engine, side by side.

One run starts a simulated engine with the ``zero`` profile (``narwhal sim``), Narwhal in front
of it and vllm-router in front of the same engine, each as a subprocess on a free loopback port.
At each concurrency level it warms every target up, then measures the same closed-loop load
against the direct path and each router in alternating rounds (the target order rotates every
round), so that noise on the shared machine lands on all of them alike. During each target's
rounds it samples the CPU time of that target's process and of the engine from ``/proc``; after
each level, each router's resident memory.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from narwhal.bench import load
from narwhal.bench.procstat import environment
from narwhal.bench.report import (
    DIRECT,
    NARWHAL,
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
    "Level",
    "OverheadSettings",
    "narwhal_config_text",
    "run_overhead",
    "split_rounds",
]

Echo = Callable[[str], None]


@attrs.frozen
class Level:
    """One concurrency level: requests in flight, and requests measured per target."""

    concurrency: int
    requests: int


DEFAULT_LEVELS = (Level(1, 400), Level(16, 1600), Level(64, 1600))
QUICK_LEVELS = (Level(1, 60), Level(16, 160), Level(64, 256))


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
    ttft_bound_s: float = 0.002

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

    def cpu_seconds(self) -> float | None:
        return None if self.service is None else self.service.cpu_seconds()


@attrs.define
class _Tally:
    """A target's measured records and costs at one level, summed over rounds."""

    records: list[load.RequestRecord] = attrs.Factory(list)
    wall_s: float = 0.0
    cpu_s: float | None = None
    engine_cpu_s: float | None = None
    loadgen_cpu_s: float = 0.0


def split_rounds(requests: int, rounds: int) -> list[int]:
    """``requests`` split into ``rounds`` near-equal shares (the first ones one larger)."""
    rounds = max(1, min(rounds, requests)) if requests > 0 else 1
    share, extra = divmod(requests, rounds)
    return [share + (1 if index < extra else 0) for index in range(rounds)]


def narwhal_config_text(model: str, engine_url: str, base: Path | None = None) -> str:
    """Narwhal's TOML for the run: ``base``'s settings with one engine.

    Without ``base``, the defaults with the per-engine phase limits lifted: a zero-delay engine
    has no capacity to protect, and this benchmark measures the relay, not admission queueing
    (predictive admission still runs and is part of the cost measured).

    Raises:
        narwhal.config.ConfigError: ``base`` is not a valid configuration.
    """
    if base is not None:
        config = load_config(base)
    else:
        config = Config(
            admission=AdmissionConfig(prefill_concurrency=4096, decode_concurrency=4096)
        )
    config = attrs.evolve(
        config,
        serving=attrs.evolve(config.serving, model=model),
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
        levels = trio.run(_measure, settings, targets, engine, echo)
    environment = _environment(settings, engine_started=engine is not None)
    return OverheadReport(
        settings=settings.as_json(),
        environment=environment,
        levels=tuple(levels),
        checks=evaluate_checks(levels, ttft_bound_s=settings.ttft_bound_s),
    )


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

    config_path = log_dir / "narwhal.toml"
    config_path.write_text(narwhal_config_text(settings.model, engine_url, settings.narwhal_config))
    port = free_port()
    argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(config_path)]
    argv += ["--bind", f"127.0.0.1:{port}"]
    narwhal = _launch(NARWHAL, argv, f"http://127.0.0.1:{port}", log_dir, stack)
    targets.append(_Target(NARWHAL, narwhal.url, narwhal))

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

    narwhal.wait_ready([("/ready", status_ok)], deadline_s=settings.startup_timeout_s)
    echo(f"narwhal: ready on {narwhal.url}")
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
) -> list[LevelReport]:
    reports: list[LevelReport] = []

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
) -> LevelReport:
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
            tally = tallies[target.name]
            cpu_before = target.cpu_seconds()
            engine_before = None if engine is None else engine.cpu_seconds()
            started, loadgen_before = time.perf_counter(), time.process_time()
            tally.records += await load.run_closed_loop(
                pools[target.name],
                target.url + "/v1/chat/completions",
                body_for,
                concurrency=concurrency,
                requests=share,
                first_index=len(tally.records),
            )
            tally.wall_s += time.perf_counter() - started
            tally.loadgen_cpu_s += time.process_time() - loadgen_before
            tally.cpu_s = _add(tally.cpu_s, cpu_before, target.cpu_seconds())
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
    return LevelReport(concurrency=concurrency, rounds=len(shares), results=tuple(results))


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
