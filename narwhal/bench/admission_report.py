"""The admission benchmark's report: what it holds, and how it prints (pure).

One :class:`AdmissionReport` renders as the printed tables (:meth:`AdmissionReport.render`) and
as the JSON report (:meth:`AdmissionReport.as_json`). A run over several seeds
(:class:`SeedsReport`) holds one report per seed and judges each check by every seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from narwhal.bench.goodput import (
    ENGINE_BUSY,
    PASS,
    REFUSAL_CODES,
    REJECTION_CODES,
    Capacity,
    Check,
    Prediction,
    PredictionError,
    ReplayFigures,
    overall_verdict,
)
from narwhal.bench.replay import MemoryResult

__all__ = ["AdmissionReport", "SeedsReport", "render_checks", "render_runs", "verdict_line"]


@attrs.frozen
class AdmissionReport:
    """The whole result: figures, verdicts, wall times.

    Attributes:
        settings: the settings, as JSON values.
        environment: CPU cores, versions.
        trace: the replayed trace's size (requests, span, mean rate).
        capacity: the engines' capacity.
        runs: one per load and mode.
        memory: the memory measurement, if taken.
        checks: the verdicts.
        wall_s: wall-clock seconds by phase (``capacity``, ``replay``, ``false_refusals``,
            ``memory``, ``total``).
    """

    settings: dict[str, Any]
    environment: dict[str, Any]
    trace: dict[str, Any]
    capacity: Capacity
    runs: tuple[ReplayFigures, ...]
    memory: MemoryResult | None
    checks: tuple[Check, ...]
    wall_s: dict[str, float]

    @property
    def verdict(self) -> str:
        """``PASS`` (every target checked and passed), ``FAIL`` or ``INCOMPLETE``."""
        return overall_verdict(check.passed for check in self.checks)

    @property
    def passed(self) -> bool:
        """Every target was checked and passed (a check not run is not a pass)."""
        return self.verdict == PASS

    @property
    def prediction(self) -> Prediction:
        """The predictive runs' TTFT predictions, pooled: at arrival and at placement."""
        return Prediction.pooled(run for run in self.runs if run.mode == "predictive")

    def as_json(self) -> dict[str, Any]:
        """The JSON report."""
        return {
            "settings": self.settings,
            "environment": self.environment,
            "trace": self.trace,
            "capacity": self.capacity.as_json(),
            "runs": [run.as_json() for run in self.runs],
            "memory": None if self.memory is None else self.memory.as_json(),
            "prediction_error": self.prediction.as_json(),
            "checks": [check.as_json() for check in self.checks],
            "wall_s": self.wall_s,
            "verdict": self.verdict,
            "not_run": [check.name for check in self.checks if check.passed is None],
            "passed": self.passed,
        }

    def render(self) -> str:
        """The printed report."""
        return "\n".join(render_report(self))


