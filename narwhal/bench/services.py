"""The processes a benchmark runs: a simulated engine, Narwhal, vllm-router.

Each runs as a subprocess on a free loopback port, with its output in a log file. Starting
returns once the process answers its readiness checks, polled with a deadline; a process that
exits or misses the deadline raises :class:`ServiceError` with the end of its log. Stopping
sends SIGTERM, waits a little, then SIGKILLs: callers register :meth:`Service.stop` with an
:class:`contextlib.ExitStack` so processes end on every exit path, Ctrl-C included.

This is synchronous on purpose: processes start before the event loop that measures them runs
and stop after it has ended, so no cleanup depends on a cancelled Trio task.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import attrs
import httpx

from narwhal.bench import procstat

__all__ = [
    "ReadyCheck",
    "Service",
    "ServiceError",
    "find_vllm_router",
    "free_port",
    "lists_model",
    "start_service",
    "status_ok",
]

ReadyCheck = tuple[str, Callable[[httpx.Response], bool]]
"""A path to GET and a test of its response; a service is ready when every check passes."""


class ServiceError(RuntimeError):
    """A benchmark process failed to start or to become ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the time of the call (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def status_ok(response: httpx.Response) -> bool:
    """The response is a 200."""
    return response.status_code == 200


def lists_model(model: str) -> Callable[[httpx.Response], bool]:
    """A check that ``/v1/models`` answers 200 and lists ``model``."""

    def check(response: httpx.Response) -> bool:
        if response.status_code != 200:
            return False
        try:
            data = response.json().get("data", [])
        except ValueError:
            return False
        return any(isinstance(entry, dict) and entry.get("id") == model for entry in data)

    return check


def find_vllm_router() -> str | None:
    """The ``vllm-router`` launcher: beside this interpreter (a virtualenv), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    return shutil.which("vllm-router")


@attrs.define(eq=False)
class Service:
    """One running benchmark process.

    Attributes:
        name: what reports call it.
        url: its base URL (``http://127.0.0.1:PORT``).
        process: the subprocess.
        log_path: where its stdout and stderr go.
    """

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        """The process ID."""
        return self.process.pid

    def cpu_seconds(self) -> float:
        """CPU seconds the process tree has used so far."""
        return procstat.cpu_seconds(self.pid)

    def memory(self) -> procstat.Memory:
        """Resident memory of the process tree now."""
        return procstat.memory(self.pid)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the process's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, checks: Sequence[ReadyCheck], *, deadline_s: float) -> None:
        """Poll ``checks`` until all pass.

        Raises:
            ServiceError: the process exited, or ``deadline_s`` passed first.
        """
        deadline = time.monotonic() + deadline_s
        last = "no answer yet"
        with httpx.Client(base_url=self.url, timeout=2.0, trust_env=False) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServiceError(
                        f"{self.name} exited with status {code} before it was ready; "
                        f"the end of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    failed = [path for path, check in checks if not check(client.get(path))]
                except httpx.HTTPError as exc:
                    failed, last = [checks[0][0]], f"{type(exc).__name__}: {exc}"
                if not failed:
                    return
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"{self.name} not ready after {deadline_s:g} s "
                        f"(waiting for {', '.join(failed)}; {last}); "
                        f"the end of {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.05)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; idempotent."""
        try:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(grace_s)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


def start_service(name: str, argv: Sequence[str], *, url: str, log_dir: Path) -> Service:
    """Start ``argv`` with its output in ``log_dir/NAME.log`` (not yet waited for)."""
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "wb")  # closed by Service.stop
    try:
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
    except OSError as exc:
        log.close()
        raise ServiceError(f"cannot start {name} ({argv[0]}): {exc}") from exc
    return Service(name=name, url=url, process=process, log_path=log_path, log=log)
