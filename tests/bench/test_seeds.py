"""``narwhal bench admission --seeds``: the whole benchmark once per seed, judged by every seed.

One change can move a figure across its target by the seed alone (the wrong prior on the
bursty trace: 95.7 % of the bound at 2x with seed 0, 73.3 % with seed 1), so a verdict over
several seeds passes only if each seed's does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from narwhal.bench.admission import AdmissionSettings, run_seeds
from narwhal.bench.admission_report import AdmissionReport, SeedsReport
from narwhal.bench.cli import admission_json, main
from narwhal.bench.goodput import Capacity, Check
from narwhal.bench.html_report import load_reports
from narwhal.bench.replay import VirtualSetup, default_router


@pytest.fixture(scope="module")
def seeded() -> SeedsReport:
    settings = AdmissionSettings(
        setup=VirtualSetup(default_router(), duration_s=30.0),
        loads=(1.0,),
        modes=("predictive",),
        capacity=Capacity(rps=38.4, engine_s_per_s=1.86, measured=False),
        false_refusal_samples=(),
        false_refusal_default=0,
        memory=False,
        jobs=1,
    )
    lines: list[str] = []
    report = run_seeds(settings, (0, 1), echo=lines.append)
    # Each seed's progress says which seed it is.
    assert any(line.startswith("seed 0: replay") for line in lines)
    assert any(line.startswith("seed 1: replay") for line in lines)
    return report


def test_each_seed_runs_the_whole_benchmark_with_its_own_seed(seeded: SeedsReport) -> None:
    assert [seed for seed, _ in seeded.reports] == [0, 1]
    assert [report.settings["seed"] for _, report in seeded.reports] == [0, 1]
    first, second = (report.runs[0] for _, report in seeded.reports)
    # The same settings otherwise, and different traffic: the seed reached the replay.
    assert first.load == second.load == 1.0
    assert first.series["ttft_s"] != second.series["ttft_s"]
    assert seeded.checks == tuple(c for _, r in seeded.reports for c in r.checks)


def _with_checks(report: AdmissionReport, *passed: bool | None) -> AdmissionReport:
    checks = tuple(
        Check(f"check {number}", value, "1 %", "2 %") for number, value in enumerate(passed)
    )
    return attrs.evolve(report, checks=checks)


def test_the_verdict_passes_only_if_every_seed_passes(seeded: SeedsReport) -> None:
    report = seeded.reports[0][1]

    def verdict(*seeds: tuple[bool | None, ...]) -> str:
        reports = tuple((number, _with_checks(report, *s)) for number, s in enumerate(seeds))
        return SeedsReport(reports).verdict

    assert verdict((True, True), (True, True)) == "PASS"
    assert verdict((True, True), (True, False)) == "FAIL"
    assert verdict((True, None), (True, True)) == "INCOMPLETE"
    assert verdict((None, True), (False, True)) == "FAIL"
    both = SeedsReport(((0, _with_checks(report, True, True)), (1, _with_checks(report, True))))
    assert both.passed is False  # seed 1 never checked "check 1": not a pass
    assert both.verdict == "INCOMPLETE"


def test_the_printed_report_gives_each_check_by_seed(seeded: SeedsReport) -> None:
    report = seeded.reports[0][1]
    mixed = SeedsReport(
        ((0, _with_checks(report, True, False)), (3, _with_checks(report, True, None)))
    )
    text = mixed.render()
    assert "=== seed 0 ===" in text and "=== seed 3 ===" in text
    summary = text[text.index("=== every seed ===") :].splitlines()
    assert summary[1].split() == ["check", "seed", "0", "seed", "3"]
    assert summary[2].split() == ["check", "0", "1", "%", "PASS", "1", "%", "PASS"]
    assert summary[3].split() == ["check", "1", "1", "%", "FAIL", "1", "%", "NOT", "RUN"]
    assert summary[-1] == (
        "verdict: FAIL (1 failed, 1 not run of 4) (seed 0: FAIL, seed 3: INCOMPLETE)"
    )


def test_the_json_keeps_each_seeds_report_and_the_report_page_reads_it(
    seeded: SeedsReport, tmp_path: Path
) -> None:
    data: dict[str, Any] = orjson.loads(orjson.dumps(seeded.as_json()))
    assert data["seeds"] == [0, 1]
    assert [report["settings"]["seed"] for report in data["by_seed"]] == [0, 1]
    assert data["verdict"] == seeded.verdict and data["passed"] is seeded.passed
    names = [check.name for check in seeded.reports[0][1].checks]
    assert [check["name"] for check in data["checks"]] == names
    assert set(data["checks"][0]["verdicts"]) == {"0", "1"}
    # The file: each seed's runs keep their series on one line, as a single run's do.
    path = tmp_path / "seeds.json"
    path.write_bytes(admission_json(data))
    text = path.read_text()
    assert orjson.loads(text) == data
    series = [line for line in text.splitlines() if line.lstrip().startswith('"series": {')]
    assert len(series) == 2
    # `narwhal bench report` makes one section per seed.
    sections = load_reports(path)
    assert [name for name, _ in sections] == ["seeds.json, seed 0", "seeds.json, seed 1"]
    output = tmp_path / "seeds.html"
    assert main(["report", str(path), "-o", str(output)]) == 0
    page = output.read_text()
    assert page.count("<section ") == 2
    # Each section names its seed once (the section's name has it; the settings repeat it).
    headings = re.findall(r"<h2>([^<]*)</h2>", page)
    assert [heading.count(", seed ") for heading in headings] == [1, 1]
    assert headings[0].startswith("seeds.json, seed 0, trace ")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--seeds", "0,x"], "--seeds: expected integers"),
        (["--seeds", "1,1"], "--seeds: a seed is repeated"),
        (["--seeds", ","], "--seeds: expected at least one seed"),
        (["--seeds", "0,1", "--real-time"], "--seeds: virtual time only"),
        (["--seeds", "0,1", "--seed", "2"], "not allowed with argument"),
    ],
)
def test_wrong_seeds_are_usage_errors(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["admission", *arguments]) == 2
    assert message in capsys.readouterr().err
