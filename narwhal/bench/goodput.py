"""The admission benchmark's arithmetic (pure: no I/O, no clock).

What one replayed request became is an :class:`Outcome`; a run's outcomes turn into the
figures the report prints (:func:`replay_figures`): the offered load, what was admitted, what
met the TTFT budget, the goodput against its bound, the TTFT percentiles, the refusals by
reason, and the error of the router's TTFT predictions. :func:`evaluate` turns figures into the
quality bar's verdicts.

Definitions (``benchmarks/README.md`` says the same for readers of the report):

* **admitted**: passed admission, i.e. was not refused (429 ``ttft_budget_exceeded`` or
  ``prompt_exceeds_ttft_budget``), rejected (429 ``admission_queue_full`` or
  ``http_retention_full``), invalid, unavailable (503), or refused by the engines' own
  admission (``engine_busy``: the ``engine-cap`` baseline's 503s). A request admitted and then
  expired in the queue (504) counts as admitted and outside the budget.
* **in budget**: admitted, with its first output event at most ``budget`` seconds after it was
  sent.
* **goodput**: requests in budget *and* completed, per second, among those arriving in the
  measurement window (the replay's span after a warm-up, while the engines fill). **Engine
  goodput** (the headline) is the engine time the simulated engines spent on those requests
  *inside the window*, per second, read from the simulator's own step ledger
  (:func:`charge_step`, ``Outcome.engine_work_s``): each step that runs is charged to the
  requests in it, each at what it costs in a full batch on that engine (its prefill chunk; its
  decode share: the per-sequence and context terms and the step's fixed cost split over the
  batch's ``max_num_seqs`` seats), in the step's real engine time (the engine's own constants,
  scale, jitter and slowdown), never more than the step lasted. What no request is charged (the
  empty seats of a partial batch, the fixed cost of a step that only prefills) is the engines'
  overhead. A step straddling the window's edge counts by its share inside. An engine is busy
  at most one second per second, so engine goodput cannot pass the number of engines, by
  construction. A request that never ran on an engine (refused, rejected) has no ledger
  account; it is weighed by its cost model (:class:`Work`, :func:`work_in_window`).
* **attainable**: a request that can meet the budget at all: its first token, alone on an idle
  engine, comes within the budget. The engines' own timing answers that (the simulated engines'
  true behaviour, ``Outcome.idle_ttft_s``), not the router's model of them. A request whose
  prefill alone exceeds the budget is in no policy's goodput, so it is left out of the bound.
* **bound**: ``min(offered, capacity)`` over the same window, of the attainable requests, in
  engine time per second (the headline) and in requests per second (beside it). In engine time,
  *offered* is the ledger's engine time inside the window of every attainable request that ran
  (and of every in-budget one, so that goodput cannot pass the offered term), plus the cost
  model's estimate of those that never ran; the *capacity* is the engine time the engines can
  deliver per second: the number of engines (:attr:`Capacity.ceiling`; each is busy at most
  all the time). No policy can deliver more in-budget engine time than that, so goodput above
  100 % of the engine-time bound means the accounting is wrong (a verdict fails). In requests
  the capacity is the closed loop's rate of the trace's mix, which a policy admitting short
  requests can pass.
* **deadline bound** (beside the headline, not a verdict's; :func:`deadline_bound`): the least
  of the bound, the most work that can count when every request in budget has its prefill done
  within its own budget window by the engines (the exact optimum of a relaxation: the engines
  as one machine, fractions of requests, the decode free), and what the engines could do inside
  the window with the work that had arrived. It sees a trace's bursts and silences.
* **false refusal**: a refused request that, forced in on a rerun of the same seeded replay,
  met its budget, and around which (from one budget before its arrival to a horizon after it)
  the requests ended with more in-budget work, its own included, than without it
  (:func:`displaced`). A request that could meet its budget only by pushing others out of
  theirs was rightly refused: by itself it would have "met the budget", which is reported
  beside.

A verdict is ``PASS``, ``FAIL`` or ``NOT RUN`` (its figure was not measured), and the overall
verdict (:func:`overall_verdict`) is ``PASS`` only when every target was checked and passed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from narwhal.bench.load import percentile

# The engine's own accounting lives with the engine (``narwhal sim --ledger`` keeps it too);
# re-exported here, where the benchmark's arithmetic is.
from narwhal.sim.ledger import CostModel, charge_step

__all__ = [
    "ENGINE_BUSY",
    "REFUSAL_CODES",
    "REJECTION_CODES",
    "Bar",
    "Capacity",
    "CapacityPhase",
    "Check",
    "CostModel",
    "Displacement",
    "FalseRefusals",
    "Outcome",
    "Prediction",
    "PredictionError",
    "ReplayFigures",
    "StepRecord",
    "Window",
    "Work",
    "bound",
    "charge_step",
    "deadline_bound",
    "displaced",
    "engine_parts",
    "engine_seconds",
    "evaluate",
    "ledger_rates",
    "outcome_label",
    "overall_verdict",
    "replay_figures",
    "request_series",
    "safe_ratio",
    "work_in_window",
]

REFUSAL_CODES = frozenset({"ttft_budget_exceeded", "prompt_exceeds_ttft_budget"})
"""The two refusals of predictive admission (counted as ``refused``)."""

REJECTION_CODES = frozenset({"admission_queue_full", "http_retention_full"})
"""The capacity rejections (counted as ``rejected``)."""

ENGINE_BUSY = "engine_busy"
"""The code of an engine-side refusal (vLLM's ``--max-num-queued-tokens``, the ``engine-cap``
baseline): the engines' 503, which the router passes on as 502; not admitted."""


@attrs.frozen(slots=True)
class Outcome:
    """What one replayed request became. Times are virtual seconds from the replay's start.

    Attributes:
        index: the request's row in the trace.
        arrival_s: when it was sent.
        prompt_tokens: its prompt's length.
        output_tokens: its output's length.
        status: the HTTP status (0: no response at all).
        code: the error code (the envelope's ``code``, an in-band error's, or a short kind such
            as ``no_done``); ``None`` for a complete stream.
        ttft_s: arrival to the first output event, if one came.
        end_s: when ``data: [DONE]`` came, if it did.
        projected_ttft_s: predictive admission's projection when the request arrived.
        placement_ttft_s: the router's prediction at placement (arrival to the predicted first
            token), reported with the first output.
        router_ttft_s: the TTFT the router measured (arrival at the router to first output).
        idle_ttft_s: the first token of the request alone on the fastest idle engine, by the
            engines' own timing (``None``: not known, taken as attainable).
        engine_work_s: the engine time the step ledger charged it inside the measurement
            window (:func:`charge_step`; ``None``: it never ran on a ledgered engine, and the
            cost model weighs it).
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    status: int
    code: str | None
    ttft_s: float | None
    end_s: float | None
    projected_ttft_s: float | None = None
    placement_ttft_s: float | None = None
    router_ttft_s: float | None = None
    idle_ttft_s: float | None = None
    engine_work_s: float | None = None

    @property
    def refused(self) -> bool:
        """Refused by predictive admission."""
        return self.status == 429 and self.code in REFUSAL_CODES

    @property
    def admitted(self) -> bool:
        """Passed admission (served, failed, or expired in the queue after admission); the
        engines' own refusal (``engine_busy``) is not admitted."""
        if self.code == ENGINE_BUSY:
            return False
        return self.status not in (0, 429, 503) and not 400 <= self.status < 500

    @property
    def completed(self) -> bool:
        """Streamed to the end without error."""
        return self.status == 200 and self.code is None

    def in_budget(self, budget_s: float) -> bool:
        """Admitted, with its first output within ``budget_s``."""
        return self.admitted and self.ttft_s is not None and self.ttft_s <= budget_s

    def attainable(self, budget_s: float) -> bool:
        """Whether it could meet ``budget_s`` at all: alone on an idle engine, it would."""
        return self.idle_ttft_s is None or self.idle_ttft_s <= budget_s


