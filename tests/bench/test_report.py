"""The overhead report's arithmetic, its rendering, and the benchmark's pure helpers."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import attrs
import orjson
import pytest

from narwhal.bench import procstat
from narwhal.bench.cli import main, parse_levels
from narwhal.bench.load import RequestRecord
from narwhal.bench.overhead import DEFAULT_LEVELS, Level, narwhal_config_text, split_rounds
from narwhal.bench.report import (
    RATIO_FLOOR_S,
    Added,
    Check,
    LevelReport,
    OverheadReport,
    TargetResult,
    evaluate_checks,
    ratio,
)
from narwhal.config import config_from_mapping


def records(
    ttfts_ms: list[float], *, e2e_extra_ms: float = 10.0, errors: int = 0
) -> list[RequestRecord]:
    good = [
        RequestRecord(i, 0.0, ms / 1000, (ms + e2e_extra_ms) / 1000, 64, None)
        for i, ms in enumerate(ttfts_ms)
    ]
    bad = [RequestRecord(len(good) + i, 0.0, None, None, 0, "http_503:x") for i in range(errors)]
    return good + bad


def result(
    target: str,
    ttfts_ms: list[float],
    *,
    concurrency: int = 1,
    cpu_s: float | None = None,
    errors: int = 0,
) -> TargetResult:
    return TargetResult.from_records(
        target,
        concurrency,
        records(ttfts_ms, errors=errors),
        wall_s=2.0,
        cpu_s=cpu_s,
        rss_bytes=50 * 1024 * 1024 if cpu_s is not None else None,
    )


def level(concurrency: int = 1, *, narwhal_errors: int = 0) -> LevelReport:
    return LevelReport(
        concurrency=concurrency,
        rounds=2,
        results=(
            result("direct", [1.0, 2.0, 3.0], concurrency=concurrency),
            result(
                "narwhal",
                [2.5, 3.5, 4.5],
                concurrency=concurrency,
                cpu_s=0.9,
                errors=narwhal_errors,
            ),
            result("vllm-router", [1.5, 2.5, 3.5], concurrency=concurrency, cpu_s=0.3),
        ),
    )


def test_target_result_summarises_good_requests_and_counts_errors() -> None:
    summary = result("narwhal", [1.0, 2.0, 3.0], cpu_s=0.6, errors=2)
    assert (summary.requests, summary.errors) == (5, 2)
    assert summary.error_kinds == {"http_503:x": 2}
    assert summary.ttft.count == 3 and summary.ttft.p50_s == pytest.approx(0.002)
    assert summary.e2e.p50_s == pytest.approx(0.012)
    assert (summary.output_events_min, summary.output_events_max) == (64, 64)
    assert summary.cpu_s_per_1k == pytest.approx(120.0)  # 0.6 s over 5 requests
    assert summary.throughput_rps == pytest.approx(2.5)
    assert result("direct", [1.0]).cpu_s_per_1k is None


def test_added_latency_is_the_difference_of_percentiles() -> None:
    report = level()
    added = report.added("narwhal")
    assert added is not None
    assert added.ttft_p50_s == pytest.approx(0.0015)
    assert added.ttft_p99_s == pytest.approx(0.0015)
    assert added.e2e_p50_s == pytest.approx(0.0015)
    assert report.added("direct") is None
    assert report.added("absent") is None


def test_ratios_of_narwhal_over_vllm_router() -> None:
    ratios = level().ratios
    assert ratios is not None
    assert ratios.added_ttft_p50 == pytest.approx(3.0)  # 1.5 ms over 0.5 ms
    assert ratios.cpu_per_request == pytest.approx(3.0)  # 0.9 s over 0.3 s, same requests
    only_narwhal = LevelReport(1, 1, level().results[:2])
    assert only_narwhal.ratios is None


def test_ratio_is_undefined_for_a_non_positive_denominator() -> None:
    assert ratio(2.0, 1.0) == 2.0
    assert ratio(1.0, 0.0) is None
    assert ratio(1.0, -0.5) is None
    assert ratio(None, 1.0) is None
    assert ratio(1.0, 0.00005, floor=RATIO_FLOOR_S) is None  # below the noise floor
    assert ratio(1.0, 0.0002, floor=RATIO_FLOOR_S) == pytest.approx(5000.0)
    assert Added(None, None, None, None).as_json()["ttft_p50_s"] is None


def statuses(checks: tuple[Check, ...]) -> dict[str, str]:
    return {check.name: check.status for check in checks}


ALL_LEVELS = (1, 16, 64, 256)


def test_checks_are_spec_bar_for_the_relay() -> None:
    # Narwhal adds 1.5 ms at every percentile, vllm-router 0.5 ms; CPU 0.9 s against 0.3 s.
    checks = evaluate_checks([level(c) for c in ALL_LEVELS], ttft_bound_s=0.002, cpu_ratio=3.5)
    assert statuses(checks) == {
        "narwhal added p50 TTFT <= 2 ms at c=1": "PASS",
        "narwhal added p50 TTFT <= vllm-router's + 2 ms at c=16": "PASS",
        "narwhal added p99 TTFT <= vllm-router's + 10 ms at c=16": "PASS",
        "narwhal added p50 TTFT <= vllm-router's + 2 ms at c=64": "PASS",
        "narwhal added p99 TTFT <= vllm-router's + 10 ms at c=64": "PASS",
        "narwhal CPU per request <= 3.5x vllm-router's at c=1": "PASS",
        "narwhal CPU per request <= 3.5x vllm-router's at c=16": "PASS",
        "narwhal CPU per request <= 3.5x vllm-router's at c=64": "PASS",
        "narwhal CPU per request <= 3.5x vllm-router's at c=256": "PASS",
        "narwhal zero errors at c=64": "PASS",
        "narwhal zero errors at c=256": "PASS",
    }
    assert checks[0].detail == "measured 1.50 ms"
    assert checks[1].detail == "narwhal +1.50 ms, vllm-router +0.50 ms"
    assert checks[5].detail == "300.00 / 100.00 s per 1k requests (3.00x)"


def test_checks_fail_where_the_figures_miss() -> None:
    levels = [level(1), level(16), level(64), level(256, narwhal_errors=3)]
    checks = evaluate_checks(levels, p50_margin_s=0.0005)
    failed = [name for name, status in statuses(checks).items() if status == "FAIL"]
    assert failed == [
        "narwhal added p50 TTFT <= 1 ms at c=1",
        "narwhal added p50 TTFT <= vllm-router's + 0.5 ms at c=16",
        "narwhal added p50 TTFT <= vllm-router's + 0.5 ms at c=64",
        "narwhal CPU per request <= 2x vllm-router's at c=1",
        "narwhal CPU per request <= 2x vllm-router's at c=16",
        "narwhal CPU per request <= 2x vllm-router's at c=64",
        "narwhal zero errors at c=256",  # (its CPU, over 6 requests, is 1.5x)
    ]
    assert "3 errors in 6 requests (http_503:x x3)" in checks[-1].detail


def test_checks_not_run_where_a_level_or_vllm_router_did_not_run() -> None:
    checks = statuses(evaluate_checks([level(16)]))
    assert checks["narwhal added p50 TTFT <= 1 ms at c=1"] == "NOT RUN"
    assert checks["narwhal added p99 TTFT <= vllm-router's + 10 ms at c=64"] == "NOT RUN"
    assert checks["narwhal CPU per request <= 2x vllm-router's at c=1"] == "NOT RUN"
    assert checks["narwhal zero errors at c=256"] == "NOT RUN"
    assert checks["narwhal added p99 TTFT <= vllm-router's + 10 ms at c=16"] == "PASS"
    without_vllm_router = [
        LevelReport(c, 2, tuple(r for r in level(c).results if r.target != "vllm-router"))
        for c in ALL_LEVELS
    ]
    checks = statuses(evaluate_checks(without_vllm_router, ttft_bound_s=0.002))
    assert [name for name, status in checks.items() if status != "NOT RUN"] == [
        "narwhal added p50 TTFT <= 2 ms at c=1",
        "narwhal zero errors at c=64",
        "narwhal zero errors at c=256",
    ]


def test_a_check_not_run_is_not_a_pass() -> None:
    levels = (level(1),)  # c=16 to c=256 did not run
    report = OverheadReport(
        settings={"output_tokens": 64},
        environment={"cpu_cores": 2},
        levels=levels,
        checks=evaluate_checks(levels, ttft_bound_s=0.002, cpu_ratio=3.5),
    )
    assert report.verdict == "INCOMPLETE" and not report.passed
    assert report.render().endswith("verdict: INCOMPLETE")
    assert "NOT RUN  narwhal zero errors at c=64" in report.render()
    assert report.as_json()["verdict"] == "INCOMPLETE"
    ran = tuple(level(c) for c in ALL_LEVELS)
    complete = attrs.evolve(
        report, levels=ran, checks=evaluate_checks(ran, ttft_bound_s=0.002, cpu_ratio=3.5)
    )
    assert complete.verdict == "PASS" and complete.passed


def test_report_renders_a_table_and_json() -> None:
    levels = (level(1), level(64, narwhal_errors=1))
    report = OverheadReport(
        settings={"output_tokens": 64},
        environment={"cpu_cores": 2},
        levels=levels,
        checks=evaluate_checks(levels),
    )
    assert not report.passed
    assert report.total_errors == {"direct": 0, "narwhal": 1, "vllm-router": 0}
    text = report.render()
    assert "share the same 2 CPU cores" in text
    assert "c=64: 4 requests per target in 2 alternating rounds" in text
    assert "narwhal / vllm-router: added TTFT p50 3.00x" in text
    assert "FAIL  narwhal added p50 TTFT <= 1 ms at c=1: measured 1.50 ms" in text
    assert "FAIL  narwhal zero errors at c=64" in text
    assert "  narwhal errors: http_503:x x1" in text
    data = orjson.loads(orjson.dumps(report.as_json()))
    assert data["passed"] is False and data["verdict"] == "FAIL"
    first = data["levels"][0]
    assert first["targets"]["narwhal"]["cpu_s_per_1k_requests"] == pytest.approx(300.0)
    assert first["added_over_direct"]["narwhal"]["ttft_p50_s"] == pytest.approx(0.0015)
    assert first["ratios_narwhal_over_vllm_router"]["added_ttft_p50"] == pytest.approx(3.0)


# -- settings and helpers ------------------------------------------------------------------------


def test_split_rounds() -> None:
    assert split_rounds(10, 4) == [3, 3, 2, 2]
    assert split_rounds(3, 4) == [1, 1, 1]
    assert split_rounds(0, 4) == [0]
    assert sum(split_rounds(1601, 4)) == 1601


def test_parse_levels() -> None:
    assert parse_levels(None, None, DEFAULT_LEVELS) == DEFAULT_LEVELS
    assert parse_levels("1,64", None, DEFAULT_LEVELS) == (Level(1, 400), Level(64, 1600))
    assert parse_levels("2", None, DEFAULT_LEVELS) == (Level(2, 400),)  # nearest default
    assert parse_levels("1,16", "50", DEFAULT_LEVELS) == (Level(1, 50), Level(16, 50))
    assert parse_levels(None, "5,6,7,8", DEFAULT_LEVELS)[2:] == (Level(64, 7), Level(256, 8))
    for concurrency, requests in (("1,x", None), ("0", None), ("1,2", "1,2,3")):
        with pytest.raises(ValueError):
            parse_levels(concurrency, requests, DEFAULT_LEVELS)


def test_narwhal_config_has_one_engine_and_loads_back(tmp_path: Path) -> None:
    text = narwhal_config_text("m", "http://127.0.0.1:9")
    config = config_from_mapping(tomllib.loads(text))
    assert config.serving.model == "m"
    assert [(engine.name, engine.url, engine.dialect) for engine in config.engines] == [
        ("sim", "http://127.0.0.1:9", "vllm")
    ]
    # Admission's work is measured, and nothing is refused: the relay is what is compared.
    assert config.admission.mode == "shadow"
    base = tmp_path / "base.toml"
    base.write_text('[admission]\nmode = "open"\n[[engines]]\nname = "x"\nurl = "http://h:1"\n')
    config = config_from_mapping(tomllib.loads(narwhal_config_text("m", "http://e:2", base)))
    assert config.admission.mode == "open"
    assert [engine.name for engine in config.engines] == ["sim"]
    # The benchmark supplies the engine: a base without one is what a user writes.
    base.write_text('[admission]\nmode = "open"\n')
    config = config_from_mapping(tomllib.loads(narwhal_config_text("m", "http://e:2", base)))
    assert (config.admission.mode, [engine.name for engine in config.engines]) == ("open", ["sim"])


def test_overhead_refuses_a_bad_narwhal_config_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base.toml"
    base.write_text('[admission]\nmode = "sometimes"\n')
    assert main(["overhead", "--no-vllm-router", "--narwhal-config", str(base)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("narwhal bench overhead: ") and "admission.mode" in err
    assert "Traceback" not in err


def test_procstat_parsers() -> None:
    stat = "4242 (python (x) y) S 17 4242 4242 0 -1 4194560 1 0 0 0 250 75 0 0 20 0 3 0"
    parsed = procstat.parse_stat(stat)
    assert (parsed.ppid, parsed.utime_ticks, parsed.stime_ticks) == (17, 250, 75)
    with pytest.raises(ValueError):
        procstat.parse_stat("no parenthesis")
    status = "Name:\tpython\nVmHWM:\t  90000 kB\nVmRSS:\t  51200 kB\n"
    assert procstat.parse_status_kib(status, "VmRSS") == 51200
    assert procstat.parse_status_kib(status, "VmSwap") is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_procstat_reads_this_process() -> None:
    assert os.getpid() in procstat.descendants(os.getpid())
    assert procstat.cpu_seconds(os.getpid()) > 0
    memory = procstat.memory(os.getpid())
    assert 0 < memory.rss_bytes <= memory.peak_rss_bytes


def test_cli_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "overhead" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["nonsense"]) == 2
    assert main(["overhead", "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err
