"""Shadow mode and the admission observer seam, at exact virtual times.

Shadow mode projects and judges every request as predictive mode does, and refuses none of
them; what admission decided is told to the router's observers (the metrics, the benchmark).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal import router as deciding  # where admission judges a projection
from narwhal.admission.observer import Decision, Served
from narwhal.admission.predictor import Projection
from narwhal.bench import replay
from narwhal.cli import main
from narwhal.config import AdmissionConfig, ConfigError, config_from_mapping
from narwhal.scheduling.health import Failure
from tests.conftest import MODEL, Fleet, StartFleet

PROMPT = "word " * 4000  # ~5k tokens: ~0.16 s of prefill each on the H100 profile
HUGE = "word " * 80_000  # ~100k tokens: its prefill alone is over a 1 s budget
ROUND_S = 60.0  # rounds this far apart: the previous round has drained


@attrs.define
class Seen:
    """One decision as a test observer saw it, and its outcome."""

    at: float
    decision: Decision
    served: Served | None = None


@attrs.define
class Watcher:
    """A test observer: every decision with its virtual time, and how it turned out."""

    seen: list[Seen] = attrs.field(factory=list)
    _current: dict[int, Seen] = attrs.field(factory=dict)

    def decided(self, decision: Decision) -> None:
        self.seen.append(Seen(trio.current_time(), decision))
        self._current[id(decision)] = self.seen[-1]

    def served(self, decision: Decision, served: Served) -> None:
        self._current[id(decision)].served = served


def config(mode: str) -> AdmissionConfig:
    return AdmissionConfig(mode=mode, ttft_budget_s=1.0, prefill_concurrency=64)  # type: ignore[arg-type]


async def post(fleet: Fleet, content: str, results: list[httpx.Response]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "narwhal_sim": {"output_tokens": 2},
    }
    results.append(await fleet.client.post("/v1/chat/completions", json=body))


# Each round: a burst of prompts 1 ms apart, or a prompt too long for the budget. The last
# prompt of each burst is the first one the projection puts over the budget, and each round has
# drained before the next: shadow mode, which admits what predictive refuses, then changes
# nothing that a later decision sees.
ROUNDS: tuple[tuple[int, bool], ...] = ((5, False), (0, True), (5, False))


async def run_rounds(fleet: Fleet) -> list[httpx.Response]:
    results: list[httpx.Response] = []
    origin = trio.current_time()
    async with trio.open_nursery() as nursery:
        for number, (burst, huge) in enumerate(ROUNDS):
            start = origin + number * ROUND_S
            for index in range(burst):
                await trio.sleep_until(start + index * 0.001)
                nursery.start_soon(post, fleet, PROMPT, results)
            if huge:
                await trio.sleep_until(start + burst * 0.001)
                nursery.start_soon(post, fleet, HUGE, results)
    return results


async def watched_rounds(start_fleet: StartFleet, mode: str) -> tuple[Fleet, Watcher, float]:
    fleet = await start_fleet([("sim-a", "vllm")], admission=config(mode))
    watcher = Watcher()
    origin = trio.current_time()
    with fleet.router.observers.watching(watcher), trio.fail_after(300):
        responses = await run_rounds(fleet)
    if mode == "shadow":
        assert [r.status_code for r in responses] == [200] * len(responses)
    return fleet, watcher, origin


def times(projection: Projection) -> list[float]:
    return [projection.ttft_s, projection.typical_s, projection.wait_s, projection.own_prefill_s]


def verdicts(watcher: Watcher, origin: float) -> list[tuple[float, str | None, str | None]]:
    """(arrival time since origin, refusal code, Retry-After) of every decision."""
    return [
        (round(s.at - origin, 9), s.decision.code, s.decision.retry_after) for s in watcher.seen
    ]


async def test_shadow_records_the_refusals_predictive_makes_and_refuses_none(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    predictive, seen_p, origin_p = await watched_rounds(start_fleet, "predictive")
    shadow, seen_s, origin_s = await watched_rounds(start_fleet, "shadow")
    refusals = [(at, code, retry) for at, code, retry in verdicts(seen_p, origin_p) if code]
    # What predictive refused: the last prompt of each burst, and the prompt too long.
    assert refusals == [
        (0.004, "ttft_budget_exceeded", "1"),
        (ROUND_S, "prompt_exceeds_ttft_budget", None),
        (2 * ROUND_S + 0.004, "ttft_budget_exceeded", "1"),
    ]
    # Shadow mode judged every request alike, at the same instants, with the same headers.
    assert verdicts(seen_s, origin_s) == verdicts(seen_p, origin_p)
    for p, s in zip(seen_p.seen, seen_s.seen, strict=True):
        assert s.decision.headers == p.decision.headers
        assert s.decision.projection is not None and p.decision.projection is not None
        assert s.decision.projection.engine == p.decision.projection.engine
        # Equal but for rounding (the second fleet runs at later virtual times) and for what
        # the requests shadow mode admits where predictive refused teach the forecast when
        # their first tokens come (placed behind others, a little: PrefillForecast._learn_busy).
        assert times(s.decision.projection) == pytest.approx(times(p.decision.projection), rel=0.01)
    assert [s.decision.verdict for s in seen_p.seen if s.decision.code] == ["refused"] * 3
    assert [s.decision.verdict for s in seen_s.seen] == ["admitted"] * len(seen_s.seen)
    assert predictive.counters()["refused"] == 3
    counters = shadow.counters()
    assert counters["refused"] == 0 and counters["completed"] == len(seen_s.seen) == 11
    text = (await shadow.client.get("/metrics")).text
    assert 'narwhal_shadow_refusals_total{reason="ttft_budget_exceeded"} 2.0' in text
    assert 'narwhal_shadow_refusals_total{reason="prompt_exceeds_ttft_budget"} 1.0' in text
    # Predictive applies its refusals: nothing is counted as a shadow refusal there.
    text = (await predictive.client.get("/metrics")).text
    assert 'narwhal_shadow_refusals_total{reason="ttft_budget_exceeded"} 0.0' in text
    predictive.assert_quiescent()
    shadow.assert_quiescent()


async def test_every_admitted_request_scores_its_projection(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet, watcher, _ = await watched_rounds(start_fleet, "shadow")
    ratios = []
    for seen in watcher.seen:
        served, projection = seen.served, seen.decision.projection
        assert served is not None and projection is not None
        assert served.ttft_s is not None and served.engine == "sim-a"
        assert served.projection_error(seen.decision) == served.ttft_s / projection.typical_s
        ratios.append(served.ttft_s / projection.typical_s)
    text = (await fleet.client.get("/metrics")).text
    assert f"narwhal_projected_ttft_error_ratio_count {float(len(ratios))}" in text
    assert f"narwhal_predicted_ttft_error_ratio_count {float(len(ratios))}" in text
    # The histogram adds the ratios in the order the requests completed: equal up to rounding.
    summed = re.search(r"^narwhal_projected_ttft_error_ratio_sum (\S+)$", text, re.MULTILINE)
    assert summed is not None and float(summed.group(1)) == pytest.approx(sum(ratios))
    # The margin learns in shadow mode as in predictive (from the projections it would judge).
    assert fleet.router.margin.samples > 0


async def test_the_observer_sees_every_decision_in_open_mode_without_a_projection(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=config("open"))
    watcher = Watcher()
    origin = trio.current_time()
    with fleet.router.observers.watching(watcher), trio.fail_after(300):
        responses = await run_rounds(fleet)
    assert [r.status_code for r in responses] == [200] * 11
    assert len(watcher.seen) == 11
    assert [round(s.at - origin, 9) for s in watcher.seen[:4]] == [0.0, 0.001, 0.002, 0.003]
    for seen in watcher.seen:
        assert (seen.decision.mode, seen.decision.verdict) == ("open", "admitted")
        assert seen.decision.projection is None and seen.decision.code is None
        assert seen.served is not None and seen.served.ttft_s is not None
        assert seen.served.projection_error(seen.decision) is None
    text = (await fleet.client.get("/metrics")).text
    assert "narwhal_projected_ttft_error_ratio_count 0.0" in text
    assert "narwhal_predicted_ttft_error_ratio_count 11.0" in text
    # Left the observers: it is told nothing more.
    await fleet.chat(narwhal_sim={"output_tokens": 1})
    assert len(watcher.seen) == 11


@pytest.mark.parametrize("mode", ["open", "predictive", "shadow"])
async def test_the_observer_sees_a_request_no_engine_can_serve(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, mode: str
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=config(mode))
    watcher = Watcher()
    engine = fleet.router.pool.engines[0]
    engine.poll_failed(trio.current_time(), Failure("unhealthy", "/health answered 503"))
    with fleet.router.observers.watching(watcher):
        response = await fleet.chat()
    assert response.status_code == 503
    assert [(s.decision.verdict, s.decision.projection) for s in watcher.seen] == [
        ("unavailable", None)
    ]


async def test_ready_shows_the_mode(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(admission=config("shadow"))
    ready = await fleet.client.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["admission"] == {"mode": "shadow"}


def test_config_accepts_shadow_and_check_config_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engines = [{"name": "a", "url": "http://a.test"}]
    loaded = config_from_mapping({"admission": {"mode": "shadow"}, "engines": engines})
    assert loaded.admission.mode == "shadow"
    with pytest.raises(ConfigError, match="mode"):
        config_from_mapping({"admission": {"mode": "shade"}, "engines": engines})
    path = tmp_path / "shadow.toml"
    path.write_text(
        '[serving]\nmodel = "m"\n[admission]\nmode = "shadow"\n'
        '[[engines]]\nname = "a"\nurl = "http://a.test"\n'
    )
    assert main(["check-config", str(path)]) == 0
    assert 'mode = "shadow"' in capsys.readouterr().out


# -- the benchmark records through the seam what the old monkeypatch recorded -------------------

_ROW: contextvars.ContextVar[int | None] = contextvars.ContextVar("row", default=None)


@attrs.define
class _Oracle:
    """The benchmark's former hooks, reproduced: the budget check and the histograms wrapped."""

    projected: dict[int, float] = attrs.field(factory=dict)
    refused: dict[int, bool] = attrs.field(factory=dict)
    ttft: dict[int, float] = attrs.field(factory=dict)
    placement: dict[int, float] = attrs.field(factory=dict)


