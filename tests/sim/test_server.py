"""The simulator over real HTTP (Hypercorn on port 0): real clock, real sockets, bounded."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from narwhal.sim import SimEngine, StepTiming, profile, serve_sim
from narwhal.sim.calibration import EngineType
from narwhal.sim.ledger import SimLedger
from narwhal.sim.server import main
from tests.sim.helpers import MESSAGES, MODEL, events

pytestmark = pytest.mark.realtime

DEADLINE_S = 20


@pytest.fixture
async def url(nursery: trio.Nursery) -> AsyncIterator[str]:
    engine = SimEngine(MODEL, timing=profile("h100-llama3-8b", time_scale=0.1))
    with trio.fail_after(DEADLINE_S):
        bound: str = await nursery.start(serve_sim, engine, "127.0.0.1:0")
    yield bound
    nursery.cancel_scope.cancel()


async def test_a_stream_over_real_http(url: str) -> None:
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    request = {"model": MODEL, "messages": MESSAGES, "stream": True, "return_token_ids": True}
    request["narwhal_sim"] = {"output_tokens": 5}
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL
            pieces = []
            async with client.stream("POST", "/v1/chat/completions", json=request) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                async for piece in response.aiter_raw():
                    pieces.append(piece)
            metrics = (await client.get("/metrics")).text
    decoded = events(b"".join(pieces))
    assert decoded[-1] == "[DONE]"
    assert sum(len(e["choices"][0]["token_ids"] or []) for e in decoded[1:-1]) == 5
    assert len(pieces) > 1, "frames are sent as they are made, not all at once"
    assert "vllm:num_requests_running" in metrics
    assert "vllm:kv_cache_usage_perc" in metrics


async def test_errors_and_unknown_routes_answer_json(url: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(base_url=url) as client:
            missing = await client.get("/nowhere")
            wrong = await client.get("/v1/chat/completions")
            bad = await client.post("/v1/chat/completions", content=b"{nope")
            other = await client.post(
                "/v1/chat/completions", json={"model": "other", "messages": MESSAGES}
            )
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "body.1")
    assert (other.status_code, other.json()["error"]["type"]) == (404, "NotFoundError")


async def test_a_drop_breaks_the_connection(url: str) -> None:
    request = {"model": MODEL, "messages": MESSAGES, "stream": True}
    request["narwhal_sim"] = {"output_tokens": 5, "fault": "drop", "fault_at": 2}
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(base_url=url) as client:
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", "/v1/chat/completions", json=request) as response:
                    async for piece in response.aiter_raw():
                        received += piece
            assert len(events(received)) == 3
            request["stream"] = False
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post("/v1/chat/completions", json=request)
            assert (await client.get("/health")).status_code == 200  # the server lives on


async def test_run_time_switches_over_http(url: str) -> None:
    chat = {"model": MODEL, "messages": MESSAGES}
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(base_url=url) as client:
            slowed = await client.post("/sim/slowdown", json={"factor": 2})
            switched = await client.post("/sim/directives", json={"output_tokens": 3})
            answer = (await client.post("/v1/chat/completions", json=chat)).json()
            state = (await client.get("/sim/state")).json()
            wrong = await client.get("/sim/slowdown")
            bad = await client.post("/sim/slowdown", json={"factor": "fast"})
    assert slowed.json()["slowdown"] == 2.0
    assert switched.json()["directives"] == {"output_tokens": 3}
    assert answer["usage"]["completion_tokens"] == 3
    assert (state["steps"], state["completed"], state["running"]) == (3, 1, 0)
    assert (wrong.status_code, bad.status_code) == (405, 400)


async def test_api_key_and_request_id_over_http(nursery: trio.Nursery) -> None:
    engine = SimEngine(MODEL, timing=profile("zero"), api_key="sekret")
    with trio.fail_after(DEADLINE_S):
        url: str = await nursery.start(serve_sim, engine, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=url) as client:
            refused = await client.get("/v1/models")
            unknown = await client.get("/v1/nowhere")
            version = await client.get("/version")
            answer = await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": MESSAGES},
                headers={"Authorization": "Bearer sekret", "X-Request-Id": "over-http"},
            )
    nursery.cancel_scope.cancel()
    assert (refused.status_code, refused.content) == (401, b'{"error":"Unauthorized"}')
    assert unknown.status_code == 401
    assert version.json() == {"version": "0.32.0"}
    assert answer.json()["id"] == "chatcmpl-over-http"
    assert answer.headers["content-length"] == str(len(answer.content))  # not chunked


@contextlib.contextmanager
def _command(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``narwhal sim --bind 127.0.0.1:0 --model MODEL *args`` as a process, and its URL."""
    command = [
        sys.executable,
        "-c",
        "import sys; from narwhal.sim.server import main; sys.exit(main(sys.argv[1:]))",
        "--bind",
        "127.0.0.1:0",
        "--model",
        MODEL,
        *args,
    ]
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root, env=env
    ) as process:
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], DEADLINE_S)
            assert ready, "no URL printed in time"
            line = process.stdout.readline()
            url = line.rsplit(" ", 1)[-1].strip()
            assert url.startswith("http://127.0.0.1:"), line
            yield process, url
        finally:
            if process.poll() is None:
                process.kill()