def outcome_label(outcome: Outcome) -> str:
    """``200``, or the status and code of a failure (``429 ttft_budget_exceeded``)."""
    if outcome.completed:
        return "200"
    return f"{outcome.status} {outcome.code}" if outcome.code else str(outcome.status)


def engine_parts(costs: CostModel, prompt_tokens: int, output_tokens: int) -> tuple[float, float]:
    """:func:`engine_seconds` in its two parts: the prefill's and the decode's, in seconds."""
    prefill_ms = costs.prefill_chunk_ms(0, prompt_tokens)
    steps = max(0, output_tokens - 1)
    context = prompt_tokens + output_tokens / 2
    per_step_ms = (
        costs.decode_base_ms / costs.max_num_seqs
        + costs.decode_per_seq_ms
        + costs.decode_per_kv_token_ms * context
    )
    return prefill_ms / 1000, steps * per_step_ms / 1000


def engine_seconds(costs: CostModel, prompt_tokens: int, output_tokens: int) -> float:
    """The engine time a request costs at the engine's saturation point, in seconds.

    Its prompt's prefill work (``prefill_chunk_ms``: the per-token and attention terms; the
    fixed cost of a prefill step is not paid while decodes run) plus, for each output token after
    the first, its share of a decode step in a full batch: ``s_d`` and ``k_d`` times its mean
    context, and the step's fixed cost ``a_d`` split over ``max_num_seqs`` sequences. The same
    formula weighs the offered load, the capacity and the goodput (:class:`Work`), so their
    ratios compare like with like.
    """
    prefill, decode = engine_parts(costs, prompt_tokens, output_tokens)
    return prefill + decode


@attrs.frozen
class Work:
    """How the benchmark weighs a request in engine work: its true cost, averaged over the pool.

    Each engine's cost is :func:`engine_seconds` on that engine's own physics (the simulated
    engines' calibrated type, per-engine variation and truth scale, never the router's
    profile), times its time scale; a request's work is the mean of those over the pool's
    engines, whichever engine served it. The capacity, the offered load and the goodput are
    all counted in this one unit (*pool-mean engine seconds*), so that in a mixed pool (an
    A100 costs a request about three times what an H100 does) or with engines twice as slow
    as the router believes, the ratios still compare like with like: a request is the same
    amount of work wherever it runs, and a slower pool is one that completes less of it per
    second. A scheduled slowdown is a change of the capacity over the run, not of the work
    (:mod:`narwhal.bench.admission` weighs the capacity by time instead).

    Attributes:
        engines: each engine's cost model and time scale.
        names: what each engine is (its type, for the report).
        fastest: the smallest factor a scheduled slowdown multiplies step times by (1: none
            speeds an engine up), for :meth:`least_prefill_s`.
    """

    engines: tuple[tuple[CostModel, float], ...]
    names: tuple[str, ...] = ()
    fastest: float = 1.0

    @classmethod
    def of(cls, costs: CostModel, scale: float = 1.0) -> Work:
        """The work on one engine of cost model ``costs`` (or a pool of identical ones)."""
        return cls(((costs, scale),), (str(getattr(costs, "name", "")),))

    def parts(self, prompt_tokens: int, output_tokens: int) -> tuple[float, float]:
        """A request's prefill and decode work, in pool-mean engine seconds."""
        if not self.engines:
            return 0.0, 0.0
        prefill = decode = 0.0
        for costs, scale in self.engines:
            one_prefill, one_decode = engine_parts(costs, prompt_tokens, output_tokens)
            prefill += one_prefill * scale
            decode += one_decode * scale
        return prefill / len(self.engines), decode / len(self.engines)

    def least_prefill_s(self, prompt_tokens: int) -> float:
        """The least engine time any engine of the pool can spend on the prompt's prefill (its
        ``prefill_chunk_ms`` on the fastest engine, times that engine's scale and
        :attr:`fastest`): what the step ledger charges at the least, wherever it runs."""
        if not self.engines:
            return 0.0
        least = min(
            costs.prefill_chunk_ms(0, prompt_tokens) * scale for costs, scale in self.engines
        )
        return least / 1000.0 * self.fastest

    def prefill_share(self, prompt_tokens: int, output_tokens: int) -> float:
        """The least share of a request's engine time that is its prefill, on any engine of the
        pool (an engine's scale and a slowdown multiply both parts alike): wherever it runs, each
        second of its work holds at least this much prefill (:func:`deadline_bound`)."""
        shares = []
        for costs, _ in self.engines:
            prefill, decode = engine_parts(costs, prompt_tokens, output_tokens)
            if prefill + decode > 0:
                shares.append(prefill / (prefill + decode))
        return min(shares, default=0.0)

    def seconds(self, prompt_tokens: int, output_tokens: int) -> float:
        """A request's work, in pool-mean engine seconds."""
        prefill, decode = self.parts(prompt_tokens, output_tokens)
        return prefill + decode

    def mean(self, requests: Iterable[Any]) -> float:
        """The mean work of ``requests`` (anything with ``prompt_tokens`` and ``output_tokens``)."""
        values = [self.seconds(r.prompt_tokens, r.output_tokens) for r in requests]
        return sum(values) / len(values) if values else 0.0

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {
            "unit": "pool-mean engine seconds (each engine's true cost)",
            "engines": list(self.names),
            "scales": [scale for _, scale in self.engines],
        }


def _as_work(work: Work | CostModel) -> Work:
    return work if isinstance(work, Work) else Work.of(work)


def safe_ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def bound(offered: float, capacity: float) -> float:
    """``min(offered, capacity)``: the most in-budget work any policy can deliver."""
    return min(offered, capacity)


class StepRecord(NamedTuple):
    """One step of the ledger: when it ran (seconds from the run's origin), how long, and how
    much of that it charged to requests (:func:`charge_step`)."""

    start_s: float
    duration_s: float
    charged_s: float


def ledger_rates(steps: Iterable[StepRecord], window: Window) -> tuple[float, float]:
    """The engines' busy time and charged time inside ``window``, per second of it (both at
    most the number of engines: one engine runs one step at a time)."""
    length = window.length_s
    if length <= 0:
        return 0.0, 0.0
    busy = charged = 0.0
    for step in steps:
        share = window.share(step.start_s, step.duration_s)
        if share:
            busy += step.duration_s * share
            charged += step.charged_s * share
    return busy / length, charged / length


