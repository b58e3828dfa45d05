"""``narwhal bench report``: an admission run's JSON as one self-contained HTML page.

One small real run (30 seconds of trace at 1x and 2x, predictive and open, capacity given, no
reruns, no memory) gives the JSON of the real shape; the page is checked for its parts, not
for its pixels.
"""

from __future__ import annotations

import base64
import copy
import itertools
import re
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from narwhal.bench.admission import AdmissionSettings, run_admission
from narwhal.bench.cli import admission_json, main
from narwhal.bench.goodput import Capacity
from narwhal.bench.html_report import NOT_RECORDED, ReportError, load_reports, render_html
from narwhal.bench.replay import VirtualSetup, default_router

_SECTIONS = (
    "Verdicts",
    "Settings",
    "Runs",
    "Goodput against load",
    "In-budget share against load",
    "TTFT CDFs",
    "Prediction error over time (predictive)",
    "Safety factor and engine drift over time (predictive)",
)
_PNG = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    settings = AdmissionSettings(
        setup=VirtualSetup(default_router(), duration_s=30.0),
        loads=(1.0, 2.0),
        modes=("predictive", "open"),
        capacity=Capacity(rps=38.4, engine_s_per_s=1.86, measured=False),
        false_refusal_samples=(),
        false_refusal_default=0,
        memory=False,
        jobs=1,
    )
    report = run_admission(settings, echo=lambda line: None)
    data: dict[str, Any] = orjson.loads(orjson.dumps(report.as_json()))
    return data


def pngs(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in _PNG.findall(page)]


def test_the_run_records_what_the_report_plots(run: dict[str, Any]) -> None:
    runs = {entry["mode"]: entry for entry in run["runs"] if entry["load"] == 2.0}
    predictive, open_mode = runs["predictive"]["series"], runs["open"]["series"]
    for entry in runs.values():
        # The admitted requests' TTFTs, sorted: every in-budget one has one, and no more
        # than the admitted do.
        ttfts = entry["series"]["ttft_s"]
        assert ttfts == sorted(ttfts)
        assert 0 < entry["in_budget"] <= len(ttfts) <= entry["admitted"]
    # Open mode projects nothing: no prediction series; predictive scores every admitted
    # request that got its first token.
    assert "prediction" not in open_mode
    prediction = predictive["prediction"]
    count = len(prediction["arrival_s"])
    assert count == len(prediction["arrival_error"]) == len(prediction["placement_error"])
    assert count == runs["predictive"]["projection_error"]["count"]
    assert prediction["arrival_s"] == sorted(prediction["arrival_s"])
    # The sampler: one sample per virtual second from the start, and one at the end.
    router = predictive["router"]
    times = router["t_s"]
    assert times[:2] == [0.0, 1.0]
    assert all(0 <= later - earlier <= 1.0 for earlier, later in itertools.pairwise(times))
    assert times[-1] == pytest.approx(runs["predictive"]["virtual_s"], abs=0.01)
    assert len(router["safety_factor"]) == len(times)
    assert set(router["engines"]) == {"engine-a", "engine-b"}
    for engine in router["engines"].values():
        assert len(engine["ttft"]) == len(engine["tpot"]) == len(times)
        assert engine["states"][0][0] == 0.0  # the state at the start, then its changes


def test_the_json_file_holds_each_runs_series_on_one_line(run: dict[str, Any]) -> None:
    text = admission_json(run).decode()
    assert orjson.loads(text) == run
    lines = text.splitlines()
    assert lines[:2] == ["{", '  "capacity": {']  # indented, keys sorted
    series = [line for line in lines if line.lstrip().startswith('"series": {')]
    assert len(series) == len(run["runs"])
    assert all(line.rstrip(",").endswith("}") for line in series)


def test_the_page_is_one_file_with_every_section_and_its_plots(run: dict[str, Any]) -> None:
    page = render_html([("run.json", run)])
    assert page.startswith("<!DOCTYPE html>")
    for heading in _SECTIONS:
        assert f"<h3>{heading}</h3>" in page
    images = pngs(page)
    assert len(images) == 5  # goodput, in-budget, CDFs, prediction error, factor and drift
    assert all(image.startswith(b"\x89PNG\r\n\x1a\n") for image in images)
    assert NOT_RECORDED not in page
    assert "The dotted line is predictive's bound with the budget as a deadline" in page
    # No external resource: nothing is fetched from elsewhere.
    assert not re.search(r'(src|href)="(?!data:|#)', page)
    assert "<script" not in page
    # Every check with its verdict; this small run has targets it cannot check.
    for check in run["checks"]:
        assert f"<td>{check['name']}</td>" in page
    assert '<td class="NOT-RUN">NOT RUN</td>' in page
    assert f"<b>{run['verdict']}</b>" in page


