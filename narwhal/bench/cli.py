"""``narwhal bench SUBCOMMAND``: the benchmarks' command line.

Exit status: 0 when every check ran and passed, 1 when a check failed or did not run, 2 when the
command line was wrong or a process could not start, 130 when interrupted (Ctrl-C or SIGTERM;
the benchmark's processes are stopped either way).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import attrs
import orjson

from narwhal.bench.admission import (
    DEFAULT_LOADS,
    MODES,
    AdmissionSettings,
    default_jobs,
    default_modes,
    run_admission,
    run_seeds,
    with_engine_time,
)
from narwhal.bench.goodput import Capacity
from narwhal.bench.inprocess import engine_cap_supported
from narwhal.bench.overhead import (
    DEFAULT_LEVELS as OVERHEAD_LEVELS,
)
from narwhal.bench.overhead import (
    QUICK_LEVELS,
    Level,
    OverheadSettings,
    run_overhead,
)
from narwhal.bench.projection import ProjectionSettings, measure_projection_cost
from narwhal.bench.services import ServiceError
from narwhal.bench.trace import TRACE_NAMES

__all__ = ["admission_json", "admission_settings", "main", "parse_floats", "parse_levels"]


def main(argv: Sequence[str]) -> int:
    """Run ``narwhal bench`` with ``argv`` (the arguments after ``bench``)."""
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # --help, or a usage error argparse has printed
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    status: int = args.run(args, parser)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="narwhal bench",
        description="Benchmarks against OpenAI-compatible servers, printed side by side.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    overhead = commands.add_parser(
        "overhead",
        help="router overhead: direct vs Narwhal vs vllm-router, against a zero-delay engine",
        description=(
            "Start a zero-delay simulated engine, Narwhal and vllm-router in front of it, and "
            "measure the same closed-loop load of streaming chat completions straight to the "
            "engine and through each router, in alternating rounds, at each concurrency level. "
            "Prints TTFT and end-to-end percentiles, what each router adds, its CPU per 1,000 "
            "requests and its memory, the Narwhal / vllm-router ratios, and the quality-bar "
            "verdicts. All processes share this machine's CPU cores."
        ),
    )
    _overhead_arguments(overhead)
    overhead.set_defaults(run=_run_overhead)
    admission = commands.add_parser(
        "admission",
        help="admission quality: predictive vs open against the engines' capacity, virtual time",
        description=(
            "Run the router and simulated engines in one process under Trio's MockClock, "
            "seeded: measure the engines' capacity, replay the Azure conversation trace "
            "open-loop at multiples of it in predictive and open mode, force a sample of the "
            "refused requests in to count false refusals, and measure the memory the retention "
            "and queue limits add. Prints goodput against min(offered, capacity), the share of "
            "admitted requests inside the TTFT budget, TTFT percentiles, refusals by reason, "
            "the TTFT prediction error and the quality bar's verdicts. With --real-time, "
            "confirm on real sockets instead: two `narwhal sim` processes slowed by "
            "--time-scale behind `narwhal serve`."
        ),
    )
    _admission_arguments(admission)
    admission.set_defaults(run=_run_admission)
    projection = commands.add_parser(
        "projection",
        help="what one TTFT projection and one dispatcher pass cost on a loaded pool (CPU)",
        description=(
            "Build a router's state at about 3x its capacity (engines with running requests, "
            "a queue of waiting ones, sizes from the conversation trace) and time, on it, "
            "predictive admission's projection of a newcomer (the queue's plan walked again as "
            "often as the arrival rate makes it) and the dispatcher's pass. Prints p50, p99 and "
            "mean CPU time per call; the target is a mean of at most 100 us per projection."
        ),
    )
    _projection_arguments(projection)
    projection.set_defaults(run=_run_projection)
    report = commands.add_parser(
        "report",
        help="an admission run's JSON as one self-contained HTML page with PNG plots",
        description=(
            "Read the JSON of `narwhal bench admission --output FILE` (several files: one "
            "section each, e.g. seeds 0 and 1 or different traces) and write one HTML file, "
            "its plots embedded: goodput in engine work against load with the bound and every "
            "mode, the in-budget share against load, TTFT CDFs, the prediction error over "
            "time, the safety factor and engine drift over time, the verdicts and the "
            "settings. A plot whose series the run did not record says so. Needs matplotlib "
            "(the bench extra)."
        ),
    )
    report.add_argument("inputs", nargs="+", type=Path, metavar="RUN.json")
    report.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="the HTML file (default: the first RUN.json with the suffix .html)",
    )
    report.set_defaults(run=_run_report)
    probes = commands.add_parser(
        "probes",
        help="/health and /ready latency on the main and the probe port while load saturates",
        description=(
            "Start a zero-delay simulated engine and Narwhal with serving.probe_bind, sample "
            "/health and /ready on both ports (a new connection each, as a kubelet does), "
            "idle and then while a closed loop of streaming chat completions saturates the "
            "router. Prints p50, p99 and max latency per probe and phase; the bar is every "
            "probe-port answer under load within 100 ms. All processes share this machine's "
            "CPU cores."
        ),
    )
    _probes_arguments(probes)
    probes.set_defaults(run=_run_probes)
    return parser


def _probes_arguments(parser: argparse.ArgumentParser) -> None:
    from narwhal.bench.probes import ProbeSettings

    defaults = ProbeSettings()
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, metavar="N")
    parser.add_argument("--output-tokens", type=int, default=defaults.output_tokens, metavar="N")
    parser.add_argument(
        "--duration", type=float, default=defaults.load_s, metavar="S", help="sampled under load"
    )
    parser.add_argument("--quick", action="store_true", help="a short run (8 s under load)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR", help="keep the processes' logs")
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write JSON to FILE")


def _run_probes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from narwhal.bench.probes import ProbeSettings, run_probes

    settings = ProbeSettings(
        model=args.model,
        concurrency=args.concurrency,
        output_tokens=args.output_tokens,
        load_s=8.0 if args.quick else args.duration,
        idle_s=2.0 if args.quick else ProbeSettings().idle_s,
        log_dir=args.log_dir,
    )

    return _run_processes("probes", partial(run_probes, settings), args.output)


def _run_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from narwhal.bench.html_report import ReportError, write_report

    output: Path = args.output or args.inputs[0].with_suffix(".html")
    if output.resolve() in {path.resolve() for path in args.inputs}:
        print(f"narwhal bench report: {output} is an input", file=sys.stderr)
        return 2
    try:
        size = write_report(args.inputs, output)
    except ReportError as exc:
        print(f"narwhal bench report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"narwhal bench report: cannot write {output}: {exc.strerror or exc}", file=sys.stderr
        )
        return 2
    print(f"HTML report written to {output} ({size / 1e3:.0f} kB)")
    return 0


def _overhead_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = OverheadSettings()
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run: fewer requests, a short warm-up, two rounds (explicit options win)",
    )
    parser.add_argument(
        "--concurrency",
        metavar="C,C,...",
        help="concurrency levels (default "
        + ",".join(str(level.concurrency) for level in OVERHEAD_LEVELS)
        + ")",
    )
    parser.add_argument(
        "--requests",
        metavar="N[,N,...]",
        help="requests measured per target at each level, one number for all or one per level "
        "(default "
        + ",".join(str(level.requests) for level in OVERHEAD_LEVELS)
        + "; --quick "
        + ",".join(str(level.requests) for level in QUICK_LEVELS)
        + ")",
    )
    parser.add_argument(
        "--warmup",
        type=_positive_int,
        metavar="N",
        help=f"warm-up requests per target and level (default {defaults.warmup}; --quick 16)",
    )
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        metavar="N",
        help=f"alternating rounds per level (default {defaults.rounds}; --quick 2)",
    )
    parser.add_argument(
        "--output-tokens",
        type=_positive_int,
        default=defaults.output_tokens,
        metavar="N",
        help="tokens per response (default %(default)s)",
    )
    parser.add_argument("--model", default=defaults.model, help="model name (default %(default)s)")
    parser.add_argument(
        "--no-vllm-router", action="store_true", help="measure the direct path and Narwhal only"
    )
    parser.add_argument("--vllm-router", metavar="PATH", help="the vllm-router launcher")
    parser.add_argument(
        "--vllm-router-policy",
        default=defaults.vllm_router_policy,
        help="vllm-router's load-balancing policy (default %(default)s)",
    )
    parser.add_argument(
        "--engine-url",
        metavar="URL",
        help="use this running OpenAI-compatible engine instead of starting `narwhal sim`",
    )
    parser.add_argument(
        "--sim-profile",
        default=defaults.sim_profile,
        help="the simulator's profile (default %(default)s: no simulated delay)",
    )
    parser.add_argument(
        "--narwhal-config",
        type=Path,
        metavar="FILE",
        help="run Narwhal with this configuration's settings (engines and model replaced: it "
        "needs no [[engines]] table)",
    )
    parser.add_argument(
        "--workers",
        metavar="N,N,...",
        help="run Narwhal once per value of serving.workers (relay worker processes under one "
        "admission controller) and report each, with the controller's and the workers' CPU",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure the floor: the cheapest relay in this stack (Python, Trio, Narwhal's "
        "socket calls; requests and responses forwarded verbatim, only their ends found) in "
        "front of the same engine, with the Narwhal / floor ratios",
    )
    parser.add_argument(
        "--stack-floor",
        action="store_true",
        help="also measure the stack floors: the cheapest ASGI relay on Hypercorn (no JSON "
        "parsed, bodies passed through, httpx to the engine), once on stock Hypercorn "
        "(hypercorn-floor) and once on Narwhal's own connection shell (stack-floor), with the "
        "Narwhal / stack-floor ratios",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout_s,
        metavar="S",
        help="longest silence within one response, in seconds (default %(default)s)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=defaults.startup_timeout_s,
        metavar="S",
        help="how long each process may take to become ready (default %(default)s)",
    )
    parser.add_argument(
        "--log-dir", type=Path, metavar="DIR", help="keep the processes' logs in DIR"
    )
    parser.add_argument(
        "--output", type=Path, metavar="FILE", help="also write the report as JSON to FILE"
    )


class _Report(Protocol):
    """What a benchmark of processes reports."""

    @property
    def passed(self) -> bool: ...

    def render(self) -> str: ...

    def as_json(self) -> dict[str, Any]: ...


def _run_processes(name: str, run: Callable[..., _Report], output: Path | None) -> int:
    """Run a benchmark that starts processes (``run(echo=...)``): progress on stderr, the
    report on stdout (and as JSON to ``output``); exit 0 when it passed, 1 when not, 2 when a
    process could not start, 130 when interrupted (its processes are stopped)."""

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        with _terminate_as_interrupt():
            report = run(echo=progress)
    except ServiceError as exc:
        print(f"narwhal bench {name}: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if not _is_interrupt(exc):
            raise
        print(f"narwhal bench {name}: interrupted; its processes are stopped", file=sys.stderr)
        return 130
    print(report.render())
    if output is not None:
        output.write_bytes(
            orjson.dumps(report.as_json(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        )
        print(f"\nJSON report written to {output}")
    return 0 if report.passed else 1


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while the benchmark runs, so its processes are stopped too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_interrupt(exc: BaseException) -> bool:
    """A KeyboardInterrupt, possibly inside (nested) exception groups, and nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(KeyboardInterrupt)
        return rest is None
    return isinstance(exc, KeyboardInterrupt)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_levels(
    concurrency: str | None, requests: str | None, defaults: Sequence[Level]
) -> tuple[Level, ...]:
    """Combine ``--concurrency`` and ``--requests`` with the default levels.

    Without ``--concurrency`` the default levels' concurrencies are used. ``--requests`` is one
    number for every level or one per level; without it a level takes the default count of its
    concurrency, else of the default level with the nearest concurrency.

    Raises:
        ValueError: a value is not a positive integer, or the counts do not match the levels.
    """
    levels_c = (
        [level.concurrency for level in defaults]
        if concurrency is None
        else _integers(concurrency, "--concurrency")
    )
    if requests is None:
        counts = [
            min(
                defaults, key=lambda level: (abs(level.concurrency - c), level.concurrency)
            ).requests
            for c in levels_c
        ]
    else:
        counts = _integers(requests, "--requests")
        if len(counts) == 1:
            counts *= len(levels_c)
        elif len(counts) != len(levels_c):
            raise ValueError(
                f"--requests has {len(counts)} values for {len(levels_c)} concurrency levels"
            )
    return tuple(Level(c, n) for c, n in zip(levels_c, counts, strict=True))


