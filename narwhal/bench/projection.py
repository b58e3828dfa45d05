"""What one TTFT projection and one dispatcher pass cost, on a loaded pool (CPU time).

Predictive admission projects every arriving request, and the dispatcher walks the queue with
the same placement rule (:mod:`narwhal.admission.plan`) whenever a slot frees: both run on the
router's one event loop, so their cost is paid by every request in flight. This benchmark
builds the state of a router at about 3x its capacity: ``engines`` engines with ``running``
requests among them (a few in prefill, the rest decoding, part of their output generated) and
``queued`` requests waiting, prompt and output sizes drawn from the bundled conversation trace,
output lengths learned from it. It then times ``projections`` projections of a newcomer and as
many dispatcher passes that find one prefill slot free. Between projections (untimed) Trio's
MockClock moves by one arrival's gap and each decoding request produces the tokens its
engine's step time gives by then, as a running request does: a plan walked again finds the
running requests further on, so that nothing computed from their counts is found again for
free (on a state that did not move, a cache keyed on it would flatter the figures).

The figures are CPU time per call (``time.thread_time`` around each: the CPU this thread spent,
so that other processes on a shared machine count less; p50 and p99 over the calls, and their
mean, after a warm-up), on this machine; the target is at most 100 us per projection at 500
running and 150 queued, on average: the projections that find the queue's plan too old and walk
it again are counted in.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import attrs
import trio
import trio.testing

from narwhal.admission.margin import SafetyMargin
from narwhal.admission.predictor import project
from narwhal.admission.queue import AdmissionQueue, Waiter
from narwhal.bench.trace import load_trace
from narwhal.config import EngineConfig
from narwhal.scheduling.engines import Engine, EnginePool, Slot
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.lengths import OutputLengths
from narwhal.scheduling.profiles import get_profile

__all__ = ["ProjectionCost", "ProjectionSettings", "measure_projection_cost"]

TARGET_US = 100.0


@attrs.frozen
class ProjectionSettings:
    """The state measured, and how many calls.

    Attributes:
        engines: engines in the pool.
        running: requests placed among them (prefill and decode).
        queued: requests waiting in the admission queue.
        projections: calls timed, of each kind.
        arrivals_per_s: the virtual clock moves by one arrival's gap before each projection
            (about 3x the capacity of four H100s on the conversation trace), so the queue's
            plan is walked again as often as it would be (every 0.25 s).
        seed: draws the sizes.
    """

    engines: int = 4
    running: int = 500
    queued: int = 150
    projections: int = 400
    arrivals_per_s: float = 230.0
    seed: int = 0


@attrs.frozen
class ProjectionCost:
    """CPU time per call, in microseconds."""

    settings: ProjectionSettings
    projection_p50_us: float
    projection_p99_us: float
    projection_mean_us: float
    dispatch_p50_us: float
    dispatch_p99_us: float
    dispatch_mean_us: float

    @property
    def passed(self) -> bool:
        """Whether the mean projection, walks of the plan included, is within
        :data:`TARGET_US`."""
        return self.projection_mean_us <= TARGET_US

    def as_json(self) -> dict[str, Any]:
        """The figures, and the verdict."""
        return {
            "settings": attrs.asdict(self.settings),
            "projection_us": {
                "p50": self.projection_p50_us,
                "p99": self.projection_p99_us,
                "mean": self.projection_mean_us,
            },
            "dispatch_us": {
                "p50": self.dispatch_p50_us,
                "p99": self.dispatch_p99_us,
                "mean": self.dispatch_mean_us,
            },
            "target_us": TARGET_US,
            "verdict": "PASS" if self.passed else "FAIL",
        }

    def render(self) -> str:
        """The printed report."""
        s = self.settings
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join(
            [
                f"Projection cost: {s.engines} engines, {s.running} running, {s.queued} queued",
                f"  projection      p50 {self.projection_p50_us:8.1f} us   "
                f"p99 {self.projection_p99_us:8.1f} us   mean {self.projection_mean_us:8.1f} us",
                f"  dispatcher pass p50 {self.dispatch_p50_us:8.1f} us   "
                f"p99 {self.dispatch_p99_us:8.1f} us   mean {self.dispatch_mean_us:8.1f} us",
                f"  target: projection mean <= {TARGET_US:g} us: {verdict}",
            ]
        )


def measure_projection_cost(settings: ProjectionSettings) -> ProjectionCost:
    """Build the loaded state and time the calls (in a Trio run of its own)."""
    result: list[ProjectionCost] = []

    clock = trio.testing.MockClock()

    async def main() -> None:
        result.append(_measure(settings, clock))

    trio.run(main, clock=clock)
    return result[0]


def _measure(settings: ProjectionSettings, clock: trio.testing.MockClock) -> ProjectionCost:
    rng = random.Random(settings.seed)
    rows = load_trace("conv")
    lengths = OutputLengths()
    for row in rng.sample(rows, 512):
        lengths.learn("chat", None, row.output_tokens, row.prompt_tokens)
    profile = get_profile("h100-llama3-8b")
    engines = [
        Engine(
            EngineConfig(name=f"engine-{n}", url="http://127.0.0.1:1"),
            client=cast(Any, None),
            prefill_limit=4,
            decode_limit=max(128, -(-settings.running // settings.engines) + 4),
            forecast=PrefillForecast(profile, prefill_limit=4),
        )
        for n in range(settings.engines)
    ]
    for engine in engines:
        engine.poll_succeeded(0.0)
    pool = EnginePool(engines, tpot_target_s=0.1)
    placed: list[tuple[Slot, int]] = []
    for number in range(settings.running):
        engine = engines[number % len(engines)]
        row = rng.choice(rows)
        placed.append((Slot.take(engine, row.prompt_tokens, max_tokens=None), row.output_tokens))
    # First come, first served: on each engine the last four placed stay in prefill, and those
    # before them have had their first tokens and decode. (Prompts placed later having theirs
    # first would leave the four seconds overdue, a state no engine is in.)
    for number, (slot, output_tokens) in enumerate(placed):
        if number < len(placed) - 4 * len(engines):
            slot.to_decode()
            slot.generated(rng.randrange(0, max(1, output_tokens)))
    sizes = [rng.choice(rows).prompt_tokens for _ in range(settings.queued)]

    def queue_of(sizes: list[int]) -> AdmissionQueue:
        queue = AdmissionQueue(pool, settings.queued + 16, lengths)
        for tokens in sizes:
            queue.enqueue(Waiter(tokens, False, "chat", None))
        return queue

    queue = queue_of(sizes)
    margin = SafetyMargin()
    newcomers = [Waiter(rng.choice(rows).prompt_tokens, False, "chat", None) for _ in range(64)]

    decoding: dict[Engine, list[Slot]] = {engine: [] for engine in engines}
    for slot, _ in placed:
        if slot.phase == "decode":
            decoding[slot.engine].append(slot)
    step_s = {engine: engine.forecast.tpot_s() for engine in engines}
    started = trio.current_time()
    produced = dict.fromkeys(engines, 0)

    def arrival() -> None:
        """The next arrival's gap passes: the decoding requests produce their tokens."""
        clock.jump(1.0 / settings.arrivals_per_s)
        for engine, slots in decoding.items():
            due = int((trio.current_time() - started) / step_s[engine])
            tokens, produced[engine] = due - produced[engine], due
            if tokens:
                for slot in slots:
                    slot.generated(tokens)

    def projection() -> None:
        project(
            pool,
            (),
            newcomers[rng.randrange(len(newcomers))],
            lengths,
            now=trio.current_time(),
            elapsed_s=0.0,
            overhead_s=0.005,
            margin=margin,
            tpot_target_s=0.1,
            plan=queue.current_plan(),
        )

    # A dispatcher pass that finds one prefill slot free, with the queue's plan current;
    # between passes, what it placed is given back and the queue is as it was.
    next(slot for slot in engines[0].slots if slot.phase == "prefill").release()
    current: list[tuple[AdmissionQueue, list[Waiter]]] = []

    def fresh_queue() -> None:
        if current:
            _, waiters = current.pop()
            for waiter in waiters:
                if waiter.slot is not None:
                    waiter.slot.release()
        fresh = queue_of(sizes)
        fresh.current_plan()  # walked between passes, as it is after a newcomer's projection
        current.append((fresh, fresh.waiting()))

    def dispatch() -> None:
        current[-1][0].dispatch()

    return ProjectionCost(
        settings,
        *_timed(projection, settings.projections, setup=arrival),
        *_timed(dispatch, settings.projections, setup=fresh_queue),
    )


def _timed(
    call: Callable[[], None], count: int, *, setup: Callable[[], None] = lambda: None
) -> tuple[float, float, float]:
    """p50, p99 and mean of ``call``'s time (us), ``setup`` run untimed before each call."""
    for _ in range(min(20, count)):
        setup()
        call()
    times = []
    for _ in range(count):
        setup()
        started = time.thread_time()
        call()
        times.append((time.thread_time() - started) * 1e6)
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return statistics.median(times), p99, statistics.fmean(times)
