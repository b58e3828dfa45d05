"""Fixtures of the real-engine tier: one vLLM and one Narwhal before it, per test session.

Where vLLM is not installed (``./scripts/install-vllm``) the tier is skipped with that reason,
except under ``CI=true``, where it must run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.real.servers import make_model, running_narwhal, running_vllm, vllm_python


@pytest.fixture(scope="session")
def vllm_venv_python() -> Path:
    python = vllm_python()
    if python is None:
        reason = "real vLLM not installed: run ./scripts/install-vllm (or set NARWHAL_VLLM_VENV)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; under CI the real-engine tier must run")
        pytest.skip(reason)
    return python


@pytest.fixture(scope="session")
def real_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real")


@pytest.fixture(scope="session")
def tiny_model(vllm_venv_python: Path, real_folder: Path) -> Path:
    return make_model(vllm_venv_python, real_folder / "tiny-model")


@pytest.fixture(scope="session")
def vllm_url(request: pytest.FixtureRequest, real_folder: Path) -> Iterator[str]:
    """A real vLLM serving the tiny model, for the whole session.

    ``NARWHAL_VLLM_URL`` names one already running (started as :func:`vllm_command` does),
    which saves its start while working on the tier.
    """
    given = os.environ.get("NARWHAL_VLLM_URL")
    if given:
        yield given.rstrip("/")
        return
    python = request.getfixturevalue("vllm_venv_python")
    model = request.getfixturevalue("tiny_model")
    with running_vllm(python, model, real_folder / "vllm.log") as url:
        yield url


@pytest.fixture(scope="session")
def narwhal_url(vllm_url: str, real_folder: Path) -> Iterator[str]:
    """``narwhal serve`` (predictive admission) before that vLLM."""
    with running_narwhal(real_folder, vllm_url) as url:
        yield url


@pytest.fixture(scope="session")
def narwhal_workers_url(vllm_url: str, real_folder: Path) -> Iterator[str]:
    """``narwhal serve`` with two relay workers under one controller, before the same vLLM."""
    with running_narwhal(
        real_folder, vllm_url, serving_extra="workers = 2", name="narwhal-workers"
    ) as url:
        yield url


@pytest.fixture
def direct(vllm_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_url, timeout=60) as client:
        yield client


@pytest.fixture
def routed(narwhal_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=narwhal_url, timeout=60) as client:
        yield client


@pytest.fixture
def routed_workers(narwhal_workers_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=narwhal_workers_url, timeout=60) as client:
        yield client
