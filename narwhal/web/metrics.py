"""Prometheus exposition of the router's snapshots (``prometheus-client``).

Counters and gauges are not updated on the hot path: a collector reads the same
``statistics()`` snapshots ``/ready`` shows at scrape time, so ``/metrics`` and ``/ready`` can
never disagree. Only the latency histograms are observed per request.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, get_args

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from narwhal.admission.accounting import TERMINAL_CLASSES
from narwhal.admission.observer import Decision, Served
from narwhal.control.state import LeaseState, RouterState

if TYPE_CHECKING:
    from narwhal.router import Router
    from narwhal.scheduling.engines import EngineStatistics

__all__ = ["CONTENT_TYPE", "GAP_BUCKETS", "CountingHistogram", "Metrics", "bucket_counts"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)
_SHADOW_REASONS = ("ttft_budget_exceeded", "prompt_exceeds_ttft_budget")


class _RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        stats = self._router.statistics()
        books = stats.accounting
        offered = CounterMetricFamily("narwhal_offered", "Requests offered to a completion route")
        offered.add_metric([], books.offered)
        yield offered
        unsized = CounterMetricFamily(
            "narwhal_unsized_offered", "Offered requests that ended before they were sized"
        )
        unsized.add_metric([], books.unsized_offered)
        yield unsized
        for terminal in TERMINAL_CLASSES:
            family = CounterMetricFamily(
                f"narwhal_{terminal}", f"Requests ended as {terminal}", labels=["reason"]
            )
            for (name, reason), count in sorted(books.by_reason.items()):
                if name == terminal:
                    family.add_metric([reason], count)
            yield family
        yield GaugeMetricFamily(
            "narwhal_in_flight", "Offered requests not yet ended", value=books.in_flight
        )
        yield GaugeMetricFamily(
            "narwhal_queue_depth", "Requests waiting for placement", value=stats.queue.depth
        )
        yield GaugeMetricFamily(
            "narwhal_http_retention_in_use",
            "HTTP retention slots held",
            value=stats.retention.in_use,
        )
        occupancy = GaugeMetricFamily(
            "narwhal_engine_occupancy", "Requests per engine and phase", labels=["engine", "phase"]
        )
        eligible = GaugeMetricFamily(
            "narwhal_engine_eligible", "1 when the engine may take new work", labels=["engine"]
        )
        profiled = GaugeMetricFamily(
            "narwhal_engine_profiled",
            "1 once a profiling measured the engine (its forecast is fitted to it)",
            labels=["engine"],
        )
        drift = GaugeMetricFamily(
            "narwhal_engine_drift_ratio",
            "Observed over predicted time per engine and phase (ttft acts, tpot is shown)",
            labels=["engine", "phase"],
        )
        for engine in stats.engines:
            occupancy.add_metric([engine.name, "prefill"], engine.prefill)
            occupancy.add_metric([engine.name, "decode"], engine.decode)
            eligible.add_metric([engine.name], int(engine.eligible))
            profiled.add_metric([engine.name], int(engine.profiled))
            drift.add_metric([engine.name, "ttft"], engine.drift.ttft)
            drift.add_metric([engine.name, "tpot"], engine.drift.tpot)
        yield occupancy
        yield eligible
        yield profiled
        yield drift
        margin = self._router.margin
        yield GaugeMetricFamily(
            "narwhal_admission_safety_factor",
            "The 99th percentile of observed over predicted wait, recent admitted requests",
            value=margin.factor,
        )
        refusing = margin.overloaded(
            trio.current_time(), self._router.config.admission.ttft_budget_s
        )
        yield GaugeMetricFamily(
            "narwhal_admission_caution_quantile",
            "The quantile the caution's parts are read at: 0.5 while admission is not refusing "
            "(0.2 for a request of a tick); while it is, 0.95 while what is admitted meets the "
            "budget, else 0.99",
            value=margin.caution_quantile(overloaded=refusing),
        )
        yield GaugeMetricFamily(
            "narwhal_admission_recent_misses",
            "Of the last 512 admitted requests, those whose first token missed the budget",
            value=margin.recent_misses,
        )
        yield GaugeMetricFamily(
            "narwhal_admission_tick_share",
            "The share of recent instants that held more than one arrival: for a request "
            "alone in its instant, the chance a projection gives that more join its step",
            value=self._router.ticks.share,
        )
        yield from _monitoring(self._router, stats.engines)
        yield from _control(self._router, stats.state)


class CountingHistogram(Collector):
    """A histogram observed many times at once (:meth:`observe` with a count), exposed as
    ``prometheus-client``'s own histograms are (buckets, count, sum, created).

    For the inter-token gaps, observed per output event: the events one network read
    delivered are one observation of the gap before them and one of zero for each of the
    others, which come with it. Observed on the router's one Trio thread only.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._created = time.time()

    def observe(self, amount: float, count: int = 1) -> None:
        """Observe ``amount``, ``count`` times."""
        self._counts[bisect_left(self._bounds, amount)] += count
        self._sum += amount * count

    def add(self, counts: Iterable[Sequence[int]], total: float) -> None:
        """Add observations counted elsewhere into the same buckets (:func:`bucket_counts`):
        ``[bucket, count]`` pairs, and the sum of what they counted."""
        for bucket, count in counts:
            self._counts[bucket] += count
        self._sum += total

    def collect(self) -> Iterator[Metric]:
        cumulative, total = [], 0
        labels = [*(repr(float(bound)) for bound in self._bounds), "+Inf"]  # as Histogram's
        for label, count in zip(labels, self._counts, strict=True):
            total += count
            cumulative.append((label, float(total)))
        family = HistogramMetricFamily(
            self._name, self._documentation, buckets=cumulative, sum_value=self._sum
        )
        family.samples.append(Sample(f"{self._name}_created", {}, self._created))
        yield family


