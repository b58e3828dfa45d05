"""The overhead benchmark's arithmetic and its report (pure: no I/O, no clock).

Per concurrency level and target: latency percentiles, errors, CPU and memory. For each router:
what it adds over the direct path (its percentile minus the direct path's percentile, because
the two sets of requests are not paired), and the ratios of Narwhal's figures to vllm-router's
(and to the floors', when they ran: ``--floor``, the cheapest relay on Trio sockets, and
``--stack-floor``, the cheapest ASGI relay on Hypercorn).
The same objects render as the printed table and as the JSON report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from narwhal.bench.load import LatencySummary, RequestRecord

__all__ = [
    "DIRECT",
    "FLOOR",
    "HYPERCORN_FLOOR",
    "NARWHAL",
    "RATIO_FLOOR_S",
    "STACK_FLOOR",
    "VLLM_ROUTER",
    "Added",
    "Check",
    "LevelReport",
    "OverheadReport",
    "Ratios",
    "TargetResult",
    "evaluate_checks",
    "ratio",
]

DIRECT = "direct"
FLOOR = "floor"
HYPERCORN_FLOOR = "hypercorn-floor"
NARWHAL = "narwhal"
STACK_FLOOR = "stack-floor"
VLLM_ROUTER = "vllm-router"
_FLOORS = (FLOOR, HYPERCORN_FLOOR, STACK_FLOOR)

_MIB = 1024 * 1024


@attrs.frozen
class TargetResult:
    """One target at one concurrency level, over all its measured rounds.

    Attributes:
        target: ``direct``, ``narwhal``, ``vllm-router``, ``floor``, ``hypercorn-floor`` or
            ``stack-floor`` (or a Narwhal of ``--workers``).
        concurrency: requests in flight at once.
        requests: requests measured (warm-up excluded).
        errors: requests that did not end in a complete, error-free stream.
        error_kinds: how many of each kind of error.
        ttft: time to first output event, over successful requests.
        e2e: time to ``[DONE]``, over successful requests.
        output_events_min: fewest output events in a successful stream (``None`` if none).
        output_events_max: most output events in a successful stream.
        wall_s: wall-clock seconds the target's rounds took.
        cpu_s: CPU seconds the target's own process used during its rounds (``None`` for the
            direct path, which has no process of its own).
        engine_cpu_s: CPU seconds the engine used during the target's rounds (``None`` when the
            engine is not a process this benchmark started).
        loadgen_cpu_s: CPU seconds the load generator itself used during the target's rounds.
        rss_bytes: the target process's resident memory at the end of the level.
        peak_rss_bytes: its peak resident memory so far.
    """

    target: str
    concurrency: int
    requests: int
    errors: int
    error_kinds: Mapping[str, int]
    ttft: LatencySummary
    e2e: LatencySummary
    output_events_min: int | None
    output_events_max: int | None
    wall_s: float
    cpu_s: float | None = None
    engine_cpu_s: float | None = None
    loadgen_cpu_s: float | None = None
    rss_bytes: int | None = None
    peak_rss_bytes: int | None = None

    @classmethod
    def from_records(
        cls,
        target: str,
        concurrency: int,
        records: Sequence[RequestRecord],
        *,
        wall_s: float,
        cpu_s: float | None = None,
        engine_cpu_s: float | None = None,
        loadgen_cpu_s: float | None = None,
        rss_bytes: int | None = None,
        peak_rss_bytes: int | None = None,
    ) -> TargetResult:
        """Summarise a target's measured records."""
        good = [record for record in records if record.ok]
        kinds = Counter(record.error for record in records if record.error is not None)
        events = [record.output_events for record in good]
        return cls(
            target=target,
            concurrency=concurrency,
            requests=len(records),
            errors=sum(kinds.values()),
            error_kinds=dict(sorted(kinds.items())),
            ttft=LatencySummary.of([r.ttft_s for r in good if r.ttft_s is not None]),
            e2e=LatencySummary.of([r.e2e_s for r in good if r.e2e_s is not None]),
            output_events_min=min(events) if events else None,
            output_events_max=max(events) if events else None,
            wall_s=wall_s,
            cpu_s=cpu_s,
            engine_cpu_s=engine_cpu_s,
            loadgen_cpu_s=loadgen_cpu_s,
            rss_bytes=rss_bytes,
            peak_rss_bytes=peak_rss_bytes,
        )

    @property
    def cpu_s_per_1k(self) -> float | None:
        """The target process's CPU seconds per 1,000 requests."""
        return _per_1k(self.cpu_s, self.requests)

    @property
    def engine_cpu_s_per_1k(self) -> float | None:
        """The engine's CPU seconds per 1,000 of this target's requests."""
        return _per_1k(self.engine_cpu_s, self.requests)

    @property
    def loadgen_cpu_s_per_1k(self) -> float | None:
        """The load generator's CPU seconds per 1,000 of this target's requests."""
        return _per_1k(self.loadgen_cpu_s, self.requests)

    @property
    def throughput_rps(self) -> float | None:
        """Requests per second over the target's rounds."""
        return self.requests / self.wall_s if self.wall_s > 0 else None

    def as_json(self) -> dict[str, Any]:
        """Plain values for a JSON report."""
        return {
            "target": self.target,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "errors": self.errors,
            "error_kinds": dict(self.error_kinds),
            "ttft": self.ttft.as_json(),
            "e2e": self.e2e.as_json(),
            "output_events_min": self.output_events_min,
            "output_events_max": self.output_events_max,
            "wall_s": self.wall_s,
            "throughput_rps": self.throughput_rps,
            "cpu_s": self.cpu_s,
            "cpu_s_per_1k_requests": self.cpu_s_per_1k,
            "engine_cpu_s": self.engine_cpu_s,
            "engine_cpu_s_per_1k_requests": self.engine_cpu_s_per_1k,
            "loadgen_cpu_s": self.loadgen_cpu_s,
            "loadgen_cpu_s_per_1k_requests": self.loadgen_cpu_s_per_1k,
            "rss_bytes": self.rss_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def _per_1k(seconds: float | None, requests: int) -> float | None:
    if seconds is None or requests <= 0:
        return None
    return seconds * 1000 / requests


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


RATIO_FLOOR_S = 0.0001
"""Added latencies below this (0.1 ms) are within the measurement's noise: no ratio to them."""


def ratio(
    numerator: float | None, denominator: float | None, *, floor: float = 0.0
) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is
    not above ``floor`` (nor positive): a ratio to a value lost in noise means nothing."""
    if numerator is None or denominator is None or denominator <= max(floor, 0.0):
        return None
    return numerator / denominator


@attrs.frozen
class Added:
    """What a router adds over the direct path: its percentile minus the direct path's."""

    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None

    @classmethod
    def between(cls, router: TargetResult, direct: TargetResult) -> Added:
        """``router`` over ``direct`` at the same level."""
        return cls(
            ttft_p50_s=_minus(router.ttft.p50_s, direct.ttft.p50_s),
            ttft_p99_s=_minus(router.ttft.p99_s, direct.ttft.p99_s),
            e2e_p50_s=_minus(router.e2e.p50_s, direct.e2e.p50_s),
            e2e_p99_s=_minus(router.e2e.p99_s, direct.e2e.p99_s),
        )

    def as_json(self) -> dict[str, Any]:
        """Plain values for a JSON report."""
        return attrs.asdict(self)


@attrs.frozen
class Ratios:
    """Narwhal's figures divided by another router's, vllm-router's or the floor's (1.0 is
    parity; lower favours Narwhal).

    A latency ratio is ``None`` where the other router's added latency is at most
    :data:`RATIO_FLOOR_S`: the absolute figures say more there.
    """

    added_ttft_p50: float | None
    added_ttft_p99: float | None
    added_e2e_p50: float | None
    added_e2e_p99: float | None
    cpu_per_request: float | None

    @classmethod
    def of(
        cls, narwhal: Added, vllm_router: Added, narwhal_cpu: float | None, vllm_cpu: float | None
    ) -> Ratios:
        """The ratios from both routers' added latencies and CPU per 1,000 requests."""
        return cls(
            added_ttft_p50=ratio(narwhal.ttft_p50_s, vllm_router.ttft_p50_s, floor=RATIO_FLOOR_S),
            added_ttft_p99=ratio(narwhal.ttft_p99_s, vllm_router.ttft_p99_s, floor=RATIO_FLOOR_S),
            added_e2e_p50=ratio(narwhal.e2e_p50_s, vllm_router.e2e_p50_s, floor=RATIO_FLOOR_S),
            added_e2e_p99=ratio(narwhal.e2e_p99_s, vllm_router.e2e_p99_s, floor=RATIO_FLOOR_S),
            cpu_per_request=ratio(narwhal_cpu, vllm_cpu),
        )

    def as_json(self) -> dict[str, Any]:
        """Plain values for a JSON report."""
        return attrs.asdict(self)


@attrs.frozen
class LevelReport:
    """All targets at one concurrency level, with each router's added latency and the ratios.

    Attributes:
        concurrency: requests in flight at once.
        rounds: alternating rounds the level was measured in.
        results: one per target, the direct path first.
    """

    concurrency: int
    rounds: int
    results: tuple[TargetResult, ...]

    def result(self, target: str) -> TargetResult | None:
        """The result of ``target``, if it was measured."""
        return next((result for result in self.results if result.target == target), None)

    def added(self, target: str) -> Added | None:
        """``target``'s latency over the direct path's."""
        router, direct = self.result(target), self.result(DIRECT)
        if router is None or direct is None or target == DIRECT:
            return None
        return Added.between(router, direct)

    @property
    def ratios(self) -> Ratios | None:
        """Narwhal over vllm-router, when both ran."""
        narwhal, vllm_router = self.result(NARWHAL), self.result(VLLM_ROUTER)
        narwhal_added, vllm_added = self.added(NARWHAL), self.added(VLLM_ROUTER)
        if narwhal is None or vllm_router is None or narwhal_added is None or vllm_added is None:
            return None
        return Ratios.of(narwhal_added, vllm_added, narwhal.cpu_s_per_1k, vllm_router.cpu_s_per_1k)

    @property
    def floor_ratios(self) -> Ratios | None:
        """Narwhal over the floor, when both ran."""
        return self.ratios_over(FLOOR)

    def ratios_over(self, target: str) -> Ratios | None:
        """Narwhal over ``target`` (a floor), when both ran."""
        narwhal, other = self.result(NARWHAL), self.result(target)
        narwhal_added, other_added = self.added(NARWHAL), self.added(target)
        if narwhal is None or other is None or narwhal_added is None or other_added is None:
            return None
        return Ratios.of(narwhal_added, other_added, narwhal.cpu_s_per_1k, other.cpu_s_per_1k)

    def as_json(self) -> dict[str, Any]:
        """Plain values for a JSON report."""
        added = {
            result.target: added.as_json()
            for result in self.results
            if (added := self.added(result.target)) is not None
        }
        ratios = self.ratios
        data = {
            "concurrency": self.concurrency,
            "rounds": self.rounds,
            "targets": {result.target: result.as_json() for result in self.results},
            "added_over_direct": added,
            "ratios_narwhal_over_vllm_router": None if ratios is None else ratios.as_json(),
        }
        for floor in _FLOORS:
            if self.result(floor) is not None:
                over = self.ratios_over(floor)
                key = "ratios_narwhal_over_" + floor.replace("-", "_")
                data[key] = None if over is None else over.as_json()
        return data


@attrs.frozen
class Check:
    """One target of SPEC.md's quality bar, as measured: ``NOT RUN`` when its level or target
    did not run (never a pass)."""

    name: str
    status: Literal["PASS", "FAIL", "NOT RUN"]
    detail: str

    def as_json(self) -> dict[str, Any]:
        """Plain values for a JSON report."""
        return attrs.asdict(self)


#: The levels of SPEC.md's bar: Narwhal's added latency against vllm-router's is judged at
#: these, its CPU per request at :data:`CPU_LEVELS` (and at any other level measured).
SIDE_BY_SIDE_LEVELS = (16, 64)
CPU_LEVELS = (1, 16, 64)
#: Where Narwhal must answer every request.
ERROR_FREE_LEVELS = (64, 256)


def evaluate_checks(
    levels: Iterable[LevelReport],
    *,
    ttft_bound_s: float = 0.001,
    p50_margin_s: float = 0.002,
    p99_margin_s: float = 0.010,
    cpu_ratio: float = 2.0,
) -> tuple[Check, ...]:
    """SPEC.md's bar for the relay, each target a check: Narwhal's added p50 TTFT at c=1
    within ``ttft_bound_s``; at c=16 and c=64 its added p50 and p99 TTFT within
    vllm-router's plus ``p50_margin_s`` and ``p99_margin_s``; its CPU per request at most
    ``cpu_ratio`` times vllm-router's at c=1, 16 and 64 (and at every other level measured);
    and no Narwhal errors at c=64 and c=256. A check whose level or target did not run is
    ``NOT RUN``."""
    by_concurrency = {level.concurrency: level for level in levels}
    checks = [_ttft_check(by_concurrency.get(1), ttft_bound_s)]
    for concurrency in SIDE_BY_SIDE_LEVELS:
        level = by_concurrency.get(concurrency)
        checks.append(_side_by_side_check(level, concurrency, "p50", p50_margin_s))
        checks.append(_side_by_side_check(level, concurrency, "p99", p99_margin_s))
    cpu_levels = sorted(set(CPU_LEVELS) | set(by_concurrency))
    checks += [_cpu_check(by_concurrency.get(c), c, cpu_ratio) for c in cpu_levels]
    checks += [_errors_check(by_concurrency.get(c), c) for c in ERROR_FREE_LEVELS]
    return tuple(checks)


def _ttft_check(level: LevelReport | None, bound_s: float) -> Check:
    name = f"narwhal added p50 TTFT <= {bound_s * 1000:g} ms at c=1"
    added = level.added(NARWHAL) if level is not None else None
    if added is None or added.ttft_p50_s is None:
        return Check(name, "NOT RUN", "c=1 with narwhal and the direct path was not measured")
    return Check(
        name,
        "PASS" if added.ttft_p50_s <= bound_s else "FAIL",
        f"measured {added.ttft_p50_s * 1000:.2f} ms",
    )


def _side_by_side_check(
    level: LevelReport | None, concurrency: int, percentile: str, margin_s: float
) -> Check:
    name = (
        f"narwhal added {percentile} TTFT <= vllm-router's + {margin_s * 1000:g} ms"
        f" at c={concurrency}"
    )
    field = f"ttft_{percentile}_s"
    ours = level.added(NARWHAL) if level is not None else None
    theirs = level.added(VLLM_ROUTER) if level is not None else None
    mine = None if ours is None else getattr(ours, field)
    other = None if theirs is None else getattr(theirs, field)
    if mine is None or other is None:
        return Check(
            name,
            "NOT RUN",
            f"c={concurrency} with narwhal, vllm-router and the direct path was not measured",
        )
    return Check(
        name,
        "PASS" if mine <= other + margin_s else "FAIL",
        f"narwhal {mine * 1000:+.2f} ms, vllm-router {other * 1000:+.2f} ms",
    )


def _cpu_check(level: LevelReport | None, concurrency: int, most: float) -> Check:
    name = f"narwhal CPU per request <= {most:g}x vllm-router's at c={concurrency}"
    ours = level.result(NARWHAL) if level is not None else None
    theirs = level.result(VLLM_ROUTER) if level is not None else None
    mine = None if ours is None else ours.cpu_s_per_1k
    other = None if theirs is None else theirs.cpu_s_per_1k
    measured = ratio(mine, other)
    if mine is None or other is None or measured is None:
        return Check(
            name, "NOT RUN", f"c={concurrency}: the CPU of narwhal and vllm-router was not measured"
        )
    return Check(
        name,
        "PASS" if measured <= most else "FAIL",
        f"{mine:.2f} / {other:.2f} s per 1k requests ({measured:.2f}x)",
    )


def _errors_check(level: LevelReport | None, concurrency: int) -> Check:
    name = f"narwhal zero errors at c={concurrency}"
    result = level.result(NARWHAL) if level is not None else None
    if result is None:
        return Check(name, "NOT RUN", f"c={concurrency} with narwhal was not measured")
    kinds = ", ".join(f"{kind} x{count}" for kind, count in result.error_kinds.items())
    return Check(
        name,
        "PASS" if result.errors == 0 else "FAIL",
        f"{result.errors} errors in {result.requests} requests" + (f" ({kinds})" if kinds else ""),
    )


@attrs.frozen
class OverheadReport:
    """The whole run: what was measured, how, and the verdicts.

    Attributes:
        settings: the benchmark's settings, as plain values.
        environment: where it ran (CPU cores, versions).
        levels: one report per concurrency level, in the order they ran.
        checks: the quality-bar verdicts.
    """

    settings: Mapping[str, Any]
    environment: Mapping[str, Any]
    levels: tuple[LevelReport, ...]
    checks: tuple[Check, ...]

    @property
    def verdict(self) -> str:
        """``PASS`` when every check ran and passed; ``FAIL`` when one failed; else
        ``INCOMPLETE`` (a check did not run, or there is none)."""
        statuses = [check.status for check in self.checks]
        if "FAIL" in statuses:
            return "FAIL"
        if not statuses or "NOT RUN" in statuses:
            return "INCOMPLETE"
        return "PASS"

    @property
    def passed(self) -> bool:
        """Every check ran and passed."""
        return self.verdict == "PASS"

    @property
    def total_errors(self) -> dict[str, int]:
        """Errors per target over every level."""
        totals: dict[str, int] = {}
        for level in self.levels:
            for result in level.results:
                totals[result.target] = totals.get(result.target, 0) + result.errors
        return totals

    def as_json(self) -> dict[str, Any]:
        """The JSON report."""
        return {
            "benchmark": "overhead",
            "settings": dict(self.settings),
            "environment": dict(self.environment),
            "levels": [level.as_json() for level in self.levels],
            "errors_per_target": self.total_errors,
            "checks": [check.as_json() for check in self.checks],
            "verdict": self.verdict,
            "passed": self.passed,
        }

    def render(self) -> str:
        """The readable table."""
        lines = [
            "Router overhead: the same closed-loop load straight to the engine and through each "
            "router,",
            f"streaming chat completions of {self.settings.get('output_tokens')} tokens. "
            "Times in ms; '+' columns are what the router adds",
            "over the direct path (router percentile minus direct percentile).",
            _shared_cpu_note(self.environment),
        ]
        for level in self.levels:
            lines.append("")
            lines.extend(_render_level(level))
        lines.append("")
        lines.extend(f"{check.status}  {check.name}: {check.detail}" for check in self.checks)
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _shared_cpu_note(environment: Mapping[str, Any]) -> str:
    cores = environment.get("cpu_cores")
    return (
        f"Load generator, engine and routers all share the same {cores} CPU cores: absolute "
        "times are not comparable between runs, only side-by-side figures."
    )


_HEADER = (
    f"{'target':<16}{'ok':>6}{'err':>5}"
    f"{'TTFT p50':>10}{'p99':>9}{'E2E p50':>9}{'p99':>9}"
    f"{'+TTFT p50':>11}{'p99':>9}{'+E2E p50':>10}{'p99':>9}"
    f"{'CPU s/1k':>10}{'eng CPU':>9}{'gen CPU':>9}{'RSS MiB':>9}{'req/s':>7}"
)


def _render_level(level: LevelReport) -> list[str]:
    requests = max((result.requests for result in level.results), default=0)
    lines = [
        f"c={level.concurrency}: {requests} requests per target in {level.rounds} alternating "
        "rounds",
        _HEADER,
    ]
    for result in level.results:
        added = level.added(result.target)
        lines.append(
            f"{result.target:<16}{result.requests - result.errors:>6}{result.errors:>5}"
            f"{_ms(result.ttft.p50_s):>10}{_ms(result.ttft.p99_s):>9}"
            f"{_ms(result.e2e.p50_s):>9}{_ms(result.e2e.p99_s):>9}"
            f"{_ms(_field(added, 'ttft_p50_s'), signed=True):>11}"
            f"{_ms(_field(added, 'ttft_p99_s'), signed=True):>9}"
            f"{_ms(_field(added, 'e2e_p50_s'), signed=True):>10}"
            f"{_ms(_field(added, 'e2e_p99_s'), signed=True):>9}"
            f"{_number(result.cpu_s_per_1k, 2):>10}{_number(result.engine_cpu_s_per_1k, 2):>9}"
            f"{_number(result.loadgen_cpu_s_per_1k, 2):>9}"
            f"{_number(result.rss_bytes and result.rss_bytes / _MIB, 1):>9}"
            f"{_number(result.throughput_rps, 0):>7}"
        )
    for result in level.results:
        if result.error_kinds:
            kinds = ", ".join(f"{kind} x{count}" for kind, count in result.error_kinds.items())
            lines.append(f"  {result.target} errors: {kinds}")
    ratios = level.ratios
    if ratios is not None:
        lines.append(
            "narwhal / vllm-router: added TTFT "
            f"p50 {_times(ratios.added_ttft_p50)}, p99 {_times(ratios.added_ttft_p99)}; "
            f"added E2E p50 {_times(ratios.added_e2e_p50)}, p99 {_times(ratios.added_e2e_p99)}; "
            f"CPU per request {_times(ratios.cpu_per_request)}"
        )
    for floor in _FLOORS:
        over = level.ratios_over(floor)
        if over is not None:
            lines.append(
                f"narwhal / {floor}: added TTFT p50 {_times(over.added_ttft_p50)}; "
                f"CPU per request {_times(over.cpu_per_request)}"
            )
    return lines


def _field(added: Added | None, name: str) -> float | None:
    if added is None:
        return None
    value: float | None = getattr(added, name)
    return value


def _ms(seconds: float | None, *, signed: bool = False) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:+.2f}" if signed else f"{seconds * 1000:.2f}"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