@attrs.frozen
class SeedsReport:
    """The whole benchmark run once per seed, each seed's checks judged on their own.

    A change that helps one seed and hurts the other is not a pass: the verdict is ``PASS``
    only when every seed's is, ``FAIL`` when any check of any seed failed.

    Attributes:
        reports: ``(seed, report)`` in the order run.
    """

    reports: tuple[tuple[int, AdmissionReport], ...]

    @property
    def checks(self) -> tuple[Check, ...]:
        """Every seed's checks, seed after seed, each seed holding every check any seed has
        (one it lacks is ``NOT RUN`` there)."""
        rows = self.by_check()
        return tuple(row[number] for number in range(len(self.reports)) for _, row in rows)

    @property
    def verdict(self) -> str:
        """``PASS`` (every check of every seed ran and passed), ``FAIL`` or ``INCOMPLETE``."""
        return overall_verdict(check.passed for check in self.checks)

    @property
    def passed(self) -> bool:
        """Every seed's every target was checked and passed."""
        return self.verdict == PASS

    def by_check(self) -> list[tuple[str, list[Check]]]:
        """Each check's name (in the first seed's order) and its check in each seed (a
        ``NOT RUN`` stand-in where that seed has no check of that name)."""
        names: dict[str, None] = {}
        for _, report in self.reports:
            names.update((check.name, None) for check in report.checks)
        found = [{check.name: check for check in report.checks} for _, report in self.reports]
        return [
            (name, [checks.get(name) or Check(name, None, "n/a", "-") for checks in found])
            for name in names
        ]

    def as_json(self) -> dict[str, Any]:
        """The JSON report: each seed's whole report under ``by_seed``, and each check's
        verdict by seed."""
        seeds = [str(seed) for seed, _ in self.reports]
        return {
            "seeds": [seed for seed, _ in self.reports],
            "by_seed": [report.as_json() for _, report in self.reports],
            "checks": [
                {
                    "name": name,
                    "verdicts": {
                        seed: check.verdict for seed, check in zip(seeds, checks, strict=True)
                    },
                    "measured": {
                        seed: check.measured for seed, check in zip(seeds, checks, strict=True)
                    },
                }
                for name, checks in self.by_check()
            ],
            "verdict": self.verdict,
            "passed": self.passed,
        }

    def render(self) -> str:
        """Each seed's report, then every check by seed and the verdict."""
        lines: list[str] = []
        for seed, report in self.reports:
            lines += [f"=== seed {seed} ===", *render_report(report), ""]
        rows = self.by_check()
        width = max((len(name) for name, _ in rows), default=10)
        column = 18
        lines.append(
            f"=== every seed ===\n{'check':<{width}}"
            + "".join(f"  {'seed ' + str(seed):>{column}}" for seed, _ in self.reports)
        )
        for name, checks in rows:
            cells = (f"{check.measured.strip()} {check.verdict}" for check in checks)
            lines.append(f"{name:<{width}}" + "".join(f"  {cell:>{column}}" for cell in cells))
        seeds = ", ".join(f"seed {seed}: {report.verdict}" for seed, report in self.reports)
        lines += ["", f"{verdict_line(self.verdict, self.checks)} ({seeds})"]
        return "\n".join(lines)


def _pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * 100:.{digits}f}%"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _count(outcomes: Mapping[str, int], codes: Iterable[str]) -> int:
    wanted = set(codes)
    return sum(n for label, n in outcomes.items() if label.split(" ")[-1] in wanted)


def _status(outcomes: Mapping[str, int], status: str) -> int:
    return sum(n for label, n in outcomes.items() if label.split(" ")[0] == status)


_RUN_HEADER = (
    f"{'load':>5} {'mode':<10} {'offered':>7} {'req/s':>6} {'admit':>7} {'in-bgt':>7} "
    f"{'eng':>6} {'goodput':>7} {'bound':>6} {'req':>6} {'p50 s':>6} {'p99 s':>6} "
    f"{'refused':>7} {'429cap':>6} {'503':>4} {'504':>5} {'unatt':>5} {'false':>6} "
    f"{'arrival':>9} {'place':>9}"
)


def _errors(error: PredictionError) -> str:
    if error.median_abs is None or error.p90_abs is None:
        return "-"
    return f"{_pct(error.median_abs, 0)}/{_pct(error.p90_abs, 0)}"


def render_runs(runs: Sequence[ReplayFigures]) -> list[str]:
    """One line per run, then each run's outcomes by reason."""
    lines = [_RUN_HEADER]
    for run in runs:
        false = run.false_refusals
        false_text = "-"
        if false is not None and false.sampled:
            false_text = f"{len(false.false)}/{len(false.sampled)}"
        elif false is not None:
            false_text = "0/0"
        lines.append(
            f"{run.load:>4g}x {run.mode:<10} {run.offered:>7} {run.offered_rps:>6.1f} "
            f"{_pct(run.admitted_fraction):>7} {_pct(run.in_budget_fraction):>7} "
            f"{_pct(run.goodput_engine_ratio):>6} {run.goodput_rps:>7.2f} "
            f"{run.bound_rps:>6.2f} {_pct(run.goodput_ratio):>6} "
            f"{_seconds(run.ttft_p50_s):>6} "
            f"{_seconds(run.ttft_p99_s):>6} {_count(run.outcomes, REFUSAL_CODES):>7} "
            f"{_count(run.outcomes, REJECTION_CODES):>6} "
            f"{_status(run.outcomes, '503') + _count(run.outcomes, {ENGINE_BUSY}):>4} "
            f"{_status(run.outcomes, '504'):>5} {run.unattainable:>5} {false_text:>6} "
            f"{_errors(run.projection):>9} {_errors(run.placement):>9}"
        )
    return lines


