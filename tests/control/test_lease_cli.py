"""The operations guide's HA pair as processes: ``narwhal sim`` and two ``narwhal serve`` on a
real etcd, with the guide's configuration files (on free ports, a 1 s TTL). The active router
is killed (``SIGKILL``: no revoke) and the standby takes over within the TTL; a ``SIGTERM``
then hands back at once."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.control.conftest import EtcdServer, _free_port

pytestmark = pytest.mark.realtime

MODEL = "llama-3.1-8b-instruct"
TTL = 1


def _config(port: int, engine_port: int, etcd_url: str) -> str:
    # operations.rst, "An HA pair on one machine", with these ports and TTL.
    return f"""\
[serving]
model = "{MODEL}"
bind = "127.0.0.1:{port}"

[[engines]]
name = "engine-a"
url = "http://127.0.0.1:{engine_port}"

[control]
lease = "etcd"
etcd_endpoints = ["{etcd_url}"]
lease_ttl_s = {TTL}
cluster = "narwhal-demo"
"""


@contextmanager
def _process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "narwhal", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


async def _state(client: httpx.AsyncClient, port: int) -> str:
    try:
        response = await client.get(f"http://127.0.0.1:{port}/ready")
    except httpx.HTTPError:
        return "down"
    state: str = response.json()["state"]
    return state


async def _ready(client: httpx.AsyncClient, port: int) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get(f"http://127.0.0.1:{port}/ready")).json()
    return body


async def _until_state(client: httpx.AsyncClient, port: int, state: str, logs: Path) -> float:
    with trio.fail_after(30):
        while (now := await _state(client, port)) != state:
            assert now != "draining", (logs / f"{port}.log").read_text()
            await trio.sleep(0.01)
    return trio.current_time()


async def test_the_guides_pair_fails_over_when_the_active_router_is_killed(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    engine, port_a, port_b = _free_port(), _free_port(), _free_port()
    for name, port in (("a", port_a), ("b", port_b)):
        (tmp_path / f"router-{name}.toml").write_text(_config(port, engine, etcd.url))
    sim = ["sim", "--bind", f"127.0.0.1:{engine}", "--model", MODEL]
    with ExitStack() as stack:
        stack.enter_context(_process(sim, tmp_path / "sim.log"))
        serve_a = ["serve", "--config", str(tmp_path / "router-a.toml")]
        router_a = stack.enter_context(_process(serve_a, tmp_path / f"{port_a}.log"))
        async with httpx.AsyncClient(timeout=1.0) as client:
            await _until_state(client, port_a, "active", tmp_path)
            serve_b = ["serve", "--config", str(tmp_path / "router-b.toml")]
            router_b = stack.enter_context(_process(serve_b, tmp_path / f"{port_b}.log"))
            await _until_state(client, port_b, "standby", tmp_path)
            with trio.fail_after(30):
                while True:  # at first: "looking for the leader", engine joining
                    ready = await _ready(client, port_b)  # warm: its engine joined
                    if "the leader is" in ready["reason"] and ready["engines"][0]["eligible"]:
                        break
                    await trio.sleep(0.01)
            assert ready["reason"].endswith(f"(127.0.0.1:{port_a})")
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            refused = await client.post(f"http://127.0.0.1:{port_b}/v1/chat/completions", json=body)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "router_standby"

            killed_at = trio.current_time()
            router_a.send_signal(signal.SIGKILL)
            took_over = await _until_state(client, port_b, "active", tmp_path) - killed_at
            print(f"\nHA killed leader (narwhal serve, TTL {TTL} s): takeover={took_over:.3f} s")
            assert took_over <= TTL + 1.0  # etcd expires leases within about half a second
            served = await client.post(f"http://127.0.0.1:{port_b}/v1/chat/completions", json=body)
            assert served.status_code == 200, served.text

            # A SIGTERM hands over at once: router A, restarted, stands by and then leads.
            router_a = stack.enter_context(_process(serve_a, tmp_path / f"{port_a}-2.log"))
            await _until_state(client, port_a, "standby", tmp_path)
            stopped_at = trio.current_time()
            router_b.send_signal(signal.SIGTERM)
            handed_over = await _until_state(client, port_a, "active", tmp_path) - stopped_at
            print(f"HA SIGTERM to the leader (narwhal serve): takeover={handed_over:.3f} s")
            assert handed_over < TTL
            assert await trio.to_thread.run_sync(router_b.wait, 10) == 0
