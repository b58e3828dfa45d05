"""The admission benchmark's virtual-time runs: capacity, trace replay, forced-in reruns, memory.

Each run is one ``trio.run`` under ``MockClock(autojump_threshold=0)`` with a fleet of
:mod:`narwhal.bench.inprocess` (the router in front of simulated engines, no sockets). Trio's
scheduler breaks ties between tasks woken at the same instant at random; the runs seed that
choice (:func:`seed_scheduler`), so a run is a pure function of its inputs and a rerun with one
request forced in diverges from the original only where that request changes something.

What the benchmark needs to see inside the router it reads through the router's own admission
observer seam (:mod:`narwhal.admission.observer`), listened to for the run only
(:func:`_hooks`): each request's projected TTFT at arrival, whether predictive admission refuses
it, and, once it completes, the TTFT the router measured and the one it predicted at placement.
The one *forced* request of a false-refusal rerun is let through whatever its projection by the
router's ``exempt`` hook, which asks whether the request's task carries the forced probe.

The engine time each request was given is read from the simulator itself: a step ledger
(:class:`_Ledger`, set on every engine by :meth:`~narwhal.sim.SimEngine.watch_steps`) records
every step the engines run and charges it to the requests in it
(:func:`~narwhal.bench.goodput.charge_step`); a request's charge inside the replay's measurement
window is its ``engine_work_s``, and the steps give the engines' busy time.

For ``narwhal bench report``, a sampler task (:class:`_Sampler`) reads the router's safety
factor and each engine's drift once per virtual second during every replay.

Each request's task carries its own record in a context variable, which the router's tasks for
that request inherit (Trio copies the spawning task's context), so the observer knows whose
decision it is told.

Every function here takes and returns plain, picklable values, so the runs can go to worker
processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import gc
import logging
import math
import os
import random
import time
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any, Literal, cast

import attrs
import httpx
import orjson
import trio
import trio.testing

from narwhal.admission.observer import Decision, Served
from narwhal.bench import procstat
from narwhal.bench.goodput import (
    ENGINE_BUSY,
    Capacity,
    CostModel,
    Outcome,
    StepRecord,
    Window,
    Work,
    charge_step,
    ledger_rates,
    work_in_window,
)
from narwhal.bench.inprocess import EngineTruth, InProcessFleet, open_fleet
from narwhal.bench.load import StreamTimer, percentile
from narwhal.bench.trace import TraceRequest, load_trace, scale_to_rate, truncate
from narwhal.config import AdmissionConfig, Config, EngineConfig, ServingConfig, UpstreamConfig
from narwhal.scheduling.profiles import get_profile
from narwhal.sim.batching import BatchSeq, BatchStep
from narwhal.sim.calibration import ALIASES
from narwhal.sim.timing import StepTiming
from narwhal.upstream.transport import OneShotBody

__all__ = [
    "MODE_DESCRIPTIONS",
    "CapacityJob",
    "MemoryJob",
    "MemoryResult",
    "ReplayJob",
    "ReplayResult",
    "VirtualSetup",
    "chat_body",
    "measure_capacity",
    "measure_memory",
    "run_replay",
    "seed_scheduler",
]

Mode = Literal["open", "predictive", "queue-cap", "engine-cap"]

MODE_DESCRIPTIONS: dict[str, str] = {
    "predictive": "Narwhal's predictive admission (refuses what its projection puts over budget)",
    "open": "Narwhal open mode: admits everything up to its queue and retention limits",
    "queue-cap": "baseline: open mode with a fixed router queue-length cap (--queue-cap; "
    "default capacity x budget, the requests the pool completes in one budget)",
    "engine-cap": "baseline: vLLM's engine-side admission, --max-num-queued-tokens about "
    "budget x prefill throughput per engine, engines answer 503; the router only balances "
    "(open, its limits lifted)",
}
"""What each benchmark mode is, for the report (JSON and text)."""

_LIFTED = 4096  # the router's limits in engine-cap mode: the engines queue, not the router

_PATH = "/v1/chat/completions"
_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
_ERROR_BODY_LIMIT = 65536


@attrs.frozen
class VirtualSetup:
    """What every virtual-time run of one benchmark shares.

    Attributes:
        router: the router's configuration (its engines are the simulated ones); each run sets
            the admission mode and the budget.
        profile: the router's profile of the engines (its prior), and the simulated engine
            type they run unless ``truth`` says otherwise.
        seed: seeds the engines, the scheduler and the sampling.
        tokens_per_chunk: tokens per streamed chunk after the first (the first goes alone).
        max_tokens: the ``max_tokens`` every request sends (the trace sets the real length).
        trace: the trace's short name.
        duration_s: seconds of trace replayed (trace time); ``None``: all of it.
        truth: how the simulated engines really behave (engine types, a scale, a slowdown during
            each replay), whatever the router's profiles say.
        workers: relay workers under the router as their admission controller
            (:mod:`narwhal.workers`); 1: the router serves in one process.
    """

    router: Config
    profile: str = "h100-llama3-8b"
    seed: int = 0
    tokens_per_chunk: int = 16
    max_tokens: int = 2048
    trace: str = "conv"
    duration_s: float | None = None
    truth: EngineTruth = attrs.field(factory=EngineTruth)
    workers: int = 1

    def rows(self) -> list[TraceRequest]:
        """The trace rows replayed (unscaled)."""
        rows = load_trace(self.trace)
        return rows if self.duration_s is None else truncate(rows, self.duration_s)

    def work(self) -> Work:
        """How requests are weighed in engine work: each engine's true cost (the truth's engine
        type, variation and scale, with the seed each engine of the fleet is built with),
        averaged over the pool (:class:`~narwhal.bench.goodput.Work`). The router's profile
        plays no part.

        Raises:
            ValueError: an engine's truth is not a step-cost model (it has no engine work).
        """
        truth = self.truth
        engines = []
        names = []
        for index, engine in enumerate(self.router.engines):
            kind = truth.engine_type(engine.profile, index)
            timing = truth.timing(kind, seed=self.seed + index)
            if not isinstance(timing, StepTiming):
                raise ValueError(f"engine {engine.name}: {kind!r} has no step costs to weigh")
            # An EngineType (calibrated) or the router's EngineProfile (--engine-truth prior):
            # both have the decode constants StepCosts leaves out.
            engines.append((cast(CostModel, timing.profile), timing.time_scale))
            names.append(kind)
        fastest = min((1.0, *(slowdown.factor for slowdown in truth.slowdowns)))
        return Work(tuple(engines), tuple(names), fastest)

    def config(self, mode: Mode, budget_s: float, *, queue_cap: int | None = None) -> Config:
        """The router's configuration for one run of a benchmark mode.

        ``queue-cap`` is open mode with ``queue_limit`` set to ``queue_cap``; ``engine-cap`` is
        open mode with the router's concurrency, queue and retention limits lifted, so that the
        engines hold the waiting requests and do their own admission.
        """
        admission = self.router.admission
        if mode == "queue-cap":
            if queue_cap is None:
                raise ValueError("queue-cap mode needs a queue cap")
            admission = attrs.evolve(admission, mode="open", queue_limit=queue_cap)
        elif mode == "engine-cap":
            admission = attrs.evolve(
                admission,
                mode="open",
                prefill_concurrency=_LIFTED,
                decode_concurrency=_LIFTED,
                queue_limit=_LIFTED,
                http_retention_limit=2 * _LIFTED,
            )
        else:
            admission = attrs.evolve(admission, mode=mode)
        admission = attrs.evolve(admission, ttft_budget_s=budget_s)
        return attrs.evolve(self.router, admission=admission)

    def engine_caps(self, budget_s: float) -> tuple[int, ...]:
        """``--max-num-queued-tokens`` as an operator would set it for each engine: the budget
        times the prefill throughput they know of it (its router profile's per-token prefill
        rate, ``1000 / b_p`` tokens per second; under a wrong prior, as wrong as the prior)."""
        return tuple(
            max(1, round(budget_s * 1000.0 / get_profile(engine.profile).prefill_per_token_ms))
            for engine in self.router.engines
        )


def default_router(
    engines: int = 2,
    *,
    model: str = "llama-3.1-8b-instruct",
    profile: str = "h100-llama3-8b",
    types: tuple[str, ...] = (),
    tpot_target_s: float = math.inf,
) -> Config:
    """The router the benchmark measures: ``engines`` vLLM engines, the shipped defaults but two.

    Each engine's profile (the router's prior for it) is ``profile``, or with ``types`` the
    router's profile of the same name as the engine's type (``h100`` is ``h100-llama3-8b``).

    ``decode_concurrency`` is the engines' batch size (``max_num_seqs`` of their profile), as
    the docs advise (docs: Admission control, "Choosing the limits"): the shipped 128 is half
    of what the simulated engines batch, and would cap the router below their capacity.

    ``tpot_target_s`` is none (infinite) unless given: the benchmark measures admission
    against the TTFT budget, and its bound is the engines' full-batch capacity. The shipped
    0.1 s holds the batch of an engine whose full batch steps slower than that (an H100-like
    engine twice as slow as its profile is one) below that capacity, for every mode alike:
    a bound no policy that keeps the target can reach.
    """
    batch = get_profile(profile).max_num_seqs
    return Config(
        serving=ServingConfig(model=model),
        admission=AdmissionConfig(decode_concurrency=batch, tpot_target_s=tpot_target_s),
        upstream=UpstreamConfig(read_timeout_s=600),
        engines=tuple(
            EngineConfig(
                name=f"engine-{chr(ord('a') + index)}",
                url=f"http://engine-{chr(ord('a') + index)}.sim",
                profile=ALIASES.get(types[index % len(types)], types[index % len(types)])
                if types
                else profile,
            )
            for index in range(engines)
        ),
    )


def chat_body(model: str, row: TraceRequest, *, max_tokens: int, extra: Any = None) -> bytes:
    """A streaming chat request of the row's exact prompt and output lengths.

    The prompt is four characters per token, which is what the router's estimate assumes
    without a tokenizer, and the simulator's directives fix both lengths exactly.
    """
    directives: dict[str, Any] = {
        "prompt_tokens": row.prompt_tokens,
        "output_tokens": row.output_tokens,
    }
    if extra:
        directives.update(extra)
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "abcd" * row.prompt_tokens}],
            "stream": True,
            "max_tokens": max_tokens,
            "narwhal_sim": directives,
        }
    )


def seed_scheduler(seed: int) -> bool:
    """Seed Trio's tie-breaking among tasks woken together; ``False`` if this Trio has none.

    Trio reverses each batch of runnable tasks at random (so that no order is relied on); its
    generator is module state that Trio seeds itself only under Hypothesis. Seeding it makes a
    virtual-time run reproducible, which the forced-in reruns depend on.
    """
    from trio._core import _run

    generator = getattr(_run, "_r", None)
    if not isinstance(generator, random.Random):
        return False
    generator.seed(seed)
    return True


def _run_virtual(function: Any, seed: int) -> Any:
    seed_scheduler(seed)
    return trio.run(function, clock=trio.testing.MockClock(autojump_threshold=0))


# -- the hooks ----------------------------------------------------------------------------------


@attrs.define
class _Probe:
    """What the hooks saw of one request."""

    forced: bool = False
    projected_ttft_s: float | None = None
    would_refuse: bool = False
    router_ttft_s: float | None = None
    placement_ttft_s: float | None = None
    ran: bool = False  # it reached an engine's step loop (the ledger has an account of it)
    work_s: float = 0.0  # engine time the ledger charged it inside the window


_PROBE: contextvars.ContextVar[_Probe | None] = contextvars.ContextVar(
    "narwhal_bench_probe", default=None
)
# The same probes by their request's id: relay workers' controller decides in its own tasks,
# which do not carry the request's context (``workers`` > 1).
_PROBES: weakref.WeakValueDictionary[str, _Probe] = weakref.WeakValueDictionary()


def _probe_of(request_id: str) -> _Probe | None:
    probe = _PROBE.get()
    return _PROBES.get(request_id) if probe is None else probe


class _Recorder:
    """An admission observer (:mod:`narwhal.admission.observer`) that writes into each
    request's probe: its projection at arrival, whether predictive admission refuses it, the
    TTFT the router measured and the one it predicted at placement."""

    def decided(self, decision: Decision) -> None:
        probe = _probe_of(decision.request_id)
        if probe is None or decision.projection is None:
            return
        probe.projected_ttft_s = decision.projection.typical_s
        if probe.forced and decision.would_refuse:
            probe.would_refuse = True  # forced in all the same (the router's exempt hook)

    def served(self, decision: Decision, served: Served) -> None:
        probe = _probe_of(decision.request_id)
        ttft = served.ttft_s
        if probe is None or ttft is None:
            return
        probe.router_ttft_s = ttft
        ratio = served.placement_error
        if ratio is not None and ratio > 0:
            probe.placement_ttft_s = ttft / ratio


def _forced(request_id: str) -> bool:
    probe = _probe_of(request_id)
    return probe is not None and probe.forced


@contextlib.contextmanager
def _hooks(fleet: InProcessFleet) -> Iterator[None]:
    router = fleet.router
    exempt, router.exempt = router.exempt, _forced
    try:
        with router.observers.watching(_Recorder()):
            yield
    finally:
        router.exempt = exempt


# -- the ledger ---------------------------------------------------------------------------------


class _Ledger:
    """The fleet's account of engine time: every step the engines run (:class:`StepRecord`,
    seconds from ``origin``) and, with a ``window``, each request's charge inside it, added to
    the probe of the task that submitted it (the request's own context, inherited by the
    router's tasks for it). Steps and charges of requests without a probe (the router's
    profiling probes) count in the steps only."""

    def __init__(self, origin: float, window: Window | None) -> None:
        self.steps: list[StepRecord] = []
        self.origin = origin
        self.window = window
        self.owners: weakref.WeakKeyDictionary[BatchSeq, _Probe] = weakref.WeakKeyDictionary()


class _EngineLedger:
    """One engine's :class:`~narwhal.sim._steps.StepLedger`, charging by its own costs."""

    def __init__(self, ledger: _Ledger, costs: CostModel) -> None:
        self._ledger = ledger
        self._costs = costs

    def submitted(self, seq: BatchSeq, request_id: str | None) -> None:
        # The request's own task context says whose it is; its X-Request-Id is not needed.
        probe = _PROBE.get()
        if probe is not None:
            probe.ran = True
            self._ledger.owners[seq] = probe

    def stepped(self, step: BatchStep, start: float, duration_s: float) -> None:
        ledger = self._ledger
        charges = charge_step(self._costs, step, duration_s)
        at = start - ledger.origin
        ledger.steps.append(StepRecord(at, duration_s, sum(charge for _, charge in charges)))
        window = ledger.window
        share = 0.0 if window is None else window.share(at, duration_s)
        if share:
            owners = ledger.owners
            for seq, charge in charges:
                probe = owners.get(seq)
                if probe is not None:
                    probe.work_s += charge * share