@attrs.frozen
class Capacity:
    """The engines' measured capacity at saturation, for the trace's own mix.

    Attributes:
        rps: requests per second of the trace's own mix (the load axis: 1x offers this): the
            loop's work rate by the cost model (:class:`Work`, :func:`work_in_window`) over the
            trace's mean work per request, so that it does not depend on the mix the window
            happened to complete.
        engine_s_per_s: the engine time the step ledger charged per second of the window
            (:func:`charge_step`): what the engines deliver saturated with the trace's mix.
        engines: how many engines: the engine time they can deliver per second, the capacity
            of the engine-time bound (:attr:`ceiling`; 0: not known, ``engine_s_per_s`` stands
            in).
        busy_s_per_s: the engines' busy time per second of the window (``None``: not measured;
            at most ``engines``, and ``engine_s_per_s`` at most that).
        model_s_per_s: the cost model's estimate of the work done per second of the window
            (:func:`work_in_window`; ``rps`` is it over the trace's mean; ``None``: not
            measured). A run without a ledger (real time: the engines are other processes)
            weighs goodput with the cost model and takes this as its capacity.
        model_noise: the relative standard error of ``model_s_per_s`` (as ``noise``).
        window_s: the measured window (virtual seconds), after the warm-up.
        completed: requests completed in the window.
        concurrency: requests kept in flight.
        mean_batch: the engines' mean running batch, per engine, sampled over the window.
        ttft_p50_s: median TTFT of the window's requests (for the reader: queueing at
            saturation).
        measured: ``False`` when the capacity was given rather than measured.
        warmup_s: virtual seconds before the window: at least until every request of the
            loop's first wave (all started at once) had ended.
        completed_rps: the window's completions per second (the rate of the mix it completed).
        mix: the mean engine seconds of the window's completions over the trace's mean (1: the
            window completed the trace's own mix; below 1: it favoured short requests).
        noise: the capacity measurement's own relative standard error (the charged rate's
            over six equal parts of its window); the bound check allows two of them where the
            bound's capacity is that measured rate (``engines`` not known), none otherwise.
        phases: with scheduled slowdowns, the capacity of each state the engines are in during
            a replay's measurement window, and the share of the window it lasts; ``rps`` and
            ``engine_s_per_s`` are then their time-weighted means (empty: one state).
    """

    rps: float
    engine_s_per_s: float
    engines: int = 0
    busy_s_per_s: float | None = None
    model_s_per_s: float | None = None
    model_noise: float = 0.0
    window_s: float = 0.0
    completed: int = 0
    concurrency: int = 0
    mean_batch: float | None = None
    ttft_p50_s: float | None = None
    measured: bool = True
    warmup_s: float = 0.0
    completed_rps: float | None = None
    mix: float | None = None
    noise: float = 0.0
    phases: tuple[CapacityPhase, ...] = ()

    @property
    def ceiling(self) -> float:
        """The engine-time bound's capacity: the engines' count (each busy at most all the
        time), or the measured ``engine_s_per_s`` when the count is not known."""
        return float(self.engines) if self.engines > 0 else self.engine_s_per_s

    @property
    def ceiling_noise(self) -> float:
        """The noise of :attr:`ceiling`: none for the engines' count, ``noise`` for a rate."""
        return 0.0 if self.engines > 0 else self.noise

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {
            **attrs.asdict(self),
            "ceiling": self.ceiling,
            "phases": [phase.as_json() for phase in self.phases],
        }

    @classmethod
    def time_weighted(cls, phases: Sequence[tuple[CapacityPhase, Capacity]]) -> Capacity:
        """The capacity over a window through ``phases`` (each with its measured capacity):
        the shares' weighted mean of the rates; the other figures are the first phase's."""
        first = phases[0][1]
        shares = sum(phase.share for phase, _ in phases) or 1.0
        return attrs.evolve(
            first,
            rps=sum(phase.share * one.rps for phase, one in phases) / shares,
            engine_s_per_s=sum(phase.share * one.engine_s_per_s for phase, one in phases) / shares,
            busy_s_per_s=None
            if any(one.busy_s_per_s is None for _, one in phases)
            else sum(phase.share * (one.busy_s_per_s or 0.0) for phase, one in phases) / shares,
            noise=max(one.noise for _, one in phases),
            phases=tuple(
                attrs.evolve(phase, rps=one.rps, engine_s_per_s=one.engine_s_per_s)
                for phase, one in phases
            ),
        )


@attrs.frozen
class CapacityPhase:
    """One state of the engines during a replay's measurement window, and its capacity.

    Attributes:
        slowdowns: the scheduled slowdowns in force (``ENGINE@AT:FACTOR``), none at first.
        share: the share of the measurement window the state lasts.
        rps: its capacity in requests per second of the trace's mix (once measured).
        engine_s_per_s: its capacity in engine work per second (once measured).
    """

    slowdowns: tuple[str, ...]
    share: float
    rps: float = 0.0
    engine_s_per_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {**attrs.asdict(self), "slowdowns": list(self.slowdowns)}


@attrs.frozen
class Window:
    """The measurement window of a replay: from the end of the warm-up to the last arrival."""

    start_s: float
    end_s: float

    @property
    def length_s(self) -> float:
        """Its length in seconds."""
        return max(0.0, self.end_s - self.start_s)

    def holds(self, at: float | None) -> bool:
        """Whether time ``at`` falls inside it."""
        return at is not None and self.start_s <= at <= self.end_s

    def share(self, start: float, duration: float) -> float:
        """The share of ``[start, start + duration]`` inside it (an instant: 1 or 0)."""
        if duration <= 0:
            return 1.0 if self.holds(start) else 0.0
        inside = min(start + duration, self.end_s) - max(start, self.start_s)
        return max(0.0, min(duration, inside)) / duration

    @classmethod
    def of(cls, outcomes: Sequence[Outcome], warmup_fraction: float) -> Window:
        """The window of a run: its span with the first ``warmup_fraction`` of it left out."""
        if not outcomes:
            return cls(0.0, 0.0)
        first = min(outcome.arrival_s for outcome in outcomes)
        last = max(outcome.arrival_s for outcome in outcomes)
        return cls(first + (last - first) * warmup_fraction, last)


@attrs.frozen
class PredictionError:
    """Relative error of TTFT predictions: ``(predicted - observed) / observed``.

    Attributes:
        count: predictions compared.
        median_abs: median of the absolute relative errors.
        p90_abs: their 90th percentile.
        median_signed: median of the signed errors (> 0: the router predicts too long).
    """

    count: int
    median_abs: float | None
    p90_abs: float | None
    median_signed: float | None

    @classmethod
    def of(cls, pairs: Iterable[tuple[float, float]]) -> PredictionError:
        """From ``(predicted, observed)`` pairs; pairs with an observed time <= 0 are skipped."""
        errors = [(p - o) / o for p, o in pairs if o > 0]
        if not errors:
            return cls(0, None, None, None)
        absolute = [abs(error) for error in errors]
        return cls(
            count=len(errors),
            median_abs=percentile(absolute, 50),
            p90_abs=percentile(absolute, 90),
            median_signed=percentile(errors, 50),
        )

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return attrs.asdict(self)


@attrs.frozen
class Displacement:
    """What forcing one refused request in changed around it (:func:`displaced`).

    Attributes:
        forced_s: the forced request's work if it met the budget (0: it did not).
        others_s: how much the in-budget work of the other requests around it changed
            (negative: it pushed some out of their budget, or out of admission).
        lost: other requests in budget without it and not with it.
        gained: other requests in budget with it and not without it.
    """

    forced_s: float
    others_s: float
    lost: int
    gained: int

    @property
    def met_budget(self) -> bool:
        """The forced request met its budget."""
        return self.forced_s > 0

    @property
    def false(self) -> bool:
        """The refusal was false: the forced request met its budget, and the requests around
        it, itself included, ended with more in-budget work than without it."""
        return self.met_budget and self.forced_s + self.others_s > 0


