"""The ``narwhal`` command: serve, demo, sim, bench, check-config."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from functools import partial

from narwhal.config import ConfigError, check_resources, config_to_toml, load_config

__all__ = ["main"]

COMMANDS = ("serve", "demo", "sim", "bench", "check-config")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "sim":
        from narwhal.sim.server import main as sim_main

        return sim_main(rest)
    if command == "bench":
        from narwhal.bench.cli import main as bench_main

        return bench_main(rest)
    handlers = {"serve": _serve, "demo": _demo, "check-config": _check_config}
    if command not in handlers:
        print(f"narwhal: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return handlers[command](rest)


def _usage() -> str:
    return (
        "usage: narwhal COMMAND [ARGS]\n\n"
        "commands:\n"
        "  serve --config FILE       run the router under Hypercorn (Trio worker)\n"
        "  demo                      router and two simulated engines in one process\n"
        "  sim --bind HOST:PORT ...  one simulated engine server\n"
        "  bench overhead ...        benchmarks (see `narwhal bench --help`)\n"
        "  check-config FILE         validate a configuration and print the effective values"
    )


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="narwhal serve", description="Run the router.")
    parser.add_argument("--config", required=True, help="the TOML configuration file")
    parser.add_argument("--bind", help="HOST:PORT, overriding serving.bind")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine joins and errors")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"narwhal serve: {exc}", file=sys.stderr)
        return 2
    import trio

    from narwhal.server import serve, wait_for_signal

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                partial(serve, config, bind=args.bind, shutdown_trigger=wait_for_signal)
            )
            print(f"narwhal: serving {config.serving.model!r} on {', '.join(urls)}", flush=True)

    try:
        trio.run(run)
    except ConfigError as exc:
        print(f"narwhal serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="narwhal demo",
        description="Run the router and two simulated engines in one process.",
    )
    parser.add_argument("--bind", default="127.0.0.1:8000", help="HOST:PORT (default %(default)s)")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="simulated durations times X (default 1)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine joins and errors")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    from narwhal.demo import run_demo

    return run_demo(bind=args.bind, time_scale=args.time_scale)


def _check_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="narwhal check-config",
        description="Validate a configuration and print the effective values.",
    )
    parser.add_argument("file", help="the TOML configuration file")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.file)
        check_resources(config)
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"# {args.file}: valid. Effective values:")
    print(config_to_toml(config))
    return 0
