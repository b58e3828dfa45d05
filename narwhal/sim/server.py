"""The simulated engine over real HTTP: a Quart-Trio app under Hypercorn's Trio worker.

``narwhal sim --bind 127.0.0.1:8101 --model llama-3.1-8b-instruct`` runs one engine server;
:func:`serve_sim` embeds one in a Trio program (bind port 0 picks a free port; the real URL is
reported through ``task_status``). Routes: ``/health``, ``/v1/models``, ``/metrics`` (vLLM's gauge
names), ``/version`` (vLLM dialect), ``/v1/chat/completions``, ``/v1/completions``, and the
run-time switches
``POST /sim/directives``, ``POST /sim/slowdown`` and ``GET /sim/state``, and ``GET /sim/ledger``
(see :mod:`narwhal.sim.engine`); every other route answers JSON (the dialect's 404 or 405).

The GPU profiles run the engine's continuous-batching step loop in the server's Trio run, in real
time (times ``--time-scale``). With ``--ledger`` the step loop keeps a
:class:`~narwhal.sim.ledger.SimLedger`: each step charged to the requests in it, by their
``X-Request-Id``, per second on ``time.monotonic`` (``GET /sim/ledger``; without ``--ledger`` that
route is a 404 saying so). It is how ``narwhal bench admission --real-time`` reads the engine time
each request got; it holds every request's figures for the life of the process, so it is a
benchmark facility, not for a long-running engine.

The server is also the zero-delay engine of the router-overhead benchmark, so a request does
little beyond planning: frames with no delay are sent without any sleep, and there is no access
log.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio

from narwhal.sim._request import DEFAULT_MAX_MODEL_LEN
from narwhal.sim.calibration import EngineType
from narwhal.sim.engine import SimConnectionDropped, SimEngine
from narwhal.sim.ledger import SimLedger
from narwhal.sim.timing import PROFILES, profile

__all__ = ["create_sim_app", "main", "serve_sim"]


def _headers() -> dict[str, str]:
    """The request's headers, names lower-cased (as :meth:`SimEngine.respond` reads them)."""
    return {name.lower(): value for name, value in request.headers.items()}


async def _answer(engine: SimEngine) -> Response:
    data = await request.get_data(cache=False, as_text=False)
    raw = data.encode() if isinstance(data, str) else data
    plan = engine.respond(
        request.method, request.path, raw, created=int(time.time()), headers=_headers()
    )
    stream = engine.stream(plan)
    try:
        await stream.wait_head()
    except SimConnectionDropped:
        # An ASGI app cannot reset the socket before the head: send the head, then break the
        # body (the client sees an incomplete chunked read).
        return Response(_Broken(), status=200, headers=dict(plan.headers))
    if not plan.streaming:
        # A whole answer goes with its Content-Length, as vLLM's JSON answers do.
        body = b"".join([piece async for piece in stream])
        return Response(body, status=plan.status, headers=dict(plan.headers))
    return Response(stream, status=plan.status, headers=dict(plan.headers))


class _Broken:
    """A response body whose first read breaks the connection."""

    def __aiter__(self) -> _Broken:
        return self

    async def __anext__(self) -> bytes:
        raise SimConnectionDropped("the simulated engine broke the connection")


def create_sim_app(engine: SimEngine) -> QuartTrio:
    """The Quart-Trio app serving ``engine``.

    ``RESPONSE_TIMEOUT`` is off (Quart's default 60 s would cut long streams) and Quart's own
    error pages are replaced by the dialect's JSON.
    """
    app = QuartTrio("narwhal.sim")
    app.config["RESPONSE_TIMEOUT"] = None

    async def completion() -> Response:
        return await _answer(engine)

    async def info() -> Response:
        plan = engine.respond(
            request.method, request.path, created=int(time.time()), headers=_headers()
        )
        return Response(plan.body, status=plan.status, headers=dict(plan.headers))

    async def admin() -> Response:
        data = await request.get_data(cache=False, as_text=False)
        raw = data.encode() if isinstance(data, str) else data
        plan = engine.respond(request.method, request.path, raw, headers=_headers())
        return Response(plan.body, status=plan.status, headers=dict(plan.headers))

    async def not_found(_: Exception) -> Response:
        plan = engine.respond(request.method, request.path, headers=_headers())
        return Response(plan.body, status=plan.status, headers=dict(plan.headers))

    async def too_large(_: Exception) -> Response:
        body = b'{"error":{"message":"Request body too large","type":"BadRequestError",'
        body += b'"param":null,"code":413}}'
        return Response(body, status=413, headers={"content-type": "application/json"})

    for path in ("/v1/chat/completions", "/v1/completions"):
        app.add_url_rule(path, f"completion:{path}", completion, methods=["POST"])
    for path in ("/health", "/v1/models", "/metrics", "/version"):
        app.add_url_rule(path, f"info:{path}", info, methods=["GET"])
    for path, method in (
        ("/sim/directives", "POST"),
        ("/sim/slowdown", "POST"),
        ("/sim/state", "GET"),
        ("/sim/ledger", "GET"),
    ):
        app.add_url_rule(path, f"admin:{path}", admin, methods=[method])
    app.register_error_handler(404, not_found)
    app.register_error_handler(405, not_found)
    app.register_error_handler(413, too_large)
    return app