@contextlib.contextmanager
def _ledgered(fleet: InProcessFleet, ledger: _Ledger) -> Iterator[_Ledger]:
    """``ledger`` on every engine of the fleet while the block runs.

    Raises:
        ValueError: an engine has no step loop (a per-request timing model: no steps to count).
    """
    engines = list(fleet.engines.values())
    try:
        for engine in engines:
            costs = cast(CostModel, getattr(engine.timing, "profile", None))
            if costs is None or not engine.watch_steps(_EngineLedger(ledger, costs)):
                raise ValueError(f"engine {engine.name}: no step loop to keep a ledger of")
        yield ledger
    finally:
        for engine in engines:
            engine.watch_steps(None)


def _replay_window(rows: list[TraceRequest], warmup_fraction: float) -> Window:
    """The measurement window of a replay of ``rows`` (as :meth:`Window.of` its outcomes)."""
    if not rows:
        return Window(0.0, 0.0)
    first = min(row.arrival_s for row in rows)
    last = max(row.arrival_s for row in rows)
    return Window(first + (last - first) * warmup_fraction, last)


# -- one request --------------------------------------------------------------------------------


async def _send(
    fleet: InProcessFleet,
    row: TraceRequest,
    body: bytes,
    origin: float,
    sink: dict[int, Outcome],
    probe: _Probe | None = None,
) -> None:
    """Send one request at once and record its :class:`Outcome` in ``sink``, even if cut.

    ``probe`` (default: a new one) collects what the hooks see of the request.
    """
    probe = _Probe() if probe is None else probe
    _PROBE.set(probe)  # this task's context, inherited by the router's tasks for the request
    sent = trio.current_time()
    timer = StreamTimer(row.index, sent)
    status, code = 0, None

    def record(error: str | None, *, finished: bool) -> None:
        result = timer.finish(trio.current_time()) if finished else timer.fail(error or "cut")
        sink[row.index] = Outcome(
            index=row.index,
            arrival_s=sent - origin,
            prompt_tokens=row.prompt_tokens,
            output_tokens=row.output_tokens,
            status=status,
            code=code if code is not None else result.error,
            ttft_s=result.ttft_s,
            end_s=None if result.e2e_s is None else sent + result.e2e_s - origin,
            projected_ttft_s=probe.projected_ttft_s,
            placement_ttft_s=probe.placement_ttft_s,
            router_ttft_s=probe.router_ttft_s,
        )

    # Sent once and let go: a client waiting for its answer holds no prompt, so the memory
    # measurement sees the router's share, not the load generator's.
    content = OneShotBody(body)
    request_id = f"bench-{id(probe):x}-{row.index}"
    _PROBES[request_id] = probe
    headers = {**_HEADERS, "content-length": str(len(body)), "x-request-id": request_id}
    del body
    try:
        async with fleet.client.stream("POST", _PATH, content=content, headers=headers) as response:
            status = response.status_code
            if status != 200:
                code = _error_code(await response.aread())
                record(code, finished=False)
                return
            async for chunk in response.aiter_raw():
                timer.feed(chunk, trio.current_time())
            record(None, finished=True)
    except httpx.HTTPError as exc:
        record(type(exc).__name__, finished=False)
    except BaseException:
        record("cut", finished=False)  # the run ended before this request did
        raise