def bucket_counts(
    bounds: Sequence[float], observations: Iterable[tuple[float, int]]
) -> tuple[list[list[int]], float]:
    """``(amount, count)`` observations counted into ``bounds``' buckets, as
    :meth:`CountingHistogram.add` takes them: ``[bucket, count]`` pairs and their sum."""
    counts: dict[int, int] = {}
    total = 0.0
    for amount, count in observations:
        bucket = bisect_left(bounds, amount)
        counts[bucket] = counts.get(bucket, 0) + count
        total += amount * count
    return [[bucket, count] for bucket, count in counts.items()], total


_ROUTER_STATES = get_args(RouterState)
_LEASE_STATES = get_args(LeaseState)


def _control(router: Router, state: str) -> Iterator[Metric]:
    """The router's state and its lease (narwhal.control.state, narwhal.control.lease)."""
    routed = GaugeMetricFamily(
        "narwhal_router_state", "1 for the router's state, 0 for the others", labels=["state"]
    )
    for name in _ROUTER_STATES:
        routed.add_metric([name], int(name == state))
    yield routed
    lease = router.lease.statistics()
    held = GaugeMetricFamily(
        "narwhal_lease_state",
        "1 for the lease's own condition, 0 for the others",
        labels=["backend", "state"],
    )
    for name in _LEASE_STATES:
        held.add_metric([lease.backend, name], int(name == lease.state))
    yield held
    token = GaugeMetricFamily(
        "narwhal_lease_fencing_token",
        "The fencing token sent to engines in x-narwhal-fence (absent until the key was held)",
    )
    if lease.token is not None:
        token.add_metric([], lease.token)
    yield token
    for name, count, meaning in (
        ("renewals", lease.renewals, "Successful renewals of this router's lease"),
        ("failures", lease.failures, "Failed or timed-out requests to the lease store"),
        ("fences", lease.fences, "Times this router fenced itself (it could not renew in time)"),
    ):
        family = CounterMetricFamily(f"narwhal_lease_{name}", meaning)
        family.add_metric([], count)
        yield family


