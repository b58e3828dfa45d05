"""The chaos suite's figures: cases tried per class, failures, worst latency, soak memory.

Each test adds to :data:`tests.chaos.support.FIGURES`; at the end of the session they are
printed in the terminal summary and, when ``NARWHAL_CHAOS_FIGURES`` names a file, written there
as JSON (the closing note quotes them).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.chaos.support import FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("chaos figures")
    for name, value in sorted(FIGURES.items()):
        if name == "failed_tests":
            value = len(value)
        terminalreporter.write_line(f"{name}: {json.dumps(value, sort_keys=True)}")
    path = os.environ.get("NARWHAL_CHAOS_FIGURES")
    if path:
        with open(path, "w") as file:
            json.dump(FIGURES, file, indent=2, sort_keys=True)


@pytest.fixture(autouse=True)
def _count_failures(request: pytest.FixtureRequest) -> Any:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        FIGURES.setdefault("failed_tests", []).append(request.node.nodeid)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