_SETTLE_S = 1.0
"""How long (virtual) a replay through relay workers waits for their last messages to reach
the controller before it reads the books."""

_PER_REQUEST_LOGGERS = ("narwhal.upstream.exchange", "narwhal.web.completions")


@contextlib.contextmanager
def _router_warnings_quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _PER_REQUEST_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _error_code(raw: bytes) -> str:
    try:
        error = orjson.loads(raw[:_ERROR_BODY_LIMIT]).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return "unknown"
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code else "unknown"


# -- capacity -----------------------------------------------------------------------------------


@attrs.frozen
class CapacityJob:
    """A closed loop at saturation, through the router in ``open`` mode with its limits lifted.

    The loop sends the trace's own rows, in a seeded shuffled order, each once per pass, so
    what it offers is the trace's mix. Its first wave starts at once, and its short requests
    end first: the warm-up lasts until every request of that wave has ended, so the window
    does not see a mix favouring short requests, and the window lasts until it has completed
    ``passes`` times the trace's rows. The requests in flight then finish. The engine time the
    step ledger charged inside the window, per second, is what the engines deliver saturated
    (:attr:`Capacity.engine_s_per_s`, beside the engines' count, the engine-time bound's
    capacity); the cost model's work rate over the trace's mean is the load axis
    (:attr:`Capacity.rps`). The truth's slowdowns are in force from the start, so
    the loop measures the engines in that state.

    Attributes:
        setup: the shared setup.
        concurrency: requests kept in flight (default: 1.25 times what the engines' batches
            hold, so their waiting queues never run dry).
        warmup_s: least virtual seconds before the measurement starts.
        window_s: least virtual seconds measured.
        passes: least completions in the window, in passes over the trace's rows.
        max_s: most virtual seconds the loop runs, warm-up and window together (a stop for
            engines too slow to complete the passes).
    """

    setup: VirtualSetup
    concurrency: int | None = None
    warmup_s: float = 30.0
    window_s: float = 90.0
    passes: float = 1.0
    max_s: float = 3600.0

    def effective_concurrency(self) -> int:
        """The concurrency the loop keeps."""
        if self.concurrency is not None:
            return self.concurrency
        profile = get_profile(self.setup.profile)
        return int(len(self.setup.router.engines) * profile.max_num_seqs * 1.25)