def displaced(
    base: Iterable[Outcome],
    rerun: Iterable[Outcome],
    forced: int,
    *,
    budget_s: float,
    horizon_s: float,
    work: Work | CostModel,
) -> Displacement:
    """Compare a forced-in rerun with the run it forced a refusal into.

    The requests compared are those arriving from one budget before the forced request (whose
    first tokens it may still delay) to ``horizon_s`` after it (the queue behind it), each
    weighed by its work (:class:`Work`); the rerun must have run until the last of them had
    its budget. A request in the window that the rerun did not send counts as out of budget.

    Raises:
        ValueError: the forced request is not in both runs.
    """
    work = _as_work(work)
    before = {outcome.index: outcome for outcome in base}
    after = {outcome.index: outcome for outcome in rerun}
    if forced not in before or forced not in after:
        raise ValueError(f"request {forced} is not in both runs")
    target = after[forced]
    start, end = target.arrival_s - budget_s, target.arrival_s + horizon_s
    others, lost, gained = 0.0, 0, 0
    for index, outcome in before.items():
        if index == forced or not start <= outcome.arrival_s <= end:
            continue
        other = after.get(index)
        was = outcome.in_budget(budget_s)
        now = other is not None and other.in_budget(budget_s)
        if was != now:
            seconds = work.seconds(outcome.prompt_tokens, outcome.output_tokens)
            others += seconds if now else -seconds
            gained += now
            lost += was
    forced_s = 0.0
    if target.in_budget(budget_s):
        forced_s = work.seconds(target.prompt_tokens, target.output_tokens)
    return Displacement(forced_s, others, lost, gained)


@attrs.frozen
class FalseRefusals:
    """Refused requests forced in on the same seeded run: was refusing them a loss?

    A refusal is false when the forced request met its budget and the requests around it
    (:func:`displaced`), itself included, ended with more in-budget work than without it: a
    request that would have met its budget by pushing others out of theirs was rightly
    refused. Whether it met its budget alone is kept beside (``met_budget``).

    Attributes:
        refused: requests refused by predictive admission in the run.
        offered: requests offered in the run.
        sampled: indices of the refused requests forced in, one rerun each.
        met_budget: of those, the ones whose TTFT, forced in, was within the budget.
        ttfts_s: the forced-in TTFTs, by index (``None``: no first output).
        false: of ``met_budget``, those whose refusal was false (the in-budget work around
            them rose with them); counted only where ``horizon_s`` is set.
        others_s: by index, how much the other requests' in-budget work around it changed
            (:attr:`Displacement.others_s`).
        horizon_s: how long after each forced request its rerun watched the requests behind
            it (``None``: the rerun did not watch, and only ``met_budget`` is known).
    """

    refused: int
    offered: int
    sampled: tuple[int, ...] = ()
    met_budget: tuple[int, ...] = ()
    ttfts_s: Mapping[int, float | None] = attrs.field(factory=dict)
    false: tuple[int, ...] = ()
    others_s: Mapping[int, float] = attrs.field(factory=dict)
    horizon_s: float | None = None

    @property
    def false_share(self) -> float | None:
        """The share of sampled refusals that were false (``None`` without a sample); where
        the reruns did not watch the requests around them, those that met the budget (the
        stricter count)."""
        false = self.met_budget if self.horizon_s is None else self.false
        return safe_ratio(len(false), len(self.sampled))

    @property
    def met_share(self) -> float | None:
        """The share of sampled refusals that met the budget, forced in (``None`` without a
        sample): false or not, by themselves."""
        return safe_ratio(len(self.met_budget), len(self.sampled))

    @property
    def rate(self) -> float:
        """Estimated false refusals as a share of the offered requests.

        ``refused / offered * false_share``; 0 when nothing was refused.
        """
        if self.refused == 0 or self.offered == 0:
            return 0.0
        share = self.false_share
        return 0.0 if share is None else self.refused / self.offered * share

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {
            "refused": self.refused,
            "offered": self.offered,
            "sampled": list(self.sampled),
            "met_budget": list(self.met_budget),
            "ttfts_s": {str(index): ttft for index, ttft in self.ttfts_s.items()},
            "false": list(self.false),
            "others_s": {str(index): change for index, change in self.others_s.items()},
            "horizon_s": self.horizon_s,
            "false_share": self.false_share,
            "met_share": self.met_share,
            "rate": self.rate,
        }


@attrs.frozen
class ReplayFigures:
    """What one replay (one load, one mode) measured.

    Attributes:
        load: the offered load as a multiple of the capacity.
        mode: ``predictive`` or ``open``.
        budget_s: the TTFT budget.
        offered: requests sent.
        offered_rps: their mean rate (the trace's, scaled).
        admitted: requests admitted (see the module doc).
        in_budget: admitted requests whose first output came within the budget.
        in_budget_window: the share of the admitted requests arriving in the measurement window
            (after the warm-up) that met the budget: the steady state, without the cold start.
        completed: requests streamed to the end.
        window: the measurement window.
        goodput_rps: in-budget completions per second, of the requests arriving in the window.
        goodput_engine: the engine time the ledger charged them inside the window, per second
            (the headline).
        bound_rps: ``min(offered, capacity)`` over the window, of the attainable requests, in
            requests per second.
        bound_engine: the same in engine time per second (the headline's bound; its capacity
            is :attr:`Capacity.ceiling`).
        busy_engine: the engines' busy time per second of the window, from the ledger
            (``None``: no ledger); goodput <= work <= busy <= the engines' count.
        work_engine: the engine time charged to any request (in budget or not) per second of
            the window (``None``: no ledger).
        deadline_engine: the lesser of :attr:`bound_engine` and :func:`deadline_bound` of the
            same requests (engine time per second): a tighter bound, not a verdict's; beside
            the headline, to show how much of it bursts of prompts put out of any policy's
            reach.
        estimated: requests in goodput or the offered term weighed by the cost model, not the
            ledger (they never ran on a ledgered engine; served requests of a benchmark run
            always did).
        unattainable: requests arriving in the window that could not meet the budget even
            alone on an idle engine (left out of the bound).
        ttft_p50_s: median TTFT of the admitted requests that got a first output.
        ttft_p99_s: their 99th percentile.
        outcomes: requests by outcome (``200``, ``429 ttft_budget_exceeded``, ``504 ...``).
        projection: error of predictive admission's projection at arrival, the figure it
            decides on (admitted requests; the scored prediction).
        placement: error of the router's prediction at placement, after the queue wait (its
            ``narwhal_predicted_ttft_error_ratio``; reported beside the projection).
        books: the router's own counters at the end (``offered``, each terminal class,
            ``in_flight``).
        false_refusals: the forced-in sample, when one was taken.
        wall_s: wall-clock seconds the replay took.
        virtual_s: virtual seconds it spanned.
        placement_pairs: ``(predicted, observed)`` placement TTFTs, to pool runs' errors (not
            in the JSON).
        projection_pairs: ``(projected, observed)`` TTFTs at arrival, likewise.
        series: what ``narwhal bench report`` plots (:func:`request_series`, and the router's
            samples over time under ``router``, when the replay took them); in the JSON.
    """

    load: float
    mode: str
    budget_s: float
    offered: int
    offered_rps: float
    admitted: int
    in_budget: int
    completed: int
    window: Window
    in_budget_window: float | None
    goodput_rps: float
    goodput_engine: float
    bound_rps: float
    bound_engine: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    outcomes: Mapping[str, int]
    projection: PredictionError
    placement: PredictionError
    books: Mapping[str, int] = attrs.field(factory=dict)
    false_refusals: FalseRefusals | None = None
    wall_s: float = 0.0
    virtual_s: float = 0.0
    placement_pairs: tuple[tuple[float, float], ...] = ()
    projection_pairs: tuple[tuple[float, float], ...] = ()
    unattainable: int = 0
    capacity_noise: float = 0.0
    series: Mapping[str, Any] = attrs.field(factory=dict)
    busy_engine: float | None = None
    work_engine: float | None = None
    estimated: int = 0
    deadline_engine: float | None = None

    @property
    def admitted_fraction(self) -> float | None:
        """Admitted over offered."""
        return safe_ratio(self.admitted, self.offered)

    @property
    def in_budget_fraction(self) -> float | None:
        """In budget over admitted."""
        return safe_ratio(self.in_budget, self.admitted)

    @property
    def goodput_ratio(self) -> float | None:
        """Goodput over its bound, in requests."""
        return safe_ratio(self.goodput_rps, self.bound_rps)

    @property
    def goodput_engine_ratio(self) -> float | None:
        """Goodput over its bound, in engine time."""
        return safe_ratio(self.goodput_engine, self.bound_engine)

    @property
    def goodput_deadline_ratio(self) -> float | None:
        """Goodput over the bound that knows the budget is a deadline, in engine time."""
        return safe_ratio(self.goodput_engine, self.deadline_engine)

    @property
    def refused(self) -> int:
        """Requests refused by predictive admission."""
        return sum(
            count for label, count in self.outcomes.items() if label.split(" ")[-1] in REFUSAL_CODES
        )

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {
            "load": self.load,
            "mode": self.mode,
            "budget_s": self.budget_s,
            "offered": self.offered,
            "offered_rps": self.offered_rps,
            "admitted": self.admitted,
            "admitted_fraction": self.admitted_fraction,
            "in_budget": self.in_budget,
            "in_budget_fraction": self.in_budget_fraction,
            "in_budget_window_fraction": self.in_budget_window,
            "completed": self.completed,
            "window_s": [self.window.start_s, self.window.end_s],
            "goodput_rps": self.goodput_rps,
            "goodput_engine_s_per_s": self.goodput_engine,
            "bound_rps": self.bound_rps,
            "bound_engine_s_per_s": self.bound_engine,
            "goodput_ratio": self.goodput_ratio,
            "goodput_engine_ratio": self.goodput_engine_ratio,
            "deadline_bound_engine_s_per_s": self.deadline_engine,
            "goodput_deadline_ratio": self.goodput_deadline_ratio,
            "unattainable": self.unattainable,
            "capacity_noise": self.capacity_noise,
            "busy_engine_s_per_s": self.busy_engine,
            "work_engine_s_per_s": self.work_engine,
            "estimated": self.estimated,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "outcomes": dict(self.outcomes),
            "projection_error": self.projection.as_json(),
            "placement_error": self.placement.as_json(),
            "books": dict(self.books),
            "false_refusals": None
            if self.false_refusals is None
            else self.false_refusals.as_json(),
            "wall_s": self.wall_s,
            "virtual_s": self.virtual_s,
            "series": dict(self.series),
        }


