"""``narwhal bench SUBCOMMAND``: the benchmarks' command line.

Exit status: 0 when every check passed (or was skipped), 1 when a check failed, 2 when the
command line was wrong or a process could not start, 130 when interrupted (Ctrl-C or SIGTERM;
the benchmark's processes are stopped either way).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

import orjson

from narwhal.bench.overhead import (
    DEFAULT_LEVELS,
    QUICK_LEVELS,
    Level,
    OverheadSettings,
    run_overhead,
)
from narwhal.bench.services import ServiceError

__all__ = ["main", "parse_levels"]


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
    return parser


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
        + ",".join(str(level.concurrency) for level in DEFAULT_LEVELS)
        + ")",
    )
    parser.add_argument(
        "--requests",
        metavar="N[,N,...]",
        help="requests measured per target at each level, one number for all or one per level "
        "(default "
        + ",".join(str(level.requests) for level in DEFAULT_LEVELS)
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
        help="run Narwhal with this configuration's settings (engines and model replaced)",
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
    defaults = OverheadSettings()
    try:
        levels = parse_levels(
            args.concurrency, args.requests, QUICK_LEVELS if args.quick else DEFAULT_LEVELS
        )
    except ValueError as exc:
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
    )

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        with _terminate_as_interrupt():
            report = run_overhead(settings, echo=progress)
    except ServiceError as exc:
        print(f"narwhal bench overhead: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if not _is_interrupt(exc):
            raise
        print("narwhal bench overhead: interrupted; its processes are stopped", file=sys.stderr)
        return 130
    print(report.render())
    if args.output is not None:
        args.output.write_bytes(
            orjson.dumps(report.as_json(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        )
        print(f"\nJSON report written to {args.output}")
    return 0 if report.passed else 1