def measure_capacity(job: CapacityJob) -> Capacity:
    """Run the closed loop and return the engines' capacity."""
    return _run_virtual(partial(_capacity, job), job.setup.seed)  # type: ignore[no-any-return]


async def _capacity(job: CapacityJob) -> Capacity:
    setup = job.setup
    concurrency = job.effective_concurrency()
    lifted = attrs.evolve(
        setup.router.admission,
        mode="open",
        prefill_concurrency=concurrency,
        decode_concurrency=concurrency,
        queue_limit=concurrency,
        http_retention_limit=2 * concurrency,
    )
    config = attrs.evolve(setup.router, admission=lifted)
    rows = setup.rows()
    order = list(rows)
    random.Random(setup.seed).shuffle(order)
    work = setup.work()
    outcomes: dict[int, Outcome] = {}
    batches: list[float] = []
    bounds: list[float] = []  # [start, stop] of the window, once known
    # The truth's slowdowns are in force from the start (span 0): the loop measures the
    # engines in that state (the benchmark measures one loop per state of a replay).
    async with open_fleet(
        config,
        truth=setup.truth,
        span_s=0.0,
        seed=setup.seed,
        tokens_per_chunk=setup.tokens_per_chunk,
    ) as fleet:
        origin = trio.current_time()
        ledger = _Ledger(origin, None)
        numbers = iter(range(1 << 62))

        async def worker() -> None:
            for number in numbers:
                if bounds:  # the window has closed: what is in flight finishes, no more
                    return
                row = attrs.evolve(order[number % len(order)], index=number)
                body = chat_body(config.serving.model, row, max_tokens=setup.max_tokens)
                await _send(fleet, row, body, origin, outcomes)

        def ended_in_window(start: float) -> int:
            return sum(
                1
                for o in outcomes.values()
                if o.completed and o.end_s is not None and o.end_s >= start
            )

        async def measure(cancel: trio.CancelScope) -> None:
            start: float | None = None
            target = job.passes * len(rows)
            while (now := trio.current_time() - origin) < job.max_s:
                if start is None:
                    first_wave_ended = all(number in outcomes for number in range(concurrency))
                    if now >= job.warmup_s and first_wave_ended:
                        start = now
                else:
                    if now - start >= job.window_s and ended_in_window(start) >= target:
                        break
                    running = [e.statistics().running for e in fleet.engines.values()]
                    batches.append(sum(running) / len(running))
                await trio.sleep(1.0)
            now = trio.current_time() - origin
            bounds.extend((now if start is None else start, now))
            # The requests in flight finish (their work inside the window counts), within the
            # loop's time limit.
            cancel.deadline = trio.current_time() + job.max_s

        with _ledgered(fleet, ledger):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(measure, nursery.cancel_scope)
                for _ in range(concurrency):
                    nursery.start_soon(worker)
        fleet.nursery.cancel_scope.cancel()
    start, stop = bounds
    window = max(stop - start, 1e-9)
    done = [
        o
        for o in outcomes.values()
        if o.completed and o.end_s is not None and start <= o.end_s <= stop
    ]
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    trace_mean = work.mean(rows)
    done_mean = work.mean(done) if done else None
    # The load axis: the cost model's work rate over the trace's mean (the mix the window
    # completed does not matter). The engine time: the ledger's, as goodput reads it.
    model_rate = work_in_window(work, outcomes.values(), Window(start, stop)) / window
    busy, charged = ledger_rates(ledger.steps, Window(start, stop))
    parts = _parts(start, stop)
    noise = _relative_error([ledger_rates(ledger.steps, part)[1] for part in parts])
    model_noise = _relative_error(
        [work_in_window(work, outcomes.values(), part) / part.length_s for part in parts]
    )
    return Capacity(
        rps=model_rate / trace_mean if trace_mean > 0 else len(done) / window,
        engine_s_per_s=charged,
        engines=len(setup.router.engines),
        busy_s_per_s=busy,
        model_s_per_s=model_rate,
        model_noise=model_noise,
        window_s=window,
        completed=len(done),
        concurrency=concurrency,
        mean_batch=sum(batches) / len(batches) if batches else None,
        ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        warmup_s=start,
        completed_rps=len(done) / window,
        mix=None if done_mean is None or trace_mean <= 0 else done_mean / trace_mean,
        noise=noise,
    )