def request_series(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Per-request series of one replay, compact, for the plots of ``narwhal bench report``.

    ``ttft_s``: the admitted requests' TTFTs, sorted, to the millisecond (their CDF).
    ``prediction`` (only where some projection at arrival was recorded: predictive and shadow
    mode): for each admitted request with a measured TTFT, in arrival order, its arrival (to
    10 ms) and the signed relative error (``(predicted - observed) / observed``, to 0.1 %) of
    the projection at arrival and of the prediction at placement (``None`` where missing).
    """
    admitted = [outcome for outcome in outcomes if outcome.admitted]
    series: dict[str, Any] = {
        "ttft_s": sorted(round(o.ttft_s, 3) for o in admitted if o.ttft_s is not None)
    }
    scored = sorted(
        (
            (o.arrival_s, o.projected_ttft_s, o.placement_ttft_s, o.router_ttft_s)
            for o in admitted
            if o.router_ttft_s is not None and o.router_ttft_s > 0
        ),
        key=lambda row: row[0],
    )
    if any(projected is not None for _, projected, _, _ in scored):

        def error(predicted: float | None, observed: float) -> float | None:
            return None if predicted is None else round((predicted - observed) / observed, 3)

        series["prediction"] = {
            "arrival_s": [round(arrival, 2) for arrival, _, _, _ in scored],
            "arrival_error": [error(projected, seen) for _, projected, _, seen in scored],
            "placement_error": [error(placed, seen) for _, _, placed, seen in scored],
        }
    return series


def replay_figures(
    outcomes: Sequence[Outcome],
    *,
    load: float,
    mode: str,
    budget_s: float,
    offered_rps: float,
    capacity: Capacity,
    work: Work | CostModel,
    warmup_fraction: float = 0.2,
    books: Mapping[str, int] | None = None,
    wall_s: float = 0.0,
    virtual_s: float = 0.0,
    samples: Mapping[str, Any] | None = None,
    window: Window | None = None,
    steps: Sequence[StepRecord] | None = None,
) -> ReplayFigures:
    """The figures of one replay (see the module doc for the definitions).

    Each outcome's ``engine_work_s`` (the step ledger's charge inside ``window``) is its engine
    time; ``work`` (:class:`Work`: the engines' true cost; a bare cost model is a pool of
    identical engines of that model) weighs those without one. ``window``: the window the
    ledger counted in (default :meth:`Window.of` the outcomes); ``steps``: the ledger's steps,
    for the engines' busy and charged time. ``samples``: the router's state sampled over the
    replay, kept in :attr:`ReplayFigures.series` under ``router``.
    """
    work = _as_work(work)
    window = Window.of(outcomes, warmup_fraction) if window is None else window
    admitted = [outcome for outcome in outcomes if outcome.admitted]
    good_all = [o for o in admitted if o.completed and o.in_budget(budget_s)]
    good = [outcome for outcome in good_all if window.holds(outcome.arrival_s)]
    arriving = [outcome for outcome in outcomes if window.holds(outcome.arrival_s)]
    attainable = [outcome for outcome in arriving if outcome.attainable(budget_s)]
    settled = [outcome for outcome in arriving if outcome.admitted]
    length = window.length_s
    goodput_rps = len(good) / length if length > 0 else 0.0
    offered_in_window = len(attainable) / length if length > 0 else offered_rps
    # Engine time counts where it was spent: the ledger's charge inside the window (the cost
    # model's estimate for a request that never ran). A good request also counts as offered,
    # so goodput <= offered term by term; and the ledger's charges <= the engines' busy time.
    good_ids = {id(outcome) for outcome in good_all}
    offered_work = [o for o in outcomes if o.attainable(budget_s) or id(o) in good_ids]
    goodput_engine = _engine_time(work, good_all, window) / length if length > 0 else 0.0
    offered_engine = _engine_time(work, offered_work, window) / length if length > 0 else 0.0
    estimated = sum(1 for o in offered_work if o.engine_work_s is None)
    bound_engine = bound(offered_engine, capacity.ceiling)
    deadline_engine = deadline_bound(
        (_deadline_item(work, outcome, window) for outcome in offered_work),
        engines=len(work.engines),
        budget_s=budget_s,
        window=window,
    )
    if deadline_engine is not None:  # both bound goodput: the tighter one
        deadline_engine = min(deadline_engine, bound_engine)
    busy_engine = work_engine = None
    if steps is not None:
        busy_engine, work_engine = ledger_rates(steps, window)
    ttfts = [outcome.ttft_s for outcome in admitted if outcome.ttft_s is not None]
    placement = tuple(
        (outcome.placement_ttft_s, outcome.router_ttft_s)
        for outcome in admitted
        if outcome.placement_ttft_s is not None and outcome.router_ttft_s is not None
    )
    projection = tuple(
        (outcome.projected_ttft_s, outcome.router_ttft_s)
        for outcome in admitted
        if outcome.projected_ttft_s is not None and outcome.router_ttft_s is not None
    )
    return ReplayFigures(
        load=load,
        mode=mode,
        budget_s=budget_s,
        offered=len(outcomes),
        offered_rps=offered_rps,
        admitted=len(admitted),
        in_budget=sum(1 for outcome in admitted if outcome.in_budget(budget_s)),
        completed=sum(1 for outcome in outcomes if outcome.completed),
        window=window,
        in_budget_window=safe_ratio(
            sum(1 for outcome in settled if outcome.in_budget(budget_s)), len(settled)
        ),
        goodput_rps=goodput_rps,
        goodput_engine=goodput_engine,
        bound_rps=bound(offered_in_window, capacity.rps),
        bound_engine=bound_engine,
        ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        ttft_p99_s=percentile(ttfts, 99) if ttfts else None,
        outcomes=dict(Counter(outcome_label(outcome) for outcome in outcomes).most_common()),
        projection=PredictionError.of(projection),
        placement=PredictionError.of(placement),
        books=dict(books or {}),
        wall_s=wall_s,
        virtual_s=virtual_s,
        placement_pairs=placement,
        projection_pairs=projection,
        unattainable=len(arriving) - len(attainable),
        capacity_noise=capacity.ceiling_noise,
        series={**request_series(outcomes), **({"router": dict(samples)} if samples else {})},
        busy_engine=busy_engine,
        work_engine=work_engine,
        estimated=estimated,
        deadline_engine=deadline_engine,
    )


def deadline_bound(
    items: Iterable[tuple[float, float, float]], *, engines: int, budget_s: float, window: Window
) -> float | None:
    """A bound on engine goodput that knows the budget is a deadline (engine time per second of
    ``window``; ``None`` for an empty window).

    ``items`` are ``(arrival_s, prefill_s, work_s)`` for every request that could count in
    goodput: its arrival, the least engine time its prefill takes behind ``work_s`` (in the
    engine time ``work_s`` is counted in: see :func:`replay_figures`), and the engine time it
    may count inside the window. A request in budget has its whole prefill done between its
    arrival and its arrival plus the budget, and the engines run at most ``engines`` seconds of
    steps a second. The bound is the most work that can count under those constraints alone:
    the engines taken as one machine ``engines`` times as fast that may split its time between
    prompts at will (fluid, preemptive), fractions of requests allowed, each request's decode
    and everything but its prefill free. Every one of those relaxations only loosens it: no
    policy can beat it. Unlike ``min(offered, capacity)``, it sees that a burst of prompts that
    no pool can prefill within the budget cannot all count, and that the budget windows of
    bursts close together share the engines' time.

    It is the exact optimum of that relaxation (:func:`_most_in_time`). It is also at most what
    the engines could do inside the window with the work that had arrived, budget or not: a
    pool that works whenever there is work, starting the window with every earlier request's
    work still to do (the most any schedule can have left), serves at ``engines`` seconds a
    second. A trace whose window holds long silences cannot fill it.
    """
    length = window.length_s
    if length <= 0:
        return None
    items = [(arrival, prefill, work) for arrival, prefill, work in items if work > 0]
    most = _most_in_time(items, float(engines), budget_s)
    return min(most, _served_in(items, engines, window)) / length


def _most_in_time(
    items: Sequence[tuple[float, float, float]], speed: float, budget_s: float
) -> float:
    """The most work of ``items`` (``(arrival_s, prefill_s, work_s)``) whose prefills one
    machine of ``speed`` can do, each between its arrival and its arrival plus ``budget_s``
    (fractions allowed, the machine's time split at will): :func:`_prefill_done`'s."""
    ordered = sorted(items)
    done = _prefill_done(ordered, speed, budget_s)
    return sum(
        work if prefill <= 0 else work * amount / prefill
        for (_, prefill, work), amount in zip(ordered, done, strict=True)
    )


def _prefill_done(
    items: Sequence[tuple[float, float, float]], speed: float, budget_s: float
) -> list[float]:
    """How much of each request's prefill (``items`` sorted, ``(arrival_s, prefill_s,
    work_s)``) the most work in time does (:func:`_most_in_time`).

    What is done of each request, ``q``, is schedulable when, for every run of requests ``j ..
    k`` in arrival order, ``q_j + ... + q_k <= speed * (arrival_k + budget_s - arrival_j)``
    (every request's window is as long, so the requests inside any interval are such a run, and
    earliest deadline first meets every deadline when each interval holds its work). Those
    vectors form a polymatroid, over which a linear objective is maximised greedily: requests by
    work per prefill second, most first, each given as much prefill as every run through it
    still holds. The slack of the runs through request ``m`` is ``min over k >= m of A_k - max
    over j <= m of B_j + speed * budget_s``, with ``A_k = speed * arrival_k - (q_0 + ... +
    q_k)`` and ``B_j = speed * arrival_j - (q_0 + ... + q_(j-1))``: two trees keep both under
    the additions, ``O(n log n)`` in all.
    """
    count = len(items)
    done = [0.0] * count
    ends = _MinTree([speed * arrival for arrival, _, _ in items])  # A_k
    starts = _MinTree([-speed * arrival for arrival, _, _ in items])  # -B_j
    for index in sorted(range(count), key=lambda i: _density(items[i]), reverse=True):
        prefill = items[index][1]
        if prefill <= 0:
            continue
        slack = ends.least(index, count) + starts.least(0, index + 1) + speed * budget_s
        amount = min(prefill, slack)
        if amount <= 0:
            continue
        done[index] = amount
        ends.add(index, count, -amount)
        starts.add(index + 1, count, amount)
    return done


def _density(item: tuple[float, float, float]) -> float:
    """Work per prefill second (a request without prefill first)."""
    _, prefill, work = item
    return work / prefill if prefill > 0 else math.inf


class _MinTree:
    """Numbers that take additions over ranges and answer the least of a range (a segment tree
    with lazy additions)."""

    __slots__ = ("_added", "_least", "_size")

    def __init__(self, values: Sequence[float]) -> None:
        size = 1
        while size < len(values):
            size *= 2
        self._size = size
        self._least = [math.inf] * (2 * size)
        self._added = [0.0] * (2 * size)
        self._least[size : size + len(values)] = values
        for node in range(size - 1, 0, -1):
            self._least[node] = min(self._least[2 * node], self._least[2 * node + 1])

    def add(self, start: int, stop: int, value: float) -> None:
        """Add ``value`` to positions ``start .. stop - 1``."""
        self._add(start, stop, value, 1, 0, self._size)

    def least(self, start: int, stop: int) -> float:
        """The least of positions ``start .. stop - 1`` (infinity for none)."""
        return self._min(start, stop, 1, 0, self._size)

    def _add(self, start: int, stop: int, value: float, node: int, low: int, high: int) -> None:
        if stop <= low or high <= start:
            return
        if start <= low and high <= stop:
            self._least[node] += value
            self._added[node] += value
            return
        middle = (low + high) // 2
        self._add(start, stop, value, 2 * node, low, middle)
        self._add(start, stop, value, 2 * node + 1, middle, high)
        children = min(self._least[2 * node], self._least[2 * node + 1])
        self._least[node] = children + self._added[node]

    def _min(self, start: int, stop: int, node: int, low: int, high: int) -> float:
        if stop <= low or high <= start:
            return math.inf
        if start <= low and high <= stop:
            return self._least[node]
        middle = (low + high) // 2
        children = min(
            self._min(start, stop, 2 * node, low, middle),
            self._min(start, stop, 2 * node + 1, middle, high),
        )
        return children + self._added[node]


def _served_in(items: Sequence[tuple[float, float, float]], engines: int, window: Window) -> float:
    """The most work a pool of ``engines`` can do inside ``window`` on ``items`` (see
    :func:`deadline_bound`): work-conserving from the window's start, everything that arrived
    before it still to do."""
    start, end = window.start_s, window.end_s
    backlog = sum(work for arrival, _, work in items if arrival < start)
    arrivals = sorted((arrival, work) for arrival, _, work in items if start <= arrival < end)
    served, now = 0.0, start
    for arrival, work in [*arrivals, (end, 0.0)]:
        done = min(backlog, engines * (arrival - now))
        served += done
        backlog += work - done
        now = arrival
    return served


def _deadline_item(work: Work, outcome: Outcome, window: Window) -> tuple[float, float, float]:
    """``(arrival_s, prefill_s, work_s)`` of one request for :func:`deadline_bound`: its engine
    time inside ``window`` and the least prefill behind it, in the same engine time.

    The prefill is the least any engine takes for the prompt, or the prompt's least share of
    the request's work times that work, whichever is more. A request's work is counted where it
    ran (on a slower engine, or in a slowdown, a prefill takes more engine time and so does the
    work it counts), so the prefill behind it is too: the fastest engine's prefill alone, set
    against work counted on the slowest, would let a request count several times the engine
    time its place in the budget window holds.
    """
    work_s = _engine_time(work, (outcome,), window)
    share = work.prefill_share(outcome.prompt_tokens, outcome.output_tokens)
    prefill_s = max(work.least_prefill_s(outcome.prompt_tokens), share * work_s)
    return outcome.arrival_s, prefill_s, work_s


def _engine_time(work: Work, outcomes: Sequence[Outcome], window: Window) -> float:
    """The engine time of ``outcomes`` inside ``window``: the ledger's charge where there is
    one, the cost model's estimate (:func:`work_in_window`) where there is none."""
    ledgered = sum(o.engine_work_s for o in outcomes if o.engine_work_s is not None)
    rest = [o for o in outcomes if o.engine_work_s is None]
    return ledgered + (work_in_window(work, rest, window) if rest else 0.0)


