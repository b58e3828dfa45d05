"""``narwhal bench overhead --workers``: the relay-workers figures (pure), and a short run with
one and two workers (real processes)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import orjson
import pytest

from narwhal.bench.cli import main
from narwhal.bench.load import RequestRecord
from narwhal.bench.overhead import (
    WORKERS_METHOD,
    WorkerFigures,
    WorkersOverheadReport,
    narwhal_target,
    process_tree_cpu,
)
from narwhal.bench.report import DIRECT, LevelReport, TargetResult


def records(count: int, ttft_s: float, *, errors: int = 0) -> list[RequestRecord]:
    good = [RequestRecord(i, 0.0, ttft_s, ttft_s + 0.1, 63, None) for i in range(count - errors)]
    bad = [RequestRecord(count + i, 0.0, None, None, 0, "no_done") for i in range(errors)]
    return good + bad


def level_of(**targets: tuple[list[RequestRecord], float]) -> LevelReport:
    return LevelReport(
        concurrency=16,
        rounds=1,
        results=tuple(
            TargetResult.from_records(name, 16, recs, wall_s=wall_s)
            for name, (recs, wall_s) in targets.items()
        ),
    )


def test_the_target_names() -> None:
    assert narwhal_target(1) == "narwhal"
    assert narwhal_target(4) == "narwhal-w4"


def test_two_workers_figures_split_the_cpu_and_say_how_many_workers_one_controller_serves() -> None:
    mine = records(100, 0.030, errors=2)
    level = level_of(**{DIRECT: (records(100, 0.010), 1.0), "narwhal-w2": (mine, 2.0)})
    figures = WorkerFigures.of(
        level, "narwhal-w2", 2, records=mine, controller_cpu_s=0.1, workers_cpu_s=0.4
    )
    assert figures.requests == 100 and figures.errors == 2
    assert figures.added_ttft_p50_s == pytest.approx(0.020)
    assert figures.throughput_rps == pytest.approx(50.0)
    assert figures.chunks_per_s == pytest.approx(98 * 63 / 2.0)
    assert figures.controller_cpu_s_per_request == pytest.approx(0.001)
    assert figures.workers_cpu_s_per_request == pytest.approx(0.004)
    # A controller core admits 1000 req/s, a worker core relays 250: four workers per controller.
    assert figures.workers_per_controller == pytest.approx(4.0)
    assert figures.as_json()["workers_per_controller"] == pytest.approx(4.0)


def test_one_worker_is_all_controller_and_has_no_ratio() -> None:
    mine = records(10, 0.02)
    level = level_of(**{DIRECT: (records(10, 0.01), 1.0), "narwhal": (mine, 1.0)})
    figures = WorkerFigures.of(
        level, "narwhal", 1, records=mine, controller_cpu_s=0.05, workers_cpu_s=0.0
    )
    assert figures.workers_cpu_s_per_request == 0.0
    assert figures.workers_per_controller is None


def test_the_report_renders_and_serialises_the_workers_table() -> None:
    mine = records(10, 0.02)
    level = level_of(**{DIRECT: (records(10, 0.01), 1.0), "narwhal-w2": (mine, 1.0)})
    figures = WorkerFigures.of(
        level, "narwhal-w2", 2, records=mine, controller_cpu_s=0.01, workers_cpu_s=0.03
    )
    report = WorkersOverheadReport(
        settings={"output_tokens": 64},
        environment={"cpu_cores": 2},
        levels=(level,),
        checks=(),
        workers=(figures,),
    )
    text = report.render()
    assert text.index("c=16: 10 requests") < text.index("Relay workers:") < text.index("verdict:")
    assert text.endswith("verdict: INCOMPLETE")
    table = text[text.index("Relay workers:") :].splitlines()
    (row,) = [line for line in table if line.startswith("narwhal-w2")]
    assert row.split() == [
        *("narwhal-w2", "16", "10", "0"),  # target, c, ok, errors
        *("+10.00", "+10.00"),  # added TTFT p50, p99 (ms)
        *("10", "630"),  # requests/s, chunks/s
        *("1.00", "3.00", "3.0"),  # controller and workers CPU (ms/request), workers/controller
    ]
    data = report.as_json()
    assert data["workers"][0]["workers"] == 2
    assert data["workers_method"] == WORKERS_METHOD
    assert data["benchmark"] == "overhead"


def test_the_cpu_of_a_process_tree_is_split_into_itself_and_its_descendants() -> None:
    own, children = process_tree_cpu(os.getpid())
    assert own > 0 and children >= 0


def test_workers_values_must_be_positive_integers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["overhead", "--workers", "1,zero"]) == 2
    assert "--workers: expected integers" in capsys.readouterr().err


@pytest.mark.realtime
@pytest.mark.skipif(
    importlib.util.find_spec("narwhal.sim.server") is None,
    reason="narwhal.sim.server (the simulated engine) is not available",
)
def test_a_short_run_with_one_and_two_workers(tmp_path: Path) -> None:
    output = tmp_path / "report.json"
    status = main(
        [
            "overhead",
            "--no-vllm-router",
            "--workers", "1,2",
            "--concurrency", "8",
            "--requests", "32",
            "--rounds", "1",
            "--warmup", "8",
            "--request-timeout", "10",
            "--startup-timeout", "30",
            "--log-dir", str(tmp_path / "logs"),
            "--output", str(output),
        ]
    )  # fmt: skip
    report = orjson.loads(output.read_bytes())
    assert status in (0, 1), status  # 1: a check not run (c=1) or a bar missed
    assert report["errors_per_target"] == {"direct": 0, "narwhal": 0, "narwhal-w2": 0}
    one, two = report["workers"]
    assert (one["target"], one["workers"], two["target"], two["workers"]) == (
        "narwhal",
        1,
        "narwhal-w2",
        2,
    )
    assert one["workers_cpu_s_per_request"] == 0.0  # one process
    assert two["controller_cpu_s_per_request"] > 0 and two["workers_cpu_s_per_request"] > 0
    assert two["workers_per_controller"] > 0
    assert two["chunks_per_s"] > 0 and two["throughput_rps"] > 0
