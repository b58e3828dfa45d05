"""The ``narwhal`` command: serve, controller, demo, sim, bench, check-config, top.

A command-line mistake or a start-up failure (a bad ``--bind``, a port in use, a configuration
that does not load, a relay worker that cannot start) is one line on standard error and exit
status 2, never a traceback; a Ctrl-C before a command handles it is ``narwhal: interrupted``
and status 130 (:mod:`narwhal._entry`). ``narwhal worker`` is not listed: it is how
``narwhal serve`` starts its relay workers (:mod:`narwhal.workers.supervisor`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from narwhal import __version__
from narwhal.config import (
    ConfigError,
    check_bind,
    check_resources,
    config_to_toml,
    load_config,
)

__all__ = ["bind_problem", "listen_failure", "main", "run_listening", "time_scale_problem"]

_log = logging.getLogger(__name__)

COMMANDS = ("serve", "controller", "demo", "sim", "bench", "check-config", "top")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"narwhal {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "sim":
        from narwhal.sim.server import main as sim_main

        return sim_main(rest)
    if command == "bench":
        from narwhal.bench.cli import main as bench_main

        return bench_main(rest)
    if command == "top":
        from narwhal.top import main as top_main

        return top_main(rest)
    handlers = {
        "serve": _serve,
        "controller": _controller,
        "worker": _worker,
        "demo": _demo,
        "check-config": _check_config,
    }
    if command not in handlers:
        print(f"narwhal: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return handlers[command](rest)


def _usage() -> str:
    return (
        "usage: narwhal COMMAND [ARGS]\n"
        "       narwhal --version\n\n"
        "commands:\n"
        "  serve --config FILE       run the router under Hypercorn (Trio worker)\n"
        "  controller --config FILE  only the admission controller, for `hypercorn -w N`\n"
        "  demo                      router and two simulated engines in one process\n"
        "  sim --bind HOST:PORT ...  one simulated engine server\n"
        "  bench overhead ...        the router's added latency and CPU (direct, Narwhal, "
        "vllm-router)\n"
        "  bench admission ...       goodput and TTFT of replayed traces, predictive vs open\n"
        "  bench projection ...      the CPU cost of one TTFT projection on a loaded pool\n"
        "  bench report RUN.json ... an admission run as one HTML page with PNG plots\n"
        "  bench probes ...          /health and /ready latency, main and probe port, under load\n"
        "  check-config FILE         validate a configuration and print the effective values\n"
        "  top --url URL [--token T] a live terminal view of a running router\n\n"
        "`narwhal COMMAND --help` lists a command's options."
    )


def bind_problem(bind: str) -> str | None:
    """Why ``bind`` cannot be listened on as given (not ``HOST:PORT``, port out of range)."""
    try:
        check_bind(bind)
    except ConfigError as exc:
        return f"--bind {exc}"
    return None


def time_scale_problem(scale: float) -> str | None:
    """Why ``scale`` cannot multiply simulated durations (negative, NaN or infinite)."""
    if math.isfinite(scale) and scale >= 0:
        return None
    return f"--time-scale must be a finite number of at least 0, got {scale:g}"


def listen_failure(error: BaseException) -> OSError | None:
    """The OSError that ``error`` is, or that is the one leaf of its exception groups.

    Hypercorn raises a refused bind (port in use, unknown host) inside its own nursery, so it
    reaches ``trio.run`` wrapped in one or more single-exception groups. Anything else (another
    exception, several of them) is not a listen failure and is left to propagate.
    """
    leaf = _only_leaf(error)
    return leaf if isinstance(leaf, OSError) else None


def run_listening(command: str, bind: str, main: Callable[[], Awaitable[None]]) -> int:
    """``trio.run(main)`` for a command that listens on ``bind``; returns the exit status.

    A refused bind (port in use, unknown host) and a configuration error raised while serving
    are one line on standard error and exit status 2; Ctrl-C before the server handles it is 0,
    also when it comes out of a nursery (as one or more exception groups of nothing else).
    """
    import trio

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return 0
    except (Exception, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.split(KeyboardInterrupt)[1] is None:
            return 0
        leaf = _only_leaf(exc)
        if isinstance(leaf, (ConfigError, *_start_failures())):
            print(f"narwhal {command}: {leaf}", file=sys.stderr)
            return 2
        refused = listen_failure(exc)
        if refused is None:
            raise
        print(f"narwhal {command}: cannot listen on {bind}: {_describe(refused)}", file=sys.stderr)
        return 2
    return 0


def _start_failures() -> tuple[type[Exception], ...]:
    """Start-up failures that are one line: a relay worker that exited while starting, an
    app whose lifespan startup failed (a relay worker that cannot reach its controller), a
    demo whose router was not ready in time."""
    from hypercorn.utils import LifespanFailureError

    from narwhal.demo import DemoNotReady
    from narwhal.workers.supervisor import WorkerStartError

    return (WorkerStartError, LifespanFailureError, DemoNotReady)


def _only_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _describe(error: OSError) -> str:
    return error.strerror or str(error)


def _logging(verbose: bool) -> None:
    from narwhal.logs import configure_logging

    configure_logging(logging.INFO if verbose else logging.WARNING)


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="narwhal serve", description="Run the router.")
    parser.add_argument("--config", required=True, help="the TOML configuration file")
    parser.add_argument("--bind", help="HOST:PORT, overriding serving.bind")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine joins and errors")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    problem = bind_problem(args.bind) if args.bind is not None else None
    if problem is not None:
        print(f"narwhal serve: {problem}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"narwhal serve: {exc}", file=sys.stderr)
        return 2
    bind = args.bind or config.serving.bind
    import trio

    from narwhal.server import serve
    from narwhal.workers.supervisor import serve_workers

    workers = config.serving.workers
    server = (
        partial(serve_workers, config, bind=args.bind, handle_signals=True, verbose=args.verbose)
        if workers > 1
        else partial(serve, config, bind=args.bind, handle_signals=True)
    )
    shown = f" with {workers} relay workers" if workers > 1 else ""

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(server)
            print(
                f"narwhal: serving {config.serving.model!r} on {', '.join(urls)}{shown}",
                flush=True,
            )

    return run_listening("serve", bind, run)


def _controller(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="narwhal controller",
        description="Run only the admission controller, on serving.controller_socket, for "
        "relay workers started by `hypercorn -w N 'narwhal.asgi:app()'`.",
    )
    parser.add_argument("--config", required=True, help="the TOML configuration file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine joins and errors")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    try:
        config = load_config(args.config)
        if not config.serving.controller_socket:
            raise ConfigError(
                f"{args.config}: serving.controller_socket: required by narwhal controller "
                "(the path where the relay workers reach it)"
            )
    except ConfigError as exc:
        print(f"narwhal controller: {exc}", file=sys.stderr)
        return 2
    import trio

    from narwhal.workers.supervisor import run_controller

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            path = await nursery.start(partial(run_controller, config, handle_signals=True))
            print(f"narwhal: controller for {config.serving.model!r} on {path}", flush=True)

    return run_listening("controller", config.serving.controller_socket, run)


def _worker(argv: list[str]) -> int:
    """One relay worker (started by ``narwhal serve`` with ``serving.workers`` over 1)."""
    parser = argparse.ArgumentParser(
        prog="narwhal worker", description="One relay worker (narwhal serve starts them)."
    )
    parser.add_argument("--config", required=True, help="the TOML configuration file")
    parser.add_argument("--controller", required=True, help="the controller's Unix socket")
    parser.add_argument(
        "--fd", type=int, action="append", required=True, help="an inherited listening socket"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine joins and errors")
    args = parser.parse_args(argv)
    _logging(args.verbose)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"narwhal worker: {exc}", file=sys.stderr)
        return 2
    import socket

    try:
        sockets = [socket.socket(fileno=fd) for fd in args.fd]
    except OSError as exc:
        print(f"narwhal worker: --fd: not a socket: {_describe(exc)}", file=sys.stderr)
        return 2

    from narwhal.server import serve
    from narwhal.web.app import get_router
    from narwhal.workers.worker import WorkerRouter, create_worker_app

    async def run() -> None:
        app = create_worker_app(config, args.controller)
        router = get_router(app)
        assert isinstance(router, WorkerRouter)
        # The supervisor reports the shutdown: the workers' own progress goes to the log. A
        # worker whose controller is gone drains and exits (the supervisor starts another).
        await serve(
            config,
            app=app,
            sockets=sockets,
            handle_signals=True,
            say=_log.info,
            shutdown_trigger=router.lost.wait,
        )

    return run_listening("worker", args.controller, run)


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
    problem = bind_problem(args.bind) or time_scale_problem(args.time_scale)
    if problem is not None:
        print(f"narwhal demo: {problem}", file=sys.stderr)
        return 2
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
    except ConfigError as exc:  # the message starts with the path
        print(exc, file=sys.stderr)
        return 1
    try:
        check_resources(config)
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"# {args.file}: valid. Effective values:")
    print(config_to_toml(config))
    return 0