class _Spy:
    def __init__(self, histogram: Any, observe: Any) -> None:
        self._histogram, self._observe = histogram, observe

    def observe(self, value: float) -> None:
        self._observe(value)
        self._histogram.observe(value)


@contextlib.contextmanager
def old_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Oracle]:
    oracle = _Oracle()
    judge, send, open_fleet = deciding.judge, replay._send, replay.open_fleet

    def judging(projection: Projection, budget_s: float) -> Any:
        refusal = judge(projection, budget_s)
        row = _ROW.get()
        if row is not None:
            oracle.projected[row] = projection.typical_s
            oracle.refused[row] = refusal is not None
        return refusal

    async def sending(fleet: Any, row: Any, *args: Any) -> None:
        _ROW.set(row.index)
        await send(fleet, row, *args)

    def on_ttft(value: float) -> None:
        row = _ROW.get()
        if row is not None:
            oracle.ttft[row] = value

    def on_ratio(value: float) -> None:
        row = _ROW.get()
        if row is not None and row in oracle.ttft and value > 0:
            oracle.placement[row] = oracle.ttft[row] / value

    @contextlib.asynccontextmanager
    async def spied_fleet(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with open_fleet(*args, **kwargs) as fleet:
            metrics = fleet.router.metrics
            metrics.ttft = _Spy(metrics.ttft, on_ttft)
            ratio = metrics.predicted_ttft_error_ratio
            metrics.predicted_ttft_error_ratio = _Spy(ratio, on_ratio)
            yield fleet

    monkeypatch.setattr(deciding, "judge", judging)
    monkeypatch.setattr(replay, "_send", sending)
    monkeypatch.setattr(replay, "open_fleet", spied_fleet)
    yield oracle


SHORT = replay.VirtualSetup(replay.default_router(), duration_s=60.0)
BUSY = (200.0, 0.25)  # requests per second and budget: predictive refuses about a third


@pytest.mark.parametrize(("mode", "rate", "budget"), [("predictive", *BUSY), ("open", 38.4, 2.0)])
def test_the_benchmark_records_what_the_old_hooks_recorded(
    monkeypatch: pytest.MonkeyPatch, mode: str, rate: float, budget: float
) -> None:
    with old_hooks(monkeypatch) as oracle:
        result = replay.run_replay(replay.ReplayJob(SHORT, mode, rate, budget))  # type: ignore[arg-type]
    outcomes = result.outcomes
    assert len(outcomes) == len(SHORT.rows()) > 150
    projected = {o.index: o.projected_ttft_s for o in outcomes if o.projected_ttft_s is not None}
    assert projected == oracle.projected
    assert {o.index: o.router_ttft_s for o in outcomes if o.router_ttft_s is not None} == (
        oracle.ttft
    )
    placement = {o.index: o.placement_ttft_s for o in outcomes if o.placement_ttft_s is not None}
    assert placement == oracle.placement
    assert len(oracle.ttft) > 50
    if mode == "open":
        assert projected == {}
    else:
        assert len(projected) == len(outcomes)
        refused = {o.index for o in outcomes if o.refused}
        assert refused == {row for row, refuses in oracle.refused.items() if refuses}
        assert len(refused) >= 50  # enough refusals that the forced-in reruns have some


def test_a_forced_request_is_let_through_by_the_exempt_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = replay.run_replay(replay.ReplayJob(SHORT, "predictive", *BUSY))
    refused = [o.index for o in first.outcomes if o.refused]
    forced = refused[len(refused) // 2]
    with old_hooks(monkeypatch) as oracle:
        job = replay.ReplayJob(SHORT, "predictive", *BUSY, forced=forced)
        rerun = replay.run_replay(job)
    assert oracle.refused[forced] is True and rerun.forced_would_refuse is True
    outcome = next(o for o in rerun.outcomes if o.index == forced)
    # Let through, not refused: answered, or cut when its budget ran out (the rerun ends
    # then: a refusal that was right).
    assert not outcome.refused and outcome.status in (200, 0)
    assert outcome.projected_ttft_s == oracle.projected[forced]
    # Before the forced request, the rerun is the original run.
    before = [o for o in first.outcomes if o.index < forced]
    assert [o.refused for o in before] == [o.refused for o in rerun.outcomes if o.index < forced]