def _overlap(start: float, end: float, window: Window) -> float:
    """The share of ``[start, end]`` inside ``window`` (an instant: 1 inside, 0 outside)."""
    if end <= start:
        return 1.0 if window.holds(start) else 0.0
    inside = min(end, window.end_s) - max(start, window.start_s)
    return max(0.0, inside) / (end - start)


def work_in_window(work: Work, outcomes: Iterable[Outcome], window: Window) -> float:
    """The cost model's estimate of the engine work of ``outcomes`` done inside ``window``, in
    pool-mean engine seconds.

    A request's prefill work is spread over its arrival to its first token, its decode work
    over its first token to its end, and each counts by the share of its interval inside the
    window; a request without both times (refused, failed, cut) counts whole if it arrived in
    the window. An estimate, not an account: spread evenly over the request's life, work done
    partly outside the window can count inside it (in short windows, goodput read this way
    passed the capacity by 9 %). The headline reads the step ledger instead
    (:func:`charge_step`); this weighs what the ledger has no account of (requests that never
    ran) and sets the load axis (:attr:`Capacity.rps`).
    """
    total = 0.0
    for outcome in outcomes:
        prefill, decode = work.parts(outcome.prompt_tokens, outcome.output_tokens)
        start, ttft, end = outcome.arrival_s, outcome.ttft_s, outcome.end_s
        if ttft is None or end is None:
            total += (prefill + decode) * _overlap(start, start, window)
            continue
        first = start + ttft
        total += prefill * _overlap(start, first, window) + decode * _overlap(first, end, window)
    return total