class _DropFilter(logging.Filter):
    """Keeps a planned connection drop out of Hypercorn's "Error in ASGI Framework" log."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and _is_drop(error))


def _is_drop(error: BaseException) -> bool:
    if isinstance(error, SimConnectionDropped):
        return True
    if isinstance(error, BaseExceptionGroup):
        return all(_is_drop(inner) for inner in error.exceptions)
    return False


_DROP_FILTER = _DropFilter()


async def serve_sim(
    engine: SimEngine,
    bind: str,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` over HTTP at ``bind`` (``HOST:PORT``; port 0 picks a free one).

    Args:
        engine: the engine to serve.
        bind: where to listen.
        shutdown_trigger: when it returns, Hypercorn shuts down gracefully.
        task_status: receives the bound URL, e.g. ``http://127.0.0.1:41234``.
    """
    config = HypercornConfig()
    config.bind = [bind]
    config.accesslog = None
    config.graceful_timeout = 1.0
    logging.getLogger("hypercorn.error").addFilter(_DROP_FILTER)  # idempotent for one object
    app = create_sim_app(engine)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, app, config, shutdown_trigger=shutdown_trigger)
        )
        task_status.started(binds[0])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="narwhal sim", description="Run one simulated inference engine."
    )
    parser.add_argument("--bind", required=True, help="HOST:PORT to listen on (port 0: any)")
    parser.add_argument("--model", required=True, help="the model name served")
    parser.add_argument("--dialect", choices=("vllm", "sglang", "openai"), default="vllm")
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="h100-llama3-8b",
        help="timing profile (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="decides every generated answer")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies every simulated duration (0.1: ten times faster)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help="the context length (vllm dialect: longer prompts are refused; default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="as vLLM's --api-key: /v1 routes want 'Authorization: Bearer KEY' (default: open)",
    )
    parser.add_argument(
        "--reasoning-parser",
        action="store_true",
        help="as a vLLM with a reasoning parser: chat usage counts the reasoning tokens",
    )
    parser.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=None,
        metavar="N",
        help="as vLLM's: refuse new requests with a 503 while the prompts not yet prefilled "
        "add up to N tokens (default: no limit)",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="relative amplitude of the seeded noise on each step, 0 to 1 (default: 0)",
    )
    parser.add_argument(
        "--ledger",
        action="store_true",
        help="keep the step ledger (GET /sim/ledger: engine time per request X-Request-Id and "
        "per second); a benchmark facility: it holds every request's figures for the life of "
        "the process",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``narwhal sim``: serve one simulated engine until Ctrl-C. Returns the exit status."""
    from narwhal.cli import bind_problem, run_listening, time_scale_problem
    from narwhal.server import IGNORED_SIGNALS, STOP_SIGNALS

    args = _parser().parse_args(argv)
    problem = bind_problem(args.bind) or time_scale_problem(args.time_scale)
    if problem is None and not 0 <= args.jitter <= 1:
        problem = f"--jitter must be between 0 and 1, got {args.jitter:g}"
    if problem is None and args.max_model_len < 1:
        problem = f"--max-model-len must be at least 1, got {args.max_model_len}"
    if (
        problem is None
        and args.max_num_queued_tokens is not None
        and args.max_num_queued_tokens < 0
    ):
        problem = f"--max-num-queued-tokens must be at least 0, got {args.max_num_queued_tokens}"
    if problem is not None:
        print(f"narwhal sim: {problem}", file=sys.stderr)
        return 2
    engine = SimEngine(
        args.model,
        dialect=args.dialect,
        timing=profile(
            args.profile, time_scale=args.time_scale, jitter=args.jitter, seed=args.seed
        ),
        seed=args.seed,
        # Named per process: response IDs derive from the seed and the name, and two engines
        # behind one router must not share them.
        name=f"sim-{os.getpid()}",
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        reasoning_parser=args.reasoning_parser,
        max_num_queued_tokens=args.max_num_queued_tokens,
    )
    if args.ledger:
        costs = getattr(engine.timing, "profile", None)
        if not isinstance(costs, EngineType) or not engine.watch_steps(SimLedger(costs)):
            print(
                f"narwhal sim: --ledger needs a profile with a step loop, not {args.profile!r}",
                file=sys.stderr,
            )
            return 2

    async def run() -> None:
        # Signals arrive through a receiver, not as KeyboardInterrupt: Trio may raise that in
        # whichever task runs, and Hypercorn swallows an exception in a request task.
        stop = trio.Event()
        with trio.open_signal_receiver(*STOP_SIGNALS, *IGNORED_SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(
                    partial(serve_sim, engine, args.bind, shutdown_trigger=stop.wait)
                )
                print(
                    f"narwhal sim: {args.dialect} engine serving {args.model!r} "
                    f"({args.profile}, time scale {args.time_scale:g}"
                    f"{', ledger' if args.ledger else ''}) at {url}",
                    flush=True,
                )
                async for signum in signals:
                    if signum in IGNORED_SIGNALS:
                        print(f"narwhal sim: {signal.Signals(signum).name}: ignored", flush=True)
                        continue
                    stop.set()
                    break

    return run_listening("sim", args.bind, run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