_NOISE_PARTS = 6


def _parts(start: float, stop: float) -> list[Window]:
    """Six equal parts of the window (none when it is empty)."""
    step = (stop - start) / _NOISE_PARTS
    if step <= 0:
        return []
    return [Window(start + i * step, start + (i + 1) * step) for i in range(_NOISE_PARTS)]


def _relative_error(rates: list[float]) -> float:
    """A rate's own noise: the standard error of its values over the window's six parts (batch
    means), relative to their mean."""
    if len(rates) < 2:
        return 0.0
    mean = sum(rates) / len(rates)
    if mean <= 0:
        return 0.0
    variance = sum((rate - mean) ** 2 for rate in rates) / (len(rates) - 1)
    return float((variance / len(rates)) ** 0.5 / mean)


# -- replay -------------------------------------------------------------------------------------


@attrs.frozen
class ReplayJob:
    """One open-loop replay of the trace.

    Attributes:
        setup: the shared setup.
        mode: the router's admission mode.
        rate: the offered mean rate, requests per second (the trace's time axis is scaled).
        budget_s: the TTFT budget.
        forced: the trace index of a request forced in (exempt from predictive refusal); the
            run then stops ``horizon_s`` after that request's arrival, plus the budget, so
            that every request arriving up to ``horizon_s`` after it has had its budget.
        horizon_s: how long after the forced request's arrival the requests it may have
            displaced are watched (:func:`~narwhal.bench.goodput.displaced`): its own answer
            (0), or the queue behind it too.
        queue_cap: the router's queue cap (``queue-cap`` mode).
        max_num_queued_tokens: each engine's engine-side cap (``engine-cap`` mode).
        warmup_fraction: share of the replay's span before its measurement window (the
            window the ledger charges requests in).
    """

    setup: VirtualSetup
    mode: Mode
    rate: float
    budget_s: float
    forced: int | None = None
    horizon_s: float = 0.0
    queue_cap: int | None = None
    max_num_queued_tokens: tuple[int, ...] = ()
    warmup_fraction: float = 0.2