@attrs.frozen
class Prediction:
    """TTFT predictions pooled over runs: the projection at arrival, which admission decides on
    (scored), and the prediction at placement, after the queue wait (reported beside it).
    """

    arrival: PredictionError
    placement: PredictionError

    @classmethod
    def pooled(cls, runs: Iterable[ReplayFigures]) -> Prediction:
        """Over every pair of ``runs``."""
        arrival: list[tuple[float, float]] = []
        placement: list[tuple[float, float]] = []
        for run in runs:
            arrival.extend(run.projection_pairs)
            placement.extend(run.placement_pairs)
        return cls(PredictionError.of(arrival), PredictionError.of(placement))

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {"arrival": self.arrival.as_json(), "placement": self.placement.as_json()}


@attrs.frozen
class Bar:
    """The quality bar's targets.

    Attributes:
        goodput_ratio: least goodput in engine work over its bound, at every load of
            ``goodput_loads`` and every other load run (predictive mode).
        goodput_loads: the loads the goodput target must be checked at (one not run is a
            verdict not run).
        bound_excess: how far above the bound goodput may go before the bound is called wrong
            (0: any goodput above 100 % of the engine-work bound fails, in every mode).
        in_budget_fraction: least share of admitted requests inside the budget, at the loads
            of ``in_budget_loads``.
        in_budget_loads: where the in-budget target applies (overload).
        false_refusal_rate: most estimated false refusals, as a share of offered, at the
            loads of ``false_refusal_loads``.
        false_refusal_loads: where the false-refusal target applies (light load).
        prediction_median: most median absolute error of the projection at arrival.
        prediction_p90: most 90th-percentile absolute error of the projection at arrival.
        memory_bytes: most memory added by the retention and queue limits, full (``None``: no
            memory target).
        baselines: the modes predictive must beat at every load of ``goodput_loads`` (and
            every other load run), on goodput in budget over its bound (engine work; each run
            over its own bound, which under overload is the engines' count for both) and on
            the in-budget share of admitted requests: at least as high (a baseline not run:
            not run).
        noise_errors: how many of the capacity measurement's relative standard errors
            (:attr:`Capacity.noise`) goodput may pass the bound by before it is called wrong,
            where the bound's capacity is a measured rate (with the engines' count, an exact
            figure, there is no noise to allow for).
        false_refusal_min_samples: the fewest forced-in refusals the false-refusal check runs
            on (fewer refusals than that: all of them); a smaller sample is not run.
    """

    goodput_ratio: float = 0.90
    goodput_loads: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0)
    bound_excess: float = 0.0
    in_budget_fraction: float = 0.99
    in_budget_loads: tuple[float, ...] = (2.0, 3.0)
    false_refusal_rate: float = 0.01
    false_refusal_loads: tuple[float, ...] = (0.5,)
    prediction_median: float = 0.10
    prediction_p90: float = 0.30
    memory_bytes: int | None = 100_000_000
    baselines: tuple[str, ...] = ("queue-cap", "engine-cap")
    false_refusal_min_samples: int = 50
    noise_errors: float = 2.0


PASS, FAIL, NOT_RUN, INCOMPLETE = "PASS", "FAIL", "NOT RUN", "INCOMPLETE"

_ROUNDING = 1e-9
"""What the bound check lets pass for floating-point rounding (sums of many step charges)."""


