"""``narwhal bench admission``: predictive admission against the engines' capacity, in virtual time.

The router and two simulated engines run in one process under Trio's ``MockClock``
(:mod:`narwhal.bench.replay`), seeded, so the Azure conversation trace replays in the CPU time
its requests cost, reproducibly, free of machine noise. The benchmark:

1. measures the engines' **capacity**: a closed loop at saturation with the trace's own rows
   (each once per pass, seeded order), through the router in ``open`` mode with its limits
   lifted, from the end of its first wave until it has completed a pass over the trace;
2. **replays** the trace open-loop at multiples of that capacity (its time axis scaled), once in
   ``predictive`` mode and once in ``open`` mode, same seed;
3. forces a sample of each predictive run's **refused** requests in, one rerun each, to see
   whether they would have met the budget without pushing the requests around them out of
   theirs (false refusals, :func:`narwhal.bench.goodput.displaced`);
4. fills the router's retention and queue limits and measures the **memory** they add;

and prints the figures, the quality bar's verdicts (:func:`narwhal.bench.goodput.evaluate`) and
the wall times. The verdict is ``PASS`` only when every target was checked and passed: a target
whose figure was not measured (its load not run, no memory measurement) is ``NOT RUN`` and the
whole run ``INCOMPLETE``; the command's exit status is then 1, as for a failure. Independent
runs go to worker processes (``jobs``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import multiprocessing
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from narwhal.bench.admission_report import AdmissionReport, SeedsReport
from narwhal.bench.goodput import (
    Bar,
    Capacity,
    CapacityPhase,
    FalseRefusals,
    ReplayFigures,
    displaced,
    evaluate,
    replay_figures,
)
from narwhal.bench.inprocess import Slowdown, engine_cap_supported
from narwhal.bench.procstat import environment
from narwhal.bench.replay import (
    MODE_DESCRIPTIONS,
    CapacityJob,
    MemoryJob,
    MemoryResult,
    ReplayJob,
    ReplayResult,
    VirtualSetup,
    measure_capacity,
    measure_memory,
    run_replay,
)
from narwhal.bench.trace import mean_rate, span_s

__all__ = [
    "DEFAULT_LOADS",
    "AdmissionSettings",
    "capacity_phases",
    "default_modes",
    "queue_cap_for",
    "run_admission",
    "run_seeds",
    "sample_refusals",
    "with_engine_time",
]

Echo = Callable[[str], None]
T = TypeVar("T")
R = TypeVar("R")

DEFAULT_LOADS = (0.5, 1.0, 2.0, 3.0)

_HORIZON_BUDGETS = 5.0
"""A forced-in rerun watches the requests arriving up to this many budgets after the forced one:
the queue it joined (on the code trace at 0.5x, the requests it pushed out of their budget
arrived up to 10 s after it at a 2 s budget)."""
MODES = ("predictive", "open", "queue-cap", "engine-cap")
"""Every mode the benchmark runs (:data:`~narwhal.bench.replay.MODE_DESCRIPTIONS`)."""


def default_modes() -> tuple[str, ...]:
    """The modes run by default: all of them, ``engine-cap`` where the simulator has it."""
    return MODES if engine_cap_supported() else tuple(m for m in MODES if m != "engine-cap")


@attrs.frozen
class AdmissionSettings:
    """Everything that shapes a run of the admission benchmark.

    Attributes:
        setup: the router, engines, trace and seed shared by every run.
        loads: offered loads, as multiples of the measured capacity.
        modes: admission modes compared (``predictive`` carries the verdicts; the baselines
            ``queue-cap`` and ``engine-cap`` are what it must beat).
        budget_s: the TTFT budget (``admission.ttft_budget_s``).
        queue_cap: the router's queue cap in ``queue-cap`` mode (``None``: the requests the
            pool completes in one budget, ``ceil(capacity.rps * budget_s)``).
        max_num_queued_tokens: every engine's cap in ``engine-cap`` mode (``None``: per engine,
            the budget times its prefill throughput, :meth:`VirtualSetup.engine_caps`).
        capacity: a capacity to use instead of measuring one.
        capacity_warmup_s: least virtual seconds of the capacity loop before measuring (it
            also waits for the loop's first wave to end).
        capacity_window_s: least virtual seconds measured (it also waits for
            ``capacity_passes`` passes over the trace's rows to complete).
        capacity_passes: least completions in the capacity window, in passes over the trace.
        warmup_fraction: share of each replay's span left out of its goodput window.
        false_refusal_samples: refused requests forced in per load (predictive runs), by
            load; a load not listed takes ``false_refusal_default``.
        false_refusal_default: the sample size of loads not in ``false_refusal_samples``.
        false_refusal_horizon_s: how long after a forced-in request its rerun watches the
            requests behind it, whose in-budget work it may have taken (``None``: five
            budgets).
        memory: whether to measure the memory bar.
        jobs: worker processes (1: everything in this process).
        bar: the targets.
    """

    setup: VirtualSetup
    loads: tuple[float, ...] = DEFAULT_LOADS
    modes: tuple[str, ...] = attrs.field(factory=default_modes)
    budget_s: float = 2.0
    queue_cap: int | None = None
    max_num_queued_tokens: int | None = None
    capacity: Capacity | None = None
    capacity_warmup_s: float = 30.0
    capacity_window_s: float = 90.0
    capacity_passes: float = 1.0
    warmup_fraction: float = 0.2
    false_refusal_samples: tuple[tuple[float, int], ...] = ((0.5, 50),)
    false_refusal_default: int = 3
    false_refusal_horizon_s: float | None = None
    memory: bool = True
    jobs: int = 1
    bar: Bar = attrs.field(factory=Bar)

    @property
    def horizon_s(self) -> float:
        """How long after a forced-in request its rerun watches the requests behind it."""
        horizon = self.false_refusal_horizon_s
        return _HORIZON_BUDGETS * self.budget_s if horizon is None else horizon

    def samples_at(self, load: float) -> int:
        """How many refused requests to force in at ``load``."""
        return dict(self.false_refusal_samples).get(load, self.false_refusal_default)

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        setup = self.setup
        admission = attrs.asdict(setup.router.admission)
        if math.isinf(admission["tpot_target_s"]):
            admission["tpot_target_s"] = None  # none: JSON has no infinity
        return {
            "trace": setup.trace,
            "duration_s": setup.duration_s,
            "profile": setup.profile,
            "engines": len(setup.router.engines),
            "engine_profiles": [engine.profile for engine in setup.router.engines],
            "engine_truth": setup.truth.as_json(),
            "seed": setup.seed,
            "tokens_per_chunk": setup.tokens_per_chunk,
            "max_tokens": setup.max_tokens,
            "admission": admission,
            "loads": list(self.loads),
            "modes": list(self.modes),
            "mode_descriptions": {mode: MODE_DESCRIPTIONS[mode] for mode in self.modes},
            "queue_cap": self.queue_cap,
            "max_num_queued_tokens": self.max_num_queued_tokens,
            "budget_s": self.budget_s,
            "capacity_given": self.capacity is not None,
            "capacity_warmup_s": self.capacity_warmup_s,
            "capacity_window_s": self.capacity_window_s,
            "capacity_passes": self.capacity_passes,
            "warmup_fraction": self.warmup_fraction,
            "false_refusal_samples": {str(load): self.samples_at(load) for load in self.loads},
            "false_refusal_horizon_s": self.horizon_s,
            "memory": self.memory,
            "jobs": self.jobs,
            "bar": attrs.asdict(self.bar),
        }


# -- running ------------------------------------------------------------------------------------


def _map(function: Callable[[T], R], jobs: Sequence[T], workers: int) -> list[R]:
    """``function`` over ``jobs``, in worker processes when ``workers`` > 1 (results in order).

    Every run builds its own fleet and seeds its own scheduler, so a worker may run several.
    """
    if workers <= 1 or len(jobs) <= 1:
        return [function(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)), mp_context=context
    ) as pool:
        return list(pool.map(function, jobs))


def _in_fresh_process(function: Callable[[T], R], job: T) -> R:
    """``function(job)`` in a new interpreter (a memory measurement starts clean)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, job).result()


def sample_refusals(refused: Sequence[int], samples: int, *, seed: int, key: str) -> list[int]:
    """A seeded uniform sample of ``samples`` of the ``refused`` trace indices, sorted.

    ``key`` (the load, say) makes each load's sample independent of the others'.
    """
    if samples <= 0 or not refused:
        return []
    rng = random.Random(f"{seed}:{key}")
    return sorted(rng.sample(list(refused), min(samples, len(refused))))


def run_admission(settings: AdmissionSettings, *, echo: Echo = print) -> AdmissionReport:
    """Run the whole benchmark and return its report."""
    started = time.perf_counter()
    walls: dict[str, float] = {}
    setup = settings.setup
    rows = setup.rows()
    trace_info = {
        "name": setup.trace,
        "requests": len(rows),
        "span_s": span_s(rows),
        "mean_rate": mean_rate(rows),
    }
    echo(
        f"trace {setup.trace}: {len(rows)} requests over {span_s(rows):.0f} s of trace "
        f"({mean_rate(rows):.2f} req/s)"
    )

    phase = time.perf_counter()
    capacity = settings.capacity
    if capacity is None:
        echo(
            f"capacity: closed loop through the router (open, limits lifted), at least "
            f"{settings.capacity_warmup_s:g} s warm-up (until the first wave has ended) + "
            f"{settings.capacity_window_s:g} s measured (until {settings.capacity_passes:g} "
            "pass of the trace has completed; virtual)"
        )
        capacity = _measure_capacity(settings, echo)
    else:
        capacity = with_engine_time(capacity, setup)
    walls["capacity"] = time.perf_counter() - phase
    echo(
        f"capacity: {capacity.ceiling:g} engine-s/s (the engines' count), "
        f"{capacity.engine_s_per_s:.3f} delivered saturated, {capacity.rps:.2f} req/s of the "
        f"trace's mix ({walls['capacity']:.0f} s wall)"
    )

    phase = time.perf_counter()
    queue_cap = settings.queue_cap or queue_cap_for(capacity, settings.budget_s)
    engine_caps = (
        tuple(settings.max_num_queued_tokens for _ in setup.router.engines)
        if settings.max_num_queued_tokens is not None
        else setup.engine_caps(settings.budget_s)
    )
    baselines = {"queue_cap": queue_cap, "max_num_queued_tokens": list(engine_caps)}
    if "queue-cap" in settings.modes:
        echo(f"queue-cap: router queue cap {queue_cap}")
    if "engine-cap" in settings.modes:
        echo(f"engine-cap: --max-num-queued-tokens {', '.join(map(str, engine_caps))}")
    plan = [(load, mode) for load in settings.loads for mode in settings.modes]
    jobs = [
        ReplayJob(
            setup,
            mode,  # type: ignore[arg-type]
            capacity.rps * load,
            settings.budget_s,
            queue_cap=queue_cap,
            max_num_queued_tokens=engine_caps,
            warmup_fraction=settings.warmup_fraction,
        )
        for load, mode in plan
    ]
    echo(f"replay: {len(jobs)} runs ({settings.jobs} at a time)")
    results = _map(run_replay, jobs, settings.jobs)
    walls["replay"] = time.perf_counter() - phase
    figures: list[ReplayFigures] = []
    for (load, mode), result in zip(plan, results, strict=True):
        figure = _figures(settings, capacity, load, mode, result)
        figures.append(figure)
        echo(
            f"  {load:g}x {mode}: {figure.offered} offered, {_pct(figure.admitted_fraction)} "
            f"admitted, {_pct(figure.in_budget_fraction)} in budget, goodput "
            f"{_pct(figure.goodput_engine_ratio)} of bound in engine work, "
            f"{_pct(figure.goodput_ratio)} in requests ({result.wall_s:.0f} s wall)"
        )

    phase = time.perf_counter()
    figures = _false_refusals(settings, capacity, figures, results, echo)
    walls["false_refusals"] = time.perf_counter() - phase
    reruns = sum(len(figure.false_refusals.sampled) for figure in figures if figure.false_refusals)
    if reruns:
        echo(
            f"false refusals: {reruns} reruns in {walls['false_refusals']:.0f} s wall (each ends "
            f"{settings.horizon_s:g} s after its forced request's arrival, plus the budget)"
        )

    memory: MemoryResult | None = None
    if settings.memory:
        phase = time.perf_counter()
        job = MemoryJob(setup)
        memory = (
            _in_fresh_process(measure_memory, job) if settings.jobs > 1 else measure_memory(job)
        )
        walls["memory"] = time.perf_counter() - phase
        echo(f"memory: {memory.added / 1e6:.1f} MB added ({walls['memory']:.0f} s wall)")

    checks = evaluate(
        figures, settings.bar, memory_added_bytes=None if memory is None else memory.added
    )
    walls["total"] = time.perf_counter() - started
    return AdmissionReport(
        settings={**settings.as_json(), "baselines": baselines},
        environment=environment(_PACKAGES),
        trace=trace_info,
        capacity=capacity,
        runs=tuple(figures),
        memory=memory,
        checks=tuple(checks),
        wall_s=walls,
    )


def run_seeds(
    settings: AdmissionSettings, seeds: Sequence[int], *, echo: Echo = print
) -> SeedsReport:
    """Run the whole benchmark once per seed (its capacity too, since the engines' variation
    is seeded), each seed's progress lines prefixed with it."""
    reports = []
    for seed in seeds:
        seeded = attrs.evolve(settings, setup=attrs.evolve(settings.setup, seed=seed))
        reports.append((seed, run_admission(seeded, echo=_prefixed(echo, f"seed {seed}: "))))
    return SeedsReport(tuple(reports))


def _prefixed(echo: Echo, prefix: str) -> Echo:
    def prefixed(line: str) -> None:
        echo(prefix + line)

    return prefixed


def capacity_phases(slowdowns: Sequence[Slowdown], warmup_fraction: float) -> list[CapacityPhase]:
    """The states the engines go through during a replay's measurement window.

    A replay's window runs from ``warmup_fraction`` of its span to its end; a slowdown at
    ``at`` of the span is in force from there on. Each state is the slowdowns in force, with
    the share of the window it lasts (states of no length are left out; one state, no
    slowdown, without any).
    """
    rest = max(1e-12, 1.0 - warmup_fraction)

    def start(slowdown: Slowdown) -> float:
        return min(1.0, max(0.0, (slowdown.at - warmup_fraction) / rest))

    ordered = sorted(slowdowns, key=lambda slowdown: slowdown.at)
    points = sorted({0.0, 1.0, *(start(slowdown) for slowdown in ordered)})
    phases = []
    for begin, end in itertools.pairwise(points):
        if end <= begin:
            continue
        active = tuple(str(slowdown) for slowdown in ordered if start(slowdown) <= begin)
        phases.append(CapacityPhase(active, end - begin))
    return phases


def _measure_capacity(settings: AdmissionSettings, echo: Echo) -> Capacity:
    """The engines' capacity over a replay's window: one closed loop per state of the engines
    (:func:`capacity_phases`), the slowdowns of each in force from its start, time-weighted."""
    setup = settings.setup
    phases = capacity_phases(setup.truth.slowdowns, settings.warmup_fraction)
    by_text = {str(slowdown): slowdown for slowdown in setup.truth.slowdowns}
    states = sorted({phase.slowdowns for phase in phases}, key=len)
    jobs = [
        CapacityJob(
            attrs.evolve(
                setup,
                truth=attrs.evolve(setup.truth, slowdowns=tuple(by_text[t] for t in state)),
            ),
            warmup_s=settings.capacity_warmup_s,
            window_s=settings.capacity_window_s,
            passes=settings.capacity_passes,
        )
        for state in states
    ]
    if len(jobs) > 1:
        echo(f"capacity: {len(jobs)} loops, one per state of the engines during the window")
    measured = dict(zip(states, _map(measure_capacity, jobs, settings.jobs), strict=True))
    if len(phases) == 1 and not phases[0].slowdowns:
        return measured[()]
    return Capacity.time_weighted([(phase, measured[phase.slowdowns]) for phase in phases])


def queue_cap_for(capacity: Capacity, budget_s: float) -> int:
    """The ``queue-cap`` baseline's cap as a user would pick it: the requests the pool
    completes in one budget (``ceil(capacity.rps * budget_s)``), so that the last request in
    a full queue waits about one budget."""
    return max(1, math.ceil(capacity.rps * budget_s))


def with_engine_time(capacity: Capacity, setup: VirtualSetup) -> Capacity:
    """A given capacity completed with its engine time, if it has none, and the engines'
    count (the engine-time bound's capacity, :attr:`Capacity.ceiling`).

    Its engine seconds per second are then its rate times the replayed requests' mean
    engine work (:meth:`VirtualSetup.work`: the engines' true cost, an estimate).
    """
    if capacity.engines <= 0:
        capacity = attrs.evolve(capacity, engines=len(setup.router.engines))
    if capacity.engine_s_per_s > 0:
        return capacity
    return attrs.evolve(capacity, engine_s_per_s=capacity.rps * setup.work().mean(setup.rows()))


def _figures(
    settings: AdmissionSettings,
    capacity: Capacity,
    load: float,
    mode: str,
    result: ReplayResult,
) -> ReplayFigures:
    return replay_figures(
        result.outcomes,
        load=load,
        mode=mode,
        budget_s=settings.budget_s,
        offered_rps=capacity.rps * load,
        capacity=capacity,
        work=settings.setup.work(),
        warmup_fraction=settings.warmup_fraction,
        books=result.books,
        wall_s=result.wall_s,
        virtual_s=result.virtual_s,
        samples=result.samples,
        window=result.window,
        steps=result.steps,
    )


def _false_refusals(
    settings: AdmissionSettings,
    capacity: Capacity,
    figures: list[ReplayFigures],
    results: Sequence[ReplayResult],
    echo: Echo,
) -> list[ReplayFigures]:
    """Force sampled refusals in, one rerun each, and attach the verdicts to the figures."""
    reruns: list[tuple[int, int]] = []  # (position in figures, trace index)
    for position, (figure, result) in enumerate(zip(figures, results, strict=True)):
        if figure.mode != "predictive":
            continue
        chosen = sample_refusals(
            [outcome.index for outcome in result.outcomes if outcome.refused],
            settings.samples_at(figure.load),
            seed=settings.setup.seed,
            key=f"{figure.load:g}",
        )
        reruns.extend((position, index) for index in chosen)
    if reruns:
        echo(f"false refusals: {len(reruns)} forced-in reruns ({settings.jobs} at a time)")
    jobs = [
        ReplayJob(
            settings.setup,
            "predictive",
            capacity.rps * figures[position].load,
            settings.budget_s,
            forced=index,
            horizon_s=settings.horizon_s,
        )
        for position, index in reruns
    ]
    forced = _map(run_replay, jobs, settings.jobs)
    work = settings.setup.work()
    updated = list(figures)
    for position, (figure, result) in enumerate(zip(figures, results, strict=True)):
        if figure.mode != "predictive":
            continue
        mine = [
            (index, rerun)
            for (where, index), rerun in zip(reruns, forced, strict=True)
            if where == position
        ]
        changes = {
            index: displaced(
                result.outcomes,
                rerun.outcomes,
                index,
                budget_s=settings.budget_s,
                horizon_s=settings.horizon_s,
                work=work,
            )
            for index, rerun in mine
        }
        updated[position] = attrs.evolve(
            figure,
            false_refusals=FalseRefusals(
                refused=sum(1 for outcome in result.outcomes if outcome.refused),
                offered=figure.offered,
                sampled=tuple(index for index, _ in mine),
                met_budget=tuple(index for index, change in changes.items() if change.met_budget),
                ttfts_s={index: rerun.forced_ttft_s for index, rerun in mine},
                false=tuple(index for index, change in changes.items() if change.false),
                others_s={index: change.others_s for index, change in changes.items()},
                horizon_s=settings.horizon_s,
            ),
        )
    return updated


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f} %"


_PACKAGES = ("narwhal", "trio", "httpx", "quart-trio", "hypercorn")


def default_jobs() -> int:
    """Worker processes by default: one per CPU core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
