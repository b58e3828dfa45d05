"""``narwhal bench probes``: its summaries and verdict by plain calls (the run itself is real
time and is not part of the test suite)."""

from __future__ import annotations

from narwhal.bench.probes import PROBES, ProbeReport, ProbeSettings, ProbeSummary


def summary(probe: str, phase: str, latencies: list[float], timeouts: int = 0) -> ProbeSummary:
    return ProbeSummary.of(probe, phase, latencies, ["200"] * len(latencies), timeouts)


def report(probe_max_s: float, *, timeouts: int = 0) -> ProbeReport:
    summaries = []
    for phase in ("idle", "load"):
        for probe in PROBES:
            worst = probe_max_s if probe.startswith("probe") and phase == "load" else 0.9
            summaries.append(summary(probe, phase, [0.001, 0.002, worst], timeouts))
    return ProbeReport(
        settings=ProbeSettings().as_json(),
        environment={},
        summaries=tuple(summaries),
        load={"requests": 10, "wall_s": 2.0, "outcomes": {"completed": 10}},
        worst_loop_lag_s=0.3,
    )


def test_a_summary_has_the_percentiles_and_the_statuses() -> None:
    got = ProbeSummary.of("probe /ready", "load", [0.003, 0.001, 0.002], ["200", "503", "200"], 0)
    assert (got.samples, got.max_s) == (3, 0.003)
    assert got.p50_s == 0.002
    assert got.statuses == {"200": 2, "503": 1}


def test_the_verdict_is_every_probe_port_answer_under_load_within_the_target() -> None:
    assert report(0.099).passed
    assert not report(0.101).passed
    assert not report(0.05, timeouts=1).passed  # a probe unanswered is no pass


def test_the_report_renders_every_probe_and_the_verdict() -> None:
    text = report(0.05).render()
    for probe in PROBES:
        assert probe in text
    assert "PASS: every probe-port answer under load within 100 ms" in text
    assert "router's worst event-loop lag: 300 ms" in text
    assert report(0.5).as_json()["passed"] is False