@attrs.frozen
class Check:
    """One verdict.

    Attributes:
        name: what is checked.
        passed: ``True``, ``False``, or ``None`` when its figure was not measured (not run:
            never a pass).
        measured: the predictive figure, as printed.
        target: the target, as printed.
        open_mode: the same figure in open mode, for comparison (``None`` where it has none).
        note: a figure reported beside it, not checked (the prediction at placement, goodput
            in requests).
    """

    name: str
    passed: bool | None
    measured: str
    target: str
    open_mode: str | None = None
    note: str | None = None

    @property
    def verdict(self) -> str:
        """``PASS``, ``FAIL`` or ``NOT RUN``."""
        return NOT_RUN if self.passed is None else (PASS if self.passed else FAIL)

    def as_json(self) -> dict[str, Any]:
        """Plain values for the JSON report."""
        return {**attrs.asdict(self), "verdict": self.verdict}


def overall_verdict(passed: Iterable[bool | None]) -> str:
    """``FAIL`` if a check failed; else ``INCOMPLETE`` if one did not run (or there is none);
    else ``PASS``. A target left unchecked is never a pass."""
    values = list(passed)
    if any(value is False for value in values):
        return FAIL
    if not values or any(value is None for value in values):
        return INCOMPLETE
    return PASS


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f} %"


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def _at_most(value: float | None, target: float) -> bool | None:
    return None if value is None else value <= target


def _rate_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}/s"


def _false_refusal_check(load: float, false: FalseRefusals | None, bar: Bar) -> Check:
    """The false-refusal verdict: run on at least ``bar.false_refusal_min_samples`` forced-in
    refusals, or on every refusal when there were fewer; otherwise not run."""
    name = f"false refusals at {load:g}x (share of offered)"
    target = f"<= {_pct(bar.false_refusal_rate)}"
    if false is None:
        return Check(name, None, "n/a", target, note="not sampled")
    sampled, refused = len(false.sampled), false.refused
    enough = sampled >= bar.false_refusal_min_samples or sampled >= refused
    if not enough:
        return Check(
            name,
            None,
            _pct(false.rate),
            target,
            note=f"{sampled} of {refused} refusals sampled, fewer than "
            f"{bar.false_refusal_min_samples}: not run",
        )
    if refused < bar.false_refusal_min_samples:
        note = f"all {refused} refusals forced in (fewer than {bar.false_refusal_min_samples})"
    else:
        note = f"{sampled} of {refused} refusals forced in"
    note += f"; {len(false.met_budget)} met the budget"
    if false.horizon_s is not None:
        note += f", {len(false.false)} without taking as much from those around them"
    return Check(
        name, _at_most(false.rate, bar.false_refusal_rate), _pct(false.rate), target, note=note
    )


def _goodput_note(run: ReplayFigures) -> str:
    """Beside the goodput verdict: goodput in requests, and the most any policy could reach of
    the headline bound (the deadline bound over it) where that is under 100 %: a target above
    it is out of every policy's reach on this trace and load."""
    note = f"requests {_pct(run.goodput_ratio)}"
    ceiling = safe_ratio(run.deadline_engine, run.bound_engine)
    if ceiling is not None and _pct(ceiling) != _pct(1.0):
        note += f"; no policy above {_pct(ceiling)} (the deadline bound)"
    return note


def evaluate(
    runs: Sequence[ReplayFigures],
    bar: Bar,
    *,
    memory_added_bytes: int | None = None,
) -> list[Check]:
    """The quality bar's verdicts for predictive mode, open mode's figures beside them.

    Every target of ``bar`` gets a verdict, ``NOT RUN`` where its load, its sample or its
    measurement is missing; and every run, whatever its mode, is checked against the bound.
    """
    predictive = {run.load: run for run in runs if run.mode == "predictive"}
    open_mode = {run.load: run for run in runs if run.mode == "open"}
    checks: list[Check] = []
    for load in sorted(set(bar.goodput_loads) | set(predictive)):
        run, other = predictive.get(load), open_mode.get(load)
        value = None if run is None else run.goodput_engine_ratio
        checks.append(
            Check(
                f"goodput / bound (engine work) at {load:g}x",
                _at_least(value, bar.goodput_ratio),
                _pct(value),
                f">= {_pct(bar.goodput_ratio)}",
                None if other is None else _pct(other.goodput_engine_ratio),
                None if run is None else _goodput_note(run),
            )
        )
    for load in sorted(bar.in_budget_loads):
        run, other = predictive.get(load), open_mode.get(load)
        value = None if run is None else run.in_budget_fraction
        checks.append(
            Check(
                f"admitted in budget at {load:g}x",
                _at_least(value, bar.in_budget_fraction),
                _pct(value),
                f">= {_pct(bar.in_budget_fraction)}",
                None if other is None else _pct(other.in_budget_fraction),
            )
        )
    for load in sorted(bar.false_refusal_loads):
        run = predictive.get(load)
        false = None if run is None else run.false_refusals
        checks.append(_false_refusal_check(load, false, bar))
    by_mode: dict[str, dict[float, ReplayFigures]] = {}
    for run in runs:
        by_mode.setdefault(run.mode, {})[run.load] = run
    for baseline in bar.baselines:
        theirs = by_mode.get(baseline, {})
        for load in sorted(set(bar.goodput_loads) | set(predictive)):
            run, other = predictive.get(load), theirs.get(load)
            for what, ours, them, text in (
                (
                    # Over each run's own bound: engine time depends a little on where a
                    # request ran (an engine a few % slower is charged more), so two runs that
                    # both serve everything in budget tie at 100 % rather than differ by
                    # placement; under overload both bounds are the engines' count.
                    "goodput / bound (engine work)",
                    None if run is None else run.goodput_engine_ratio,
                    None if other is None else other.goodput_engine_ratio,
                    _pct,
                ),
                (
                    "in-budget share",
                    None if run is None else run.in_budget_fraction,
                    None if other is None else other.in_budget_fraction,
                    _pct,
                ),
            ):
                checks.append(
                    Check(
                        f"{what} at {load:g}x: predictive vs {baseline}",
                        None if ours is None or them is None else ours >= them,
                        text(ours),
                        f">= {text(them)}",
                        note=f"{baseline} not run" if other is None else f"{baseline} {text(them)}",
                    )
                )
    for run in sorted(runs, key=lambda run: (run.load, run.mode != "predictive", run.mode)):
        value = run.goodput_engine_ratio
        allowed = 1.0 + bar.bound_excess + bar.noise_errors * run.capacity_noise
        note = "above: the bound is wrong"
        if run.capacity_noise > 0:
            note += f"; {bar.noise_errors:g} x the capacity's noise {_pct(run.capacity_noise)}"
        elif run.busy_engine is not None:
            note += "; the engines' own time, no allowance"
        checks.append(
            Check(
                f"goodput within the bound (engine work) at {run.load:g}x {run.mode}",
                _at_most(value, allowed + _ROUNDING),
                _pct(value),
                f"<= {_pct(allowed)}",
                note=note,
            )
        )
    pooled = Prediction.pooled(predictive.values())
    arrival, placement = pooled.arrival, pooled.placement
    for label, value, placed, target in (
        ("median", arrival.median_abs, placement.median_abs, bar.prediction_median),
        ("p90", arrival.p90_abs, placement.p90_abs, bar.prediction_p90),
    ):
        checks.append(
            Check(
                f"TTFT projection at arrival, {label} abs error",
                _at_most(value, target),
                _pct(value),
                f"<= {_pct(target)}",
                note=f"at placement {_pct(placed)}",
            )
        )
    if bar.memory_bytes is not None:
        checks.append(
            Check(
                "memory, 1024 retained / 256 queued",
                _at_most(memory_added_bytes, bar.memory_bytes),
                "n/a" if memory_added_bytes is None else f"{memory_added_bytes / 1e6:.1f} MB",
                f"<= {bar.memory_bytes / 1e6:.0f} MB",
            )
        )
    return checks