@attrs.frozen
class ReplayResult:
    """What a replay returns.

    Attributes:
        outcomes: every request's outcome, in trace order (a forced-in rerun: those sent before
            it stopped).
        books: the router's counters at the end.
        wall_s: wall-clock seconds.
        virtual_s: virtual seconds from the first arrival to the end.
        forced_ttft_s: the forced request's TTFT (``None``: none within its budget).
        forced_would_refuse: the forced request's projection was over budget again.
        deterministic: the scheduler was seeded.
        samples: the router's state once per virtual second (:class:`_Sampler`); ``None`` for
            a forced-in rerun.
        window: the measurement window, from the replay's origin (each outcome's
            ``engine_work_s`` is its charge inside it).
        steps: the ledger's steps, every engine's (:class:`StepRecord`; empty for a forced-in
            rerun).
    """

    outcomes: tuple[Outcome, ...]
    books: dict[str, int]
    wall_s: float
    virtual_s: float
    forced_ttft_s: float | None = None
    forced_would_refuse: bool | None = None
    deterministic: bool = True
    samples: dict[str, Any] | None = None
    window: Window | None = None
    steps: tuple[StepRecord, ...] = ()


_SAMPLE_EVERY_S = 1.0


class _Sampler:
    """The router's state over a replay, for ``narwhal bench report``: every virtual second, the
    safety factor (``router.margin.factor``) and each engine's drift ratios; its drift states
    as the times they changed.

    It runs in every replay, forced-in reruns included: its wake-ups are scheduler batches, and
    a rerun must draw the same seeded tie-breaks as the run it reruns.
    """

    def __init__(self, fleet: InProcessFleet, origin: float) -> None:
        self._router = fleet.router
        self._origin = origin
        self._t: list[float] = []
        self._factor: list[float] = []
        self._engines: dict[str, dict[str, list[Any]]] = {
            engine.config.name: {"ttft": [], "tpot": [], "states": []}
            for engine in self._router.pool
        }

    async def run(self) -> None:
        while True:
            self.sample()
            await trio.sleep(_SAMPLE_EVERY_S)

    def sample(self) -> None:
        now = round(trio.current_time() - self._origin, 2)
        self._t.append(now)
        self._factor.append(round(self._router.margin.factor, 3))
        for engine in self._router.pool:
            drift = engine.drift.statistics()
            series = self._engines[engine.config.name]
            series["ttft"].append(round(drift.ttft, 3))
            series["tpot"].append(round(drift.tpot, 3))
            states = series["states"]
            if not states or states[-1][1] != drift.state:
                states.append([now, drift.state])

    def as_json(self) -> dict[str, Any]:
        return {"t_s": self._t, "safety_factor": self._factor, "engines": self._engines}


def run_replay(job: ReplayJob) -> ReplayResult:
    """Replay the trace at ``job.rate`` in ``job.mode``.

    The router's warnings about single requests (an engine's 503 in ``engine-cap`` mode, for
    every refused request) are held back for the run: the outcomes count them; its errors
    still show.
    """
    started = time.perf_counter()
    deterministic = seed_scheduler(job.setup.seed)
    with _router_warnings_quiet():
        result: ReplayResult = trio.run(
            partial(_replay, job), clock=trio.testing.MockClock(autojump_threshold=0)
        )
    return attrs.evolve(result, wall_s=time.perf_counter() - started, deterministic=deterministic)


