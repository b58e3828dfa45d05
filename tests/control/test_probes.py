"""The probe listener: /health and /ready from their own thread, on real sockets (realtime)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import trio

from narwhal.config import Config, ConfigError, EngineConfig, ServingConfig
from narwhal.demo import demo_transports
from narwhal.server import serve
from narwhal.web.probes import ProbeListener, probe_listener
from tests.conftest import MODEL
from tests.support import wait_ready

pytestmark = pytest.mark.realtime

READY = {"state": "active", "reason": None, "counters": {"offered": 0}, "engines": []}


@pytest.fixture
def listener() -> Any:
    with probe_listener(
        Config(serving=ServingConfig(model=MODEL, probe_bind="127.0.0.1:0"))
    ) as probes:
        assert probes is not None
        yield probes


def get(url: str, method: str = "GET") -> tuple[int, dict[str, str], Any, float]:
    """One request on a fresh connection, from the calling thread: status, headers, JSON, s."""
    began = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        response = client.request(method, url)
    elapsed = time.monotonic() - began
    return response.status_code, dict(response.headers), response.json(), elapsed


def test_it_answers_the_published_snapshot(listener: ProbeListener) -> None:
    listener.publish_now(200, READY)
    status, headers, body, _ = get(f"{listener.url}/ready")
    assert (status, body) == (200, READY)
    assert headers["content-type"] == "application/json"
    assert get(f"{listener.url}/health")[::2] == (200, {"status": "ok"})
    listener.publish_now(503, dict(READY, state="standby", reason="router_standby"))
    assert get(f"{listener.url}/ready?verbose=1")[0] == 503


def test_before_the_first_snapshot_it_is_not_ready(listener: ProbeListener) -> None:
    status, _, body, _ = get(f"{listener.url}/ready")
    assert status == 503
    assert body["state"] == "starting" and body["reason"] == "router_starting"


def test_other_routes_and_methods_are_envelopes(listener: ProbeListener) -> None:
    status, _, body, _ = get(f"{listener.url}/v1/models")
    assert status == 404
    assert body["error"]["code"] == "not_found"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, headers, body, _ = get(f"{listener.url}/ready", method="POST")
    assert status == 405
    assert headers["allow"] == "GET, HEAD"
    assert body["error"]["code"] == "method_not_allowed"
    status, _, body, _ = get(f"{listener.url}/ready", method="BREW")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


def test_a_malformed_request_gets_the_envelope(listener: ProbeListener) -> None:
    host, port = listener.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2.0) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw
    assert orjson.loads(body)["error"]["code"] == "invalid_request"


def test_a_stale_snapshot_is_degraded_and_a_wedged_loop_is_not_alive() -> None:
    probes = ProbeListener("127.0.0.1:0", stale_after_s=0.2, wedged_after_s=0.5)
    probes.start()
    try:
        probes.publish_now(200, READY)
        assert get(f"{probes.url}/ready")[0] == 200
        deadline = time.monotonic() + 5.0
        while (answer := get(f"{probes.url}/ready"))[0] == 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)  # polling, with the deadline above
        status, _, body, _ = answer
        assert status == 503
        assert body["state"] == "monitoring_degraded"
        assert body["reason"].startswith("router_monitoring_degraded: event loop unresponsive for ")
        assert body.keys() == READY.keys()
        while (answer := get(f"{probes.url}/health"))[0] == 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)  # polling, with the deadline above
        assert answer[2]["status"] == "unresponsive"
    finally:
        probes.close()


def test_it_closes_cleanly() -> None:
    config = Config(serving=ServingConfig(model=MODEL, probe_bind="127.0.0.1:0"))
    with probe_listener(config) as probes:
        assert probes is not None
        url = probes.url
        assert get(f"{url}/health")[0] == 200
    assert not [t for t in threading.enumerate() if t.name == "narwhal-probes"]
    with pytest.raises(httpx.ConnectError):
        get(f"{url}/health")


def test_a_probe_bind_in_use_is_an_error_naming_the_key() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = Config(serving=ServingConfig(model=MODEL, probe_bind=f"127.0.0.1:{port}"))
        with pytest.raises(ConfigError) as raised, probe_listener(config):
            pass
    assert str(raised.value).startswith(f"serving.probe_bind: cannot listen on 127.0.0.1:{port}: ")


def test_no_probe_bind_no_listener() -> None:
    with probe_listener(Config(serving=ServingConfig(model=MODEL))) as probes:
        assert probes is None


# -- with the router, and its loop blocked ---------------------------------------------------------


@pytest.fixture
async def served(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[tuple[str, str]]:
    caplog.set_level(logging.INFO, logger="narwhal.web.probes")
    settings = Config(
        serving=ServingConfig(model=MODEL, probe_bind="127.0.0.1:0"),
        engines=(EngineConfig(name="sim-a", url="http://sim-a.invalid"),),
    )
    stop = trio.Event()
    urls = await nursery.start(
        lambda task_status: serve(
            settings,
            bind="127.0.0.1:0",
            transports=demo_transports(settings, time_scale=0.05),
            shutdown_trigger=stop.wait,
            task_status=task_status,
        )
    )
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Probes on ")]
    probe_url = told[0].removeprefix("Probes on ").split(" ")[0]
    for url in (urls[0], probe_url):
        await wait_ready(url)
    yield urls[0], probe_url
    stop.set()


async def test_the_probe_port_answers_as_the_main_port(served: tuple[str, str]) -> None:
    main, probes = served
    async with httpx.AsyncClient() as client:
        with trio.fail_after(10):
            ready_main = (await client.get(f"{main}/ready")).json()
            ready_probe = await client.get(f"{probes}/ready")
            health = await client.get(f"{probes}/health")
    assert ready_probe.status_code == 200
    assert ready_probe.json().keys() == ready_main.keys()
    assert ready_probe.json()["engines"][0].keys() == ready_main["engines"][0].keys()
    assert ready_probe.json()["state"] == "active"
    assert health.json() == {"status": "ok"}


async def test_probes_answer_while_the_trio_loop_is_blocked(served: tuple[str, str]) -> None:
    _, probes = served

    def blocked() -> tuple[list[float], dict[str, Any], int]:
        # This runs in the Trio thread itself: the loop does nothing until it returns.
        latencies = []
        deadline = time.monotonic() + 5.0
        while True:
            status, _, body, elapsed = get(f"{probes}/ready")
            latencies.append(elapsed)
            if status == 503:
                break
            assert time.monotonic() < deadline, "the snapshot never went stale"
            time.sleep(0.05)  # polling, with the deadline above
        health_status, _, _, elapsed = get(f"{probes}/health")
        latencies.append(elapsed)
        return latencies, body, health_status

    # Each answer came while the loop did nothing (it is blocked until blocked() returns, and
    # get() gives up after 2 s): the probe port's own thread answered. How fast it answers is
    # a benchmark's figure (`narwhal bench probes`), not this test's: with three test
    # processes on two cores, answers here took up to 0.12 s.
    latencies, body, health_status = blocked()
    print(f"probe answers while the loop was blocked: {max(latencies):.3f} s at the most")
    assert body["state"] == "monitoring_degraded"
    assert body["reason"].startswith("router_monitoring_degraded: event loop unresponsive")
    assert health_status == 200  # busy or blocked, the process is alive
    # The loop runs again: the next publication makes it ready.
    await wait_ready(probes, within_s=10)