def _monitoring(router: Router, engines: tuple[EngineStatistics, ...]) -> Iterator[Metric]:
    """The watchdog's view (narwhal.control.watchdog): loop lag, degraded, poll ages."""
    watchdog = router.watchdog.statistics()
    lag = GaugeMetricFamily(
        "narwhal_loop_lag_seconds", "How late the watchdog's last check woke (event-loop lag)"
    )
    lag.add_metric([], watchdog.loop_lag_s)
    yield lag
    worst = GaugeMetricFamily(
        "narwhal_loop_lag_max_seconds", "The largest event-loop lag seen since the start"
    )
    worst.add_metric([], watchdog.worst_loop_lag_s)
    yield worst
    degraded = GaugeMetricFamily(
        "narwhal_monitoring_degraded", "1 while the watchdog holds the router monitoring-degraded"
    )
    degraded.add_metric([], int(watchdog.degraded))
    yield degraded
    times = CounterMetricFamily(
        "narwhal_monitoring_degraded_entered", "Times the router became monitoring-degraded"
    )
    times.add_metric([], watchdog.times_degraded)
    yield times
    ages = GaugeMetricFamily(
        "narwhal_engine_poll_age_seconds",
        "Age of the last good health or metrics poll per engine",
        labels=["engine", "poll"],
    )
    reported = GaugeMetricFamily(
        "narwhal_engine_reported",
        "The engine's own gauges at its last good metrics poll",
        labels=["engine", "gauge"],
    )
    for engine in engines:
        if engine.health_age_s is not None:
            ages.add_metric([engine.name, "health"], engine.health_age_s)
        if engine.metrics_age_s is not None:
            ages.add_metric([engine.name, "metrics"], engine.metrics_age_s)
        if engine.metrics is not None:
            for gauge, value in engine.metrics.as_json().items():
                if value is not None:
                    reported.add_metric([engine.name, gauge], value)
    yield ages
    yield reported


class Metrics:
    """The router's registry: snapshot collectors plus the per-request histograms.

    It is an admission observer (:mod:`narwhal.admission.observer`): the TTFT histograms, the
    projection's and the forecast's errors and shadow mode's would-be refusals come from what
    admission decided and how each admitted request turned out.
    """

    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RouterCollector(router))
        self.client_timeouts = Counter(
            "narwhal_client_timeouts",
            "Clients that did not send a request head (or body) in time",
            labelnames=["phase"],
            registry=self.registry,
        )
        self.client_timeouts.labels(phase="headers")
        self.ttft = Histogram(
            "narwhal_ttft_seconds",
            "Arrival to first output event",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_gap = CountingHistogram(
            "narwhal_inter_token_gap_seconds",
            "Time between two output events of one stream",
            GAP_BUCKETS,
        )
        self.registry.register(self.inter_token_gap)

        self.queue_wait = Histogram(
            "narwhal_queue_wait_seconds",
            "Enqueue to placement",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.predicted_ttft_error_ratio = Histogram(
            "narwhal_predicted_ttft_error_ratio",
            "Observed over predicted time to first token (the prediction at placement)",
            buckets=_RATIO_BUCKETS,
            registry=self.registry,
        )
        self.projected_ttft_error_ratio = Histogram(
            "narwhal_projected_ttft_error_ratio",
            "Observed time to first token over the typical projection at arrival",
            buckets=_RATIO_BUCKETS,
            registry=self.registry,
        )
        self.shadow_refusals = Counter(
            "narwhal_shadow_refusals",
            "Refusals predictive admission would have made, recorded and not applied",
            labelnames=["reason"],
            registry=self.registry,
        )
        for reason in _SHADOW_REASONS:
            self.shadow_refusals.labels(reason=reason)

    def decided(self, decision: Decision) -> None:
        """Count a would-be refusal (shadow mode)."""
        if decision.shadow_refusal:
            self.shadow_refusals.labels(reason=decision.code).inc()

    def served(self, decision: Decision, served: Served) -> None:
        """Observe a completed request's TTFT and the errors of what predicted it."""
        ttft = served.ttft_s
        if ttft is None:
            return
        self.ttft.observe(ttft)
        placement = served.placement_error
        if placement is not None:
            self.predicted_ttft_error_ratio.observe(placement)
        projection = served.projection_error(decision)
        if projection is not None:
            self.projected_ttft_error_ratio.observe(projection)

    def count_client_timeout(self, phase: str) -> None:
        """One client too slow to send its request (``phase``: ``headers`` or ``body``)."""
        self.client_timeouts.labels(phase=phase).inc()

    def render(self) -> bytes:
        """The text exposition."""
        return generate_latest(self.registry)