async def _replay(job: ReplayJob) -> ReplayResult:
    setup = job.setup
    config = setup.config(job.mode, job.budget_s, queue_cap=job.queue_cap)
    caps = job.max_num_queued_tokens if job.mode == "engine-cap" else ()
    if job.mode == "engine-cap" and not caps:
        caps = setup.engine_caps(job.budget_s)
    rows = scale_to_rate(setup.rows(), job.rate)
    forced_row = next((row for row in rows if row.index == job.forced), None)
    outcomes: dict[int, Outcome] = {}
    forced_probe = _Probe(forced=True)
    probes = {row.index: forced_probe if row is forced_row else _Probe() for row in rows}
    window = _replay_window(rows, job.warmup_fraction)
    async with open_fleet(
        config,
        truth=setup.truth,
        span_s=rows[-1].arrival_s if rows else 0.0,
        seed=setup.seed,
        tokens_per_chunk=setup.tokens_per_chunk,
        max_num_queued_tokens=caps,
        workers=setup.workers,
    ) as fleet:
        origin = trio.current_time()
        with _hooks(fleet), _ledgered(fleet, _Ledger(origin, window)) as ledger:
            stop_at = float("inf")
            if forced_row is not None:
                stop_at = origin + forced_row.arrival_s + job.horizon_s + job.budget_s
            sampler = _Sampler(fleet, origin)
            async with trio.open_nursery() as sampling:
                sampling.start_soon(sampler.run)
                with trio.move_on_at(stop_at):
                    async with trio.open_nursery() as nursery:
                        for row in rows:
                            await trio.sleep_until(origin + row.arrival_s)
                            body = chat_body(config.serving.model, row, max_tokens=setup.max_tokens)
                            probe = probes[row.index]
                            nursery.start_soon(_send, fleet, row, body, origin, outcomes, probe)
                sampler.sample()  # the state at the end
                sampling.cancel_scope.cancel()
            virtual_s = trio.current_time() - origin
            if setup.workers > 1:  # the workers' last messages are still on their way
                with trio.move_on_after(_SETTLE_S):
                    while fleet.router.accounting.in_flight:  # noqa: ASYNC110 - books, not an event
                        await trio.sleep(0.001)
            books = fleet.router.statistics().accounting.as_json()
            if caps:
                books["engine_rejections"] = sum(
                    getattr(engine.statistics(), "rejected_queued_tokens", 0)
                    for engine in fleet.engines.values()
                )
        fleet.nursery.cancel_scope.cancel()
    outcomes = {
        index: attrs.evolve(
            _engine_busy(outcome) if caps else outcome,
            engine_work_s=probes[index].work_s if probes[index].ran else None,
            # What the router learnt after the client had its answer (relay workers tell
            # their controller a moment later).
            router_ttft_s=probes[index].router_ttft_s,
            placement_ttft_s=probes[index].placement_ttft_s,
        )
        for index, outcome in outcomes.items()
    }
    forced_ttft: float | None = None
    would_refuse: bool | None = None
    if forced_row is not None:
        outcome = outcomes.get(forced_row.index)
        forced_ttft = None if outcome is None else outcome.ttft_s
        if forced_ttft is not None and forced_ttft > job.budget_s:
            forced_ttft = None
        would_refuse = forced_probe.would_refuse
    return ReplayResult(
        outcomes=_with_idle_ttft(fleet, outcomes),
        books=books,
        wall_s=0.0,
        virtual_s=virtual_s,
        forced_ttft_s=forced_ttft,
        forced_would_refuse=would_refuse,
        samples=sampler.as_json() if forced_row is None else None,
        window=window,
        steps=tuple(ledger.steps) if forced_row is None else (),
    )


def _engine_busy(outcome: Outcome) -> Outcome:
    """In engine-cap mode, the engines' 503 (their own admission refusing; the router, having
    tried another engine, passes it on as 502 ``engine_error``) is the engines' refusal: its
    code becomes ``engine_busy``, a request not admitted. The simulated engines fail no other
    way in this benchmark."""
    if outcome.status == 502 and outcome.code == "engine_error":
        return attrs.evolve(outcome, code=ENGINE_BUSY)
    return outcome


def _with_idle_ttft(fleet: InProcessFleet, outcomes: dict[int, Outcome]) -> tuple[Outcome, ...]:
    """The outcomes in trace order, each with its first token alone on the fastest idle engine.

    The engines' own timing answers (their true behaviour, whatever the router was told), so
    the bound can leave out the requests no policy could have served in budget.
    """
    engines = list(fleet.engines.values())
    idle: dict[int, float | None] = {}
    result = []
    for index in sorted(outcomes):
        outcome = outcomes[index]
        tokens = outcome.prompt_tokens
        if tokens not in idle:
            delays = [engine.timing.first_token_delay_s(tokens) for engine in engines]
            idle[tokens] = min(delays) if delays else None
        result.append(attrs.evolve(outcome, idle_ttft_s=idle[tokens]))
    return tuple(result)