def test_the_command_prints_its_url_and_stops_on_ctrl_c() -> None:
    with _command("--dialect", "sglang", "--profile", "zero") as (process, url):
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": MESSAGES, "narwhal_sim": {"output_tokens": 2}},
            timeout=DEADLINE_S,
        )
        assert response.json()["usage"]["completion_tokens"] == 2
        assert response.json()["choices"][0]["matched_stop"] == 151645
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=DEADLINE_S)
        assert process.returncode == 0, errors


def test_the_command_keeps_a_ledger_by_request_id_with_ledger() -> None:
    with _command("--ledger", "--time-scale", "0.1") as (process, url):
        before = time.monotonic()
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": MESSAGES, "narwhal_sim": {"output_tokens": 4}},
            headers={"X-Request-Id": "tagged"},
            timeout=DEADLINE_S,
        )
        after = time.monotonic()
        ledger = httpx.get(f"{url}/sim/ledger", timeout=DEADLINE_S).json()
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=DEADLINE_S)
    assert response.status_code == 200
    assert (ledger["clock"], ledger["bucket_s"], ledger["steps"]) == ("time.monotonic", 1.0, 4)
    # On this process's clock too: the steps ran while the request was answered.
    buckets = [int(bucket) for bucket in ledger["busy_s"]]
    assert int(before) <= min(buckets) and max(buckets) <= int(after)
    charged = sum(ledger["charged_s"]["tagged"].values())
    assert 0 < charged <= sum(ledger["busy_s"].values()) <= after - before


async def test_the_ledger_route_over_http(nursery: trio.Nursery, url: str) -> None:
    timing = profile("h100-llama3-8b", time_scale=0.1)
    assert isinstance(timing, StepTiming) and isinstance(timing.profile, EngineType)
    engine = SimEngine(MODEL, timing=timing)
    engine.watch_steps(SimLedger(timing.profile))
    chat = {"model": MODEL, "messages": MESSAGES, "narwhal_sim": {"output_tokens": 3}}
    with trio.fail_after(DEADLINE_S):
        ledgered: str = await nursery.start(serve_sim, engine, "127.0.0.1:0")
        async with httpx.AsyncClient() as client:
            await client.post(
                f"{ledgered}/v1/chat/completions", json=chat, headers={"X-Request-Id": "r1"}
            )
            kept = await client.get(f"{ledgered}/sim/ledger")
            missing = await client.get(f"{url}/sim/ledger")
    assert kept.status_code == 200 and list(kept.json()["charged_s"]) == ["r1"]
    assert missing.status_code == 404
    assert "--ledger" in missing.json()["error"]["message"]


def test_the_command_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--bind", "127.0.0.1:0", "--model", MODEL, "--profile", "tpu"])
    assert exit_info.value.code == 2
    assert "h100-llama3-8b" in capsys.readouterr().err
    assert main(["--bind", "127.0.0.1:0", "--model", MODEL, "--max-model-len", "0"]) == 2
    assert "--max-model-len must be at least 1" in capsys.readouterr().err
    assert main(["--bind", "127.0.0.1:0", "--model", MODEL, "--ledger", "--profile", "zero"]) == 2
    assert "--ledger needs a profile with a step loop, not 'zero'" in capsys.readouterr().err