def render_checks(checks: Sequence[Check]) -> list[str]:
    """The verdicts, predictive figure first and open mode's beside it."""
    width = max((len(check.name) for check in checks), default=10)
    lines = [f"{'check':<{width}}  {'measured':>10}  {'target':>9}  {'open':>8}  {'verdict':<7}"]
    for check in checks:
        line = (
            f"{check.name:<{width}}  {check.measured:>10}  {check.target:>9}  "
            f"{check.open_mode or '-':>8}  {check.verdict:<7}"
        )
        lines.append(f"{line}  ({check.note})" if check.note else line.rstrip())
    return lines


def _engines(settings: dict[str, Any]) -> str:
    """``2 x h100-llama3-8b``, or each engine's profile where they differ."""
    profiles = settings.get("engine_profiles") or [settings["profile"]] * settings["engines"]
    if len(set(profiles)) == 1:
        return f"{len(profiles)} x {profiles[0]}"
    return " + ".join(profiles)


def _tpot_target(settings: dict[str, Any]) -> str:
    target = settings.get("admission", {}).get("tpot_target_s")
    if target is None:
        return "no TPOT target (placement fills the engines' batches)"
    return f"TPOT target {target:g} s (placement holds each engine's batch to it)"


def render_report(report: AdmissionReport) -> list[str]:
    """The whole printed report."""
    settings = report.settings
    capacity: Capacity = report.capacity
    trace = report.trace
    lines = [
        "narwhal bench admission (virtual time: router and simulated engines under the "
        "MockClock, seeded)",
        f"engines: {_engines(settings)} (vllm dialect, continuous "
        f"batching); TTFT budget {settings['budget_s']:g} s; {_tpot_target(settings)}; seed "
        f"{settings['seed']}",
        f"trace: {trace['name']}, {trace['requests']} requests over {trace['span_s']:.0f} s of "
        f"trace ({trace['mean_rate']:.2f} req/s), replayed whole at each load (time axis scaled)",
    ]
    if capacity.measured:
        lines.append(
            f"capacity: {capacity.ceiling:g} engine-s/s in engine time (the engines' count: "
            f"the engine-time bound), {capacity.rps:.2f} req/s of the trace's mix (the load "
            f"axis). Closed loop of {capacity.concurrency} through the router, open, limits "
            f"lifted, the trace's rows in a seeded shuffled cycle: {capacity.completed} "
            f"completions in {capacity.window_s:.0f} s after {capacity.warmup_s:.0f} s of "
            f"warm-up, {_rate(capacity.completed_rps)} req/s, mix {_number(capacity.mix, 2)} of "
            f"the trace's mean work; mean batch {_number(capacity.mean_batch)} per engine; the "
            f"simulator's step ledger: engines busy {_number(capacity.busy_s_per_s, 3)} "
            f"engine-s/s, {capacity.engine_s_per_s:.3f} of it charged to requests at full-batch "
            f"cost, noise {_pct(capacity.noise)} (relative standard error over six parts of the "
            f"window); req/s: the cost model's work rate over the trace's mean request."
        )
        if capacity.phases:
            lines.append(
                "capacity over the replay's measurement window, time-weighted over the engines' "
                "states (one closed loop per state, its slowdowns in force from the start): "
                + "; ".join(
                    f"{' + '.join(phase.slowdowns) or 'no slowdown'}: "
                    f"{phase.rps:.2f} req/s, {phase.engine_s_per_s:.3f} engine-s/s charged, "
                    f"for {_pct(phase.share)} of the window"
                    for phase in capacity.phases
                )
            )
    else:
        lines.append(
            f"capacity: {capacity.rps:.2f} req/s, {capacity.ceiling:g} engine-s/s in engine "
            "time (given, not measured)"
        )
    descriptions = settings.get("mode_descriptions") or {}
    baselines = settings.get("baselines") or {}
    for mode, description in descriptions.items():
        value = ""
        if mode == "queue-cap" and baselines.get("queue_cap") is not None:
            value = f" [cap {baselines['queue_cap']}]"
        elif mode == "engine-cap" and baselines.get("max_num_queued_tokens"):
            value = f" [{', '.join(map(str, baselines['max_num_queued_tokens']))} tokens]"
        lines.append(f"mode {mode}: {description}{value}")
    lines += ["", *render_runs(report.runs), ""]
    lines += [
        "admit: admitted / offered; in-bgt: admitted with TTFT <= budget / admitted; eng: "
        "goodput / bound in engine time (the headline: the engine time the simulator's step "
        "ledger charged, inside the window, to requests completed in budget, over min(offered, "
        "the engines' count); it cannot pass 100 %); goodput: in-budget completions per "
        "second over the window; bound: min(offered, capacity) in requests per second, of the "
        "attainable requests; req: goodput / bound in requests; p50, p99: TTFT of admitted "
        "requests; refused: 429 ttft_budget_exceeded + prompt_exceeds_ttft_budget; 429cap: "
        "queue or retention full; 503: unavailable, and the engines' own 503 in engine-cap mode "
        "(engine_busy, passed on by the router as 502); unatt: requests in the window whose "
        "first token, alone on an idle engine, would miss the budget (out of the bound); "
        "false: refused requests forced in that met the budget without taking more in-budget "
        "work from the requests around them than their own / sampled; arrival: error of "
        "admission's TTFT projection at arrival (scored), median / p90; place: of the router's "
        "prediction at placement, after the queue wait. The bound with the budget as a "
        "deadline (not a verdict's): in any piece of time, the requests arriving in it that "
        "meet the budget must have their prefills done within the piece plus the budget, on "
        "the engines there are; a burst no pool can prefill in time cannot all count.",
        "",
    ]
    for run in report.runs:
        if run.mode != "predictive":
            continue
        projection, placement = run.projection, run.placement
        lines.append(
            f"{run.load:g}x predictive: {_pct(run.in_budget_window)} of admitted in budget after "
            f"the warm-up; projection at arrival: error median {_pct(projection.median_abs)}, "
            f"p90 {_pct(projection.p90_abs)}, bias {_pct(projection.median_signed)}; at "
            f"placement: median {_pct(placement.median_abs)}, p90 {_pct(placement.p90_abs)}, "
            f"bias {_pct(placement.median_signed)}; goodput {_pct(run.goodput_deadline_ratio)} of "
            "the bound with the budget as a deadline"
        )
    lines += ["", *render_checks(report.checks)]
    if report.memory is not None:
        memory = report.memory
        lines.append(
            f"memory: {memory.retained} retained ({memory.placed} on the engines, "
            f"{memory.queued} queued): RSS {memory.before / 1e6:.0f} MB -> "
            f"{memory.holding / 1e6:.0f} MB (+{memory.added / 1e6:.1f} MB; router, engines and "
            "client in one process)"
        )
    wall = report.wall_s
    lines += [
        "",
        "wall time: "
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in wall.items())
        + f" ({report.environment.get('cpu_cores')} CPU cores, {settings['jobs']} worker "
        "processes)",
        verdict_line(report.verdict, report.checks),
    ]
    return lines


def verdict_line(verdict: str, checks: Sequence[Check]) -> str:
    """``verdict: PASS``, or the verdict with what failed and what did not run."""
    failed = sum(1 for check in checks if check.passed is False)
    not_run = sum(1 for check in checks if check.passed is None)
    parts = [f"{failed} failed"] if failed else []
    parts += [f"{not_run} not run"] if not_run else []
    return f"verdict: {verdict}" + (f" ({', '.join(parts)} of {len(checks)})" if parts else "")


def _number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