# -- memory -------------------------------------------------------------------------------------


@attrs.frozen
class MemoryJob:
    """Hold ``retained`` requests in the router, ``queued`` of them in its admission queue.

    The engines stall every stream after its first token (the ``stall`` fault directive), so
    the requests placed on them stay in the router, relaying, and the rest wait in the queue.

    Attributes:
        setup: the shared setup (its router's limits are set to hold exactly this).
        retained: requests held at once (``http_retention_limit``).
        queued: of those, in the admission queue (``queue_limit``).
        warmup: requests served to completion first, so that what is allocated once (imports,
            caches, pools) is in the baseline.
    """

    setup: VirtualSetup
    retained: int = 1024
    queued: int = 256
    warmup: int = 64


@attrs.frozen
class MemoryResult:
    """Resident memory before and while holding the load (bytes).

    Attributes:
        before: ``VmRSS`` with the router idle after the warm-up.
        holding: ``VmRSS`` while every request is held.
        retained: requests held (the retention slots in use).
        queued: requests in the admission queue.
        placed: requests on the engines.
    """

    before: int
    holding: int
    retained: int
    queued: int
    placed: int

    @property
    def added(self) -> int:
        """What holding the load added."""
        return self.holding - self.before

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {**attrs.asdict(self), "added": self.added}


# How long (virtual seconds) the memory run may take to hold every request: far more than the
# engines need to take their share; past it, something keeps them from filling.
_MEMORY_FILL_S = 600.0


def measure_memory(job: MemoryJob) -> MemoryResult:
    """Fill the router's retention and queue limits and measure this process's resident memory.

    The engines and the client run in the same process, so the figure includes their share of
    each request: it overstates the router's own.
    """
    return _run_virtual(partial(_memory, job), job.setup.seed)  # type: ignore[no-any-return]


def _rss() -> int:
    """This process's resident memory, of live objects: what the collector and the C heap
    have freed is given back to the system first (glibc keeps freed heap pages otherwise, and
    the bodies already read and let go would count)."""
    gc.collect()
    _trim_heap()
    return procstat.memory(os.getpid()).rss_bytes


def _trim_heap() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)


async def _memory(job: MemoryJob) -> MemoryResult:
    setup = job.setup
    engines = len(setup.router.engines)
    placed = job.retained - job.queued
    per_engine = -(-placed // engines)
    admission = attrs.evolve(
        setup.router.admission,
        mode="open",
        http_retention_limit=job.retained,
        queue_limit=job.queued,
        prefill_concurrency=per_engine,
        decode_concurrency=per_engine,
        admission_wait_s=3600.0,
        # Every placed request is to be held, however large the batches: the TPOT target would
        # keep a batch below ``per_engine`` (with the decode step's batch slope fitted by
        # profiling, it does), and the queue would never fill.
        tpot_target_s=math.inf,
    )
    config = attrs.evolve(
        setup.router,
        admission=admission,
        serving=attrs.evolve(setup.router.serving, request_deadline_s=7200.0),
        upstream=attrs.evolve(setup.router.upstream, read_timeout_s=7200.0),
    )
    rows = setup.rows()
    model = config.serving.model
    sink: dict[int, Outcome] = {}
    async with open_fleet(
        config, truth=setup.truth, seed=setup.seed, tokens_per_chunk=setup.tokens_per_chunk
    ) as fleet:
        origin = trio.current_time()
        async with trio.open_nursery() as nursery:
            for row in rows[: job.warmup]:
                body = chat_body(model, row, max_tokens=setup.max_tokens)
                nursery.start_soon(_send, fleet, row, body, origin, sink)
        before = _rss()
        stall = {"fault": "stall", "fault_at": 1}
        async with trio.open_nursery() as nursery:
            for number in range(job.retained):
                row = attrs.evolve(rows[number % len(rows)], index=len(rows) + number)
                body = chat_body(model, row, max_tokens=setup.max_tokens, extra=stall)
                nursery.start_soon(_send, fleet, row, body, origin, sink)
            router = fleet.router
            filled_by = trio.current_time() + _MEMORY_FILL_S
            while True:
                stats = router.statistics()
                held = sum(e.prefill + e.decode for e in stats.engines)
                if stats.retention.in_use >= job.retained and stats.queue.depth >= job.queued:
                    break
                if trio.current_time() > filled_by:
                    raise RuntimeError(
                        f"the memory run did not fill in {_MEMORY_FILL_S:g} virtual seconds: "
                        f"{stats.retention.in_use} of {job.retained} retained, "
                        f"{stats.queue.depth} of {job.queued} queued, {held} placed"
                    )
                await trio.sleep(0.01)
            holding = _rss()
            result = MemoryResult(
                before=before,
                holding=holding,
                retained=stats.retention.in_use,
                queued=stats.queue.depth,
                placed=held,
            )
            nursery.cancel_scope.cancel()
        fleet.nursery.cancel_scope.cancel()
    return result