def _integers(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected integers separated by commas, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise ValueError(f"{option}: expected positive integers, got {text!r}")
    return values


def _run_overhead(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from narwhal.config import ConfigError, load_config

    defaults = OverheadSettings()
    try:
        levels = parse_levels(
            args.concurrency, args.requests, QUICK_LEVELS if args.quick else OVERHEAD_LEVELS
        )
        workers = (
            None
            if args.workers is None
            else tuple(dict.fromkeys(_integers(args.workers, "--workers")))
        )
        if args.narwhal_config is not None:  # before any process starts
            load_config(args.narwhal_config, engines_required=False)
    except (ValueError, ConfigError) as exc:
        print(f"narwhal bench overhead: {exc}", file=sys.stderr)
        return 2
    settings = OverheadSettings(
        model=args.model,
        levels=levels,
        warmup=args.warmup or (16 if args.quick else defaults.warmup),
        rounds=args.rounds or (2 if args.quick else defaults.rounds),
        output_tokens=args.output_tokens,
        vllm_router=not args.no_vllm_router,
        vllm_router_path=args.vllm_router,
        vllm_router_policy=args.vllm_router_policy,
        engine_url=args.engine_url,
        sim_profile=args.sim_profile,
        narwhal_config=args.narwhal_config,
        request_timeout_s=args.request_timeout,
        startup_timeout_s=args.startup_timeout,
        log_dir=args.log_dir,
        workers=workers,
        floor=args.floor,
        stack_floor=args.stack_floor,
    )

    return _run_processes("overhead", partial(run_overhead, settings), args.output)


# -- narwhal bench projection -------------------------------------------------------------------


def _projection_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ProjectionSettings()
    parser.add_argument("--engines", type=int, default=defaults.engines, metavar="N")
    parser.add_argument(
        "--running", type=int, default=defaults.running, metavar="N", help="requests placed"
    )
    parser.add_argument(
        "--queued", type=int, default=defaults.queued, metavar="N", help="requests waiting"
    )
    parser.add_argument(
        "--calls", type=int, default=defaults.projections, metavar="N", help="calls timed"
    )
    parser.add_argument(
        "--arrivals-per-s",
        type=float,
        default=defaults.arrivals_per_s,
        metavar="X",
        help="the virtual clock moves by one arrival's gap before each projection",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write JSON to FILE")


def _run_projection(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if min(args.engines, args.running, args.calls) < 1 or args.queued < 0:
        parser.error("--engines, --running and --calls must be at least 1, --queued at least 0")
    if not args.arrivals_per_s > 0:
        parser.error("--arrivals-per-s must be above 0")
    settings = ProjectionSettings(
        engines=args.engines,
        running=args.running,
        queued=args.queued,
        projections=args.calls,
        arrivals_per_s=args.arrivals_per_s,
        seed=args.seed,
    )
    cost = measure_projection_cost(settings)
    print(cost.render())
    if args.output is not None:
        args.output.write_bytes(orjson.dumps(cost.as_json(), option=orjson.OPT_INDENT_2))
        print(f"\nJSON report written to {args.output}")
    return 0 if cost.passed else 1


# -- narwhal bench admission --------------------------------------------------------------------

_DEFAULT_DURATION_S = 1200.0
_QUICK_DURATION_S = 300.0
_DEFAULT_SAMPLES = "50,3"
_QUICK_SAMPLES = "50,2"


def _admission_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: the first {_QUICK_DURATION_S:g} s of the trace, a shorter capacity "
        f"loop, fewer forced-in reruns ({_QUICK_SAMPLES}); explicit options win",
    )
    parser.add_argument(
        "--duration-s",
        type=_positive_float,
        metavar="S",
        help=f"replay the first S seconds of the trace (trace time; default "
        f"{_DEFAULT_DURATION_S:g}: about 3.5 minutes of wall time on two cores; 3600: the whole "
        f"hour, about 10 minutes; --quick {_QUICK_DURATION_S:g})",
    )
    parser.add_argument(
        "--loads",
        metavar="X,X,...",
        default=",".join(f"{load:g}" for load in DEFAULT_LOADS),
        help="offered loads as multiples of the measured capacity (default %(default)s)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(default_modes()),
        help="modes compared: predictive, open, and the baselines predictive must beat, "
        "queue-cap (open with a fixed router queue cap) and engine-cap (vLLM's "
        "--max-num-queued-tokens on the engines) (default %(default)s)",
    )
    parser.add_argument(
        "--queue-cap",
        type=_positive_int,
        metavar="N",
        help="the queue-cap baseline's router queue cap (default: the requests the pool "
        "completes in one budget, ceil(capacity x budget))",
    )
    parser.add_argument(
        "--max-num-queued-tokens",
        type=_positive_int,
        metavar="N",
        help="the engine-cap baseline's vLLM --max-num-queued-tokens on every engine (default: "
        "per engine, the budget x the prefill throughput its profile states)",
    )
    parser.add_argument(
        "--ttft-budget-s",
        type=_positive_float,
        default=2.0,
        metavar="S",
        help="the TTFT budget (default %(default)s)",
    )
    parser.add_argument(
        "--tpot-target-s",
        type=_positive_float,
        default=None,
        metavar="S",
        help="the router's admission.tpot_target_s, in the capacity loop and every mode "
        "(default: none: placement keeps no TPOT target, since the bound is the engines' "
        "full-batch capacity, which a target their full batch misses holds them below)",
    )
    parser.add_argument("--trace", default="conv", choices=TRACE_NAMES, help="the trace")
    seeding = parser.add_mutually_exclusive_group()
    seeding.add_argument("--seed", type=int, default=0, help="seeds everything (default 0)")
    seeding.add_argument(
        "--seeds",
        metavar="N,N,...",
        help="run the whole benchmark once per seed (e.g. 0,1), each seed's checks judged on "
        "their own: the verdict passes only if every seed's does (virtual time only)",
    )
    parser.add_argument(
        "--engines",
        default="2",
        metavar="N|TYPE,TYPE,...",
        help="simulated engines: how many (of --profile), or one engine type each, e.g. "
        "h100,a100 (each engine's router profile is then its type's; default %(default)s)",
    )
    parser.add_argument(
        "--profile",
        default="h100-llama3-8b",
        help="the router's profile of the engines, and their simulated type (default %(default)s)",
    )
    parser.add_argument(
        "--truth-scale",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="the engines are really X times slower than their calibrated type (the router is "
        "not told; 2: the headline wrong prior; default %(default)s)",
    )
    parser.add_argument(
        "--slowdown",
        action="append",
        default=[],
        metavar="ENGINE@AT:FACTOR",
        help="ENGINE turns FACTOR times slower at fraction AT of each replay, e.g. "
        "engine-b@0.5:2.0 (repeatable)",
    )
    parser.add_argument(
        "--engine-truth",
        choices=("calibrated", "prior"),
        default="calibrated",
        help="what the engines run on: the simulator's calibrated types with per-engine "
        "variation, or the router's own profile (the old benchmark; default %(default)s)",
    )
    parser.add_argument(
        "--tokens-per-chunk",
        type=_positive_int,
        default=16,
        metavar="N",
        help="tokens per streamed chunk after the first, which goes alone (default "
        "%(default)s; 1 relays every token, slowly)",
    )
    parser.add_argument(
        "--capacity",
        type=_positive_float,
        metavar="RPS",
        help="use this capacity (requests/s) instead of measuring it (its engine time is "
        "then the replayed requests' mean engine time times RPS)",
    )
    parser.add_argument(
        "--capacity-window-s",
        type=_positive_float,
        metavar="S",
        help="least virtual seconds of the capacity loop measured (default 90; --quick 30), "
        "after a warm-up of at least a third as long; the warm-up also lasts until the loop's "
        "first wave has ended, the window until a pass over the trace has completed",
    )
    parser.add_argument(
        "--false-refusal-samples",
        metavar="N[,N]",
        help="refused requests forced in, one rerun each: at 0.5x, then at every other load "
        f"(default {_DEFAULT_SAMPLES}; --quick {_QUICK_SAMPLES})",
    )
    parser.add_argument(
        "--false-refusal-horizon-s",
        type=_positive_float,
        metavar="S",
        help="how long after a forced-in refusal its rerun watches the requests behind it, "
        "whose in-budget work admitting it may have taken (default: 5 budgets)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="serve through N relay workers under the router as their admission controller "
        "(in-process, over memory streams; default %(default)s: one process). The capacity "
        "and memory runs stay single-process",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        metavar="N",
        help="runs in parallel, each in its own process (default: one per CPU core)",
    )
    parser.add_argument(
        "--narwhal-config",
        type=Path,
        metavar="FILE",
        help="run the router with this configuration's settings (engines and model replaced: it "
        "needs no [[engines]] table)",
    )
    realtime = parser.add_argument_group("real time (--real-time)")
    realtime.add_argument(
        "--real-time",
        action="store_true",
        help="instead of the virtual-time runs, confirm on real sockets: `narwhal sim` "
        "processes slowed by --time-scale behind `narwhal serve`, predictive mode only",
    )
    realtime.add_argument(
        "--time-scale",
        type=_positive_float,
        default=4.0,
        metavar="X",
        help="the engines' --time-scale; the budget is scaled alike (default %(default)s)",
    )
    realtime.add_argument(
        "--real-time-loads",
        metavar="X,X,...",
        default="1,2",
        help="loads of the real-time run (default %(default)s)",
    )
    realtime.add_argument(
        "--real-time-duration-s",
        type=_positive_float,
        metavar="S",
        help="wall seconds of load per level (default 120; --quick 30)",
    )
    realtime.add_argument(
        "--startup-timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="how long each process may take to become ready (default %(default)s)",
    )
    realtime.add_argument(
        "--log-dir", type=Path, metavar="DIR", help="keep the processes' logs in DIR"
    )
    parser.add_argument(
        "--output", type=Path, metavar="FILE", help="also write the report as JSON to FILE"
    )


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def parse_floats(text: str, option: str) -> tuple[float, ...]:
    """Comma-separated positive numbers.

    Raises:
        ValueError: a value is not a positive number, or there is none.
    """
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{option}: expected numbers separated by commas, got {text!r}") from None
    if not values or any(not value > 0 for value in values):
        raise ValueError(f"{option}: expected positive numbers, got {text!r}")
    return values


def admission_settings(args: argparse.Namespace) -> AdmissionSettings:
    """The settings ``narwhal bench admission`` runs with.

    Raises:
        ValueError: an option's value is wrong.
        narwhal.config.ConfigError: ``--narwhal-config`` is not a valid configuration.
    """
    from narwhal.bench.replay import VirtualSetup, default_router
    from narwhal.config import load_config

    loads = parse_floats(args.loads, "--loads")
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    if not modes or any(mode not in MODES for mode in modes):
        raise ValueError(f"--modes: expected some of {', '.join(MODES)}, got {args.modes!r}")
    if "engine-cap" in modes and not engine_cap_supported():
        raise ValueError("--modes: engine-cap needs a simulator with max_num_queued_tokens")
    count, types = _engines(args.engines)
    router = default_router(count, profile=args.profile, types=types)
    if args.narwhal_config is not None:
        base = load_config(args.narwhal_config, engines_required=False)
        router = attrs.evolve(
            base,
            serving=attrs.evolve(base.serving, model=router.serving.model),
            engines=router.engines,
        )
    if args.tpot_target_s is not None:
        router = attrs.evolve(
            router, admission=attrs.evolve(router.admission, tpot_target_s=args.tpot_target_s)
        )
    samples_text = args.false_refusal_samples or (
        _QUICK_SAMPLES if args.quick else _DEFAULT_SAMPLES
    )
    samples = _integers(samples_text, "--false-refusal-samples") if samples_text else [0]
    if len(samples) > 2:
        raise ValueError("--false-refusal-samples: one or two numbers (0.5x, then the others)")
    light, other = samples[0], samples[-1]
    duration = args.duration_s or (_QUICK_DURATION_S if args.quick else _DEFAULT_DURATION_S)
    window = args.capacity_window_s or (30.0 if args.quick else 90.0)
    setup = VirtualSetup(
        router=router,
        profile=args.profile,
        seed=args.seed,
        tokens_per_chunk=args.tokens_per_chunk,
        trace=args.trace,
        duration_s=duration,
        truth=_truth(args, types, router),
        workers=args.workers,
    )
    return AdmissionSettings(
        setup=setup,
        loads=loads,
        modes=modes,
        budget_s=args.ttft_budget_s,
        queue_cap=args.queue_cap,
        max_num_queued_tokens=args.max_num_queued_tokens,
        capacity=None if args.capacity is None else Capacity(args.capacity, 0.0, measured=False),
        capacity_warmup_s=window / 3,
        capacity_window_s=window,
        false_refusal_samples=((0.5, light),),
        false_refusal_default=other if len(samples) > 1 else light,
        false_refusal_horizon_s=args.false_refusal_horizon_s,
        memory=not args.no_memory,
        jobs=args.jobs or default_jobs(),
    )


def admission_seeds(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--seeds``: the seeds to run the whole benchmark with (``None``: one run, ``--seed``).

    Raises:
        ValueError: not integers, one repeated, or with ``--real-time``.
    """
    if args.seeds is None:
        return None
    try:
        seeds = tuple(int(part) for part in args.seeds.split(",") if part.strip())
    except ValueError:
        expected = "expected integers separated by commas"
        raise ValueError(f"--seeds: {expected}, got {args.seeds!r}") from None
    if not seeds:
        raise ValueError(f"--seeds: expected at least one seed, got {args.seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: a seed is repeated in {args.seeds!r}")
    if args.real_time:
        raise ValueError("--seeds: virtual time only (a real-time run takes --seed)")
    return seeds


def _engines(text: str) -> tuple[int, tuple[str, ...]]:
    """``--engines``: a count, or engine types (the count is then theirs)."""
    from narwhal.scheduling.profiles import PROFILES
    from narwhal.sim.calibration import ALIASES, engine_type

    if text.strip().isdigit():
        count = int(text)
        if count < 1:
            raise ValueError(f"--engines: expected at least 1, got {text!r}")
        return count, ()
    types = tuple(part.strip() for part in text.split(",") if part.strip())
    if not types:
        raise ValueError(f"--engines: expected a count or engine types, got {text!r}")
    for name in types:
        engine_type(name)  # raises ValueError for an unknown type
        if ALIASES.get(name, name) not in PROFILES:
            raise ValueError(f"--engines: the router has no profile for {name!r}")
    return len(types), types


def _truth(args: argparse.Namespace, types: tuple[str, ...], router: Any) -> Any:
    """The engines' truth: ``--engines``, ``--truth-scale``, ``--slowdown``, ``--engine-truth``."""
    from narwhal.bench.inprocess import EngineTruth, Slowdown

    slowdowns = []
    names = {engine.name for engine in router.engines}
    for text in args.slowdown:
        slowdown = Slowdown.parse(text)
        if slowdown.engine not in names:
            known = ", ".join(sorted(names))
            raise ValueError(f"--slowdown {text}: no engine {slowdown.engine!r} (known: {known})")
        slowdowns.append(slowdown)
    return EngineTruth(
        types=types,
        scale=args.truth_scale,
        prior=args.engine_truth == "prior",
        slowdowns=tuple(slowdowns),
    )


def _run_admission(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from narwhal.config import ConfigError

    try:
        settings = admission_settings(args)
        seeds = admission_seeds(args)
    except (ValueError, ConfigError) as exc:
        print(f"narwhal bench admission: {exc}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        with _terminate_as_interrupt():
            if args.real_time:
                report_text, data, passed = _real_time(args, settings, progress)
            elif seeds is not None:
                seeded = run_seeds(settings, seeds, echo=progress)
                report_text, data, passed = seeded.render(), seeded.as_json(), seeded.passed
            else:
                report = run_admission(settings, echo=progress)
                report_text, data, passed = report.render(), report.as_json(), report.passed
    except ServiceError as exc:
        print(f"narwhal bench admission: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if not _is_interrupt(exc):
            raise
        print("narwhal bench admission: interrupted", file=sys.stderr)
        return 130
    print(report_text)
    if args.output is not None:
        args.output.write_bytes(admission_json(data))
        print(f"\nJSON report written to {args.output}")
    return 0 if passed else 1


def _ledger_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def admission_json(data: dict[str, Any]) -> bytes:
    """The admission benchmark's JSON file: indented, keys sorted, but each run's ``series``
    (what ``narwhal bench report`` plots) on one line: its per-request lists, one number a
    line, would be most of the file. A run over several seeds holds one report per seed under
    ``by_seed``, each written alike."""
    option = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
    return orjson.dumps(_compact_series(data), option=option)


def _compact_series(data: dict[str, Any]) -> dict[str, Any]:
    if isinstance(data.get("by_seed"), list):
        return {**data, "by_seed": [_compact_series(report) for report in data["by_seed"]]}
    if "runs" not in data:
        return data
    runs = [
        {**run, "series": orjson.Fragment(orjson.dumps(run["series"], option=orjson.OPT_SORT_KEYS))}
        if isinstance(run, dict) and "series" in run
        else run
        for run in data["runs"]
    ]
    return {**data, "runs": runs}


def _real_time(
    args: argparse.Namespace, settings: AdmissionSettings, echo: Callable[[str], None]
) -> tuple[str, dict[str, Any], bool]:
    from narwhal.bench.admission_realtime import RealtimeSettings, run_realtime
    from narwhal.bench.admission_report import render_checks, render_runs, verdict_line
    from narwhal.bench.replay import CapacityJob, measure_capacity

    capacity = settings.capacity
    if capacity is not None:
        capacity = with_engine_time(capacity, settings.setup)
    else:
        echo("capacity: measured in virtual time first")
        capacity = measure_capacity(
            CapacityJob(
                settings.setup,
                warmup_s=settings.capacity_warmup_s,
                window_s=settings.capacity_window_s,
            )
        )
        echo(f"capacity: {capacity.rps:.2f} req/s at time scale 1")
    realtime = RealtimeSettings(
        router=settings.setup.router,
        capacity=capacity,
        loads=parse_floats(args.real_time_loads, "--real-time-loads"),
        duration_s=args.real_time_duration_s or (30.0 if args.quick else 120.0),
        warmup_s=10.0 if args.quick else 20.0,
        time_scale=args.time_scale,
        budget_s=settings.budget_s,
        profile=settings.setup.profile,
        trace=settings.setup.trace,
        seed=settings.setup.seed,
        startup_timeout_s=args.startup_timeout,
        log_dir=args.log_dir,
    )
    report = run_realtime(realtime, echo=echo)
    rt = report.settings
    lines = [
        f"narwhal bench admission --real-time: {rt['engines']} x narwhal sim --time-scale "
        f"{rt['time_scale']:g} behind narwhal serve (Hypercorn), predictive, budget "
        f"{rt['router_budget_s']:g} s ({rt['budget_s']:g} s x {rt['time_scale']:g}), capacity "
        f"{rt['capacity_rps']:.2f} req/s, {rt['duration_s']:g} s of load per level",
        f"engine time: {rt['engine_time']}; the bound's capacity is the engines' count "
        f"({rt['engines']} engine-s/s)",
        "",
        *render_runs(report.runs),
        "",
        *(
            f"{run.load:g}x: goodput {_ledger_rate(run.goodput_engine)} <= charged "
            f"{_ledger_rate(run.work_engine)} <= busy {_ledger_rate(run.busy_engine)} <= "
            f"{rt['engines']} engine-s/s (the engines' ledgers, inside the window)"
            for run in report.runs
        ),
        "",
        *render_checks(report.checks),
        "",
        f"wall time: {report.wall_s:.0f} s",
        verdict_line(report.verdict, report.checks),
    ]
    data = {"capacity": capacity.as_json(), **report.as_json()}
    return "\n".join(lines), data, report.passed
