"""Fixtures of the control-plane tests: a real etcd on free loopback ports in a temporary folder,
and a TCP proxy that can cut one router off from it.

Tests that need etcd skip, saying why, where the ``etcd`` binary is missing (Debian's
``etcd-server``), and fail instead under ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import attrs
import httpx
import pytest
import trio

# etcd's minimum lease TTL is 1.5 election timeouts (rounded up to a second): with these, a
# lease of 1 s is granted as asked.
HEARTBEAT_MS = 10
ELECTION_MS = 50


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@attrs.define(eq=False)
class EtcdServer:
    """One etcd member on loopback; :meth:`stop` and :meth:`start` keep its data."""

    binary: str
    data_dir: Path
    log_path: Path
    client_port: int = attrs.field(factory=_free_port)
    peer_port: int = attrs.field(factory=_free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        assert self.process is None
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--name=narwhal-test",
                    f"--data-dir={self.data_dir}",
                    f"--listen-client-urls={self.url}",
                    f"--advertise-client-urls={self.url}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=narwhal-test={peer}",
                    f"--heartbeat-interval={HEARTBEAT_MS}",
                    f"--election-timeout={ELECTION_MS}",
                    "--log-level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    async def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Poll ``/health`` until etcd has a leader (real clock, with a deadline)."""
        with trio.fail_after(timeout_s):
            async with httpx.AsyncClient(timeout=1.0) as client:
                while True:
                    assert self.process is not None and self.process.poll() is None, self.logs()
                    try:
                        response = await client.get(f"{self.url}/health")
                        if response.status_code == 200 and response.json().get("health") in (
                            "true",
                            True,
                        ):
                            return
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.02)

    async def stop(self) -> None:
        """Terminate the member and wait for it to exit."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            await trio.to_thread.run_sync(process.wait, 10)
        except subprocess.TimeoutExpired:
            process.kill()
            await trio.to_thread.run_sync(process.wait)

    def close(self) -> None:
        """Stop it from outside Trio (fixture teardown)."""
        process, self.process = self.process, None
        if process is not None:
            process.kill()
            process.wait(10)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def etcd_binary() -> str:
    """The ``etcd`` binary, or skip (fail under ``CI=true``)."""
    binary = shutil.which("etcd")
    if binary is None:
        reason = "etcd is not installed (Debian: apt-get install -y etcd-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must run the etcd tests")
        pytest.skip(reason)
    return binary


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd member, not started yet (use :func:`etcd` for a running one)."""
    server = EtcdServer(etcd_binary(), tmp_path / "etcd", tmp_path / "etcd.log")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> EtcdServer:
    """A running etcd member on free loopback ports, in a temporary folder."""
    etcd_server.start()
    await etcd_server.wait_ready()
    return etcd_server


@attrs.define(eq=False)
class Proxy:
    """A TCP proxy to one port; while :attr:`cut`, it drops every byte either way and answers
    nothing (connections stay open), as a network partition would."""

    target_port: int
    port: int = 0
    cut: bool = False
    connections: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        async with client:
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            except OSError:
                return
            async with upstream, trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)

    async def _pump(
        self, source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope
    ) -> None:
        try:
            while data := await source.receive_some(65536):
                if not self.cut:
                    await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()


@pytest.fixture
async def proxy_to(nursery: trio.Nursery) -> AsyncIterator[object]:
    """``await proxy_to(port)``: a running :class:`Proxy` to ``port``."""

    async def start(port: int) -> Proxy:
        proxy = Proxy(port)
        await nursery.start(proxy.run)
        return proxy

    yield start