def test_a_run_recorded_without_the_series_still_renders_and_says_so(
    run: dict[str, Any],
) -> None:
    older = copy.deepcopy(run)
    for entry in older["runs"]:
        del entry["series"]
    page = render_html([("old.json", older)])
    assert page.count(NOT_RECORDED) == 3  # CDFs, prediction error, factor and drift
    assert "per-request TTFTs: " + NOT_RECORDED in page
    assert len(pngs(page)) == 2  # goodput and in-budget share need no series
    # A run from before the deadline bound: the plot has only the headline's.
    for entry in older["runs"]:
        del entry["deadline_bound_engine_s_per_s"]
    page = render_html([("old.json", older)])
    assert "bound with the budget as a deadline" not in page


def test_several_runs_one_section_each(run: dict[str, Any]) -> None:
    other = copy.deepcopy(run)
    other["settings"]["seed"] = 1
    page = render_html([("seed0.json", run), ("seed1.json", other)])
    assert page.count("<section ") == 2
    assert '<a href="#run-0">seed0.json, trace conv, seed 0' in page
    assert '<a href="#run-1">seed1.json, trace conv, seed 1' in page


def test_values_of_the_wrong_kind_are_left_out_not_fatal() -> None:
    mangled: dict[str, Any] = {
        "settings": {"modes": "predictive", "bar": [], "budget_s": "2"},
        "capacity": None,
        "checks": [{"name": "<b>x</b>", "passed": None}, "junk"],
        "runs": [
            {"load": 1.0, "mode": "predictive", "goodput_engine_s_per_s": float("nan")},
            {"load": "2", "mode": "open"},
            {
                "load": 2.0,
                "mode": "predictive",
                "goodput_engine_s_per_s": 1.0,
                "series": {
                    "ttft_s": [0.1, "x", None],
                    "prediction": {"arrival_s": [1, None], "arrival_error": ["bad"]},
                    "router": {"t_s": [0, 1], "engines": {"a": {"states": [[0], "x"]}}},
                },
            },
            "junk",
        ],
    }
    page = render_html([("mangled.json", mangled)])
    assert "&lt;b&gt;x&lt;/b&gt;" in page  # escaped
    assert '<td class="NOT-RUN">NOT RUN</td>' in page
    assert pngs(page)


def test_the_cli_writes_the_page(run: dict[str, Any], tmp_path: Path) -> None:
    first, second = tmp_path / "seed0.json", tmp_path / "seed1.json"
    first.write_bytes(orjson.dumps(run, option=orjson.OPT_INDENT_2))
    second.write_bytes(orjson.dumps(run))
    output = tmp_path / "report.html"
    assert main(["report", str(first), str(second), "-o", str(output)]) == 0
    page = output.read_text()
    assert page.count("<section ") == 2
    assert len(pngs(page)) == 10
    # Without -o: beside the first input.
    assert main(["report", str(first)]) == 0
    assert (tmp_path / "seed0.html").exists()


def test_the_cli_refuses_what_is_not_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": 3}')
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    output = tmp_path / "out.html"
    for path in (bad, broken, tmp_path / "absent.json"):
        assert main(["report", str(path), "-o", str(output)]) == 2
        assert str(path) in capsys.readouterr().err
    assert not output.exists()
    with pytest.raises(ReportError, match="not an admission benchmark run"):
        load_reports(bad)
    # The output may not overwrite an input.
    run_file = tmp_path / "run.json"
    run_file.write_text('{"runs": []}')
    assert main(["report", str(run_file), "-o", str(run_file)]) == 2
    assert run_file.read_text() == '{"runs": []}'


def test_without_matplotlib_the_cli_says_what_to_install(
    run: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "run.json"
    source.write_bytes(orjson.dumps(run))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert main(["report", str(source)]) == 2
    assert "pip install 'narwhal[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "run.html").exists()
