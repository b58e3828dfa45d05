"""The stack floors (``narwhal.bench.stack_floor``): the minimal ASGI relay on stock Hypercorn and
on Narwhal's connection shell, in front of an in-process simulated engine; the process's exit;
and ``--stack-floor`` in ``narwhal bench overhead``'s command line and report."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.bench import cli
from narwhal.bench.overhead import OverheadSettings
from narwhal.bench.report import LevelReport, OverheadReport
from narwhal.bench.services import free_port
from narwhal.bench.stack_floor import FRONTS, Front, main, serve_stack_floor
from narwhal.sim import SimEngine, profile, serve_sim
from tests.bench.test_floor import chat, exits_0_on_sigterm, streamed
from tests.bench.test_report import result

MODEL = "llama-3.1-8b-instruct"
DEADLINE_S = 20


@attrs.frozen
class Relay:
    engine: str  # the engine's base URL
    front: Front
    url: str  # the stack floor's


@pytest.fixture(params=FRONTS)
async def relay(request: pytest.FixtureRequest, nursery: trio.Nursery) -> AsyncIterator[Relay]:
    engine = SimEngine(MODEL, timing=profile("zero"), seed=1)
    front: Front = request.param
    with trio.fail_after(DEADLINE_S):
        engine_url: str = await nursery.start(serve_sim, engine, "127.0.0.1:0")
        port: int = await nursery.start(partial(serve_stack_floor, 0, engine_url, front=front))
    yield Relay(engine_url, front, f"http://127.0.0.1:{port}")
    nursery.cancel_scope.cancel()


@pytest.mark.realtime
async def test_a_stream_through_the_stack_floor_is_the_engines_own(relay: Relay) -> None:
    direct, floor = await streamed(relay.engine, relay.url)
    assert floor == direct
    assert direct[-1] == "[DONE]" and len(direct) > 32


@pytest.mark.realtime
async def test_models_an_engine_error_and_a_whole_completion_are_relayed(relay: Relay) -> None:
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(base_url=relay.url, trust_env=False) as client:
            models = await client.get("/v1/models")
            whole = await client.post("/v1/chat/completions", json=chat(8, stream=False))
            unknown = await client.post("/v1/chat/completions", json={**chat(8), "model": "x"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 8
    assert unknown.status_code == 404  # the engine's own answer, passed through
    assert unknown.json()["error"]["code"] == 404


@pytest.mark.realtime
@pytest.mark.parametrize("front", FRONTS)
async def test_an_engine_that_cannot_be_reached_is_a_502(front: Front) -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_stack_floor, 0, gone, front=front))
            async with httpx.AsyncClient(trust_env=False) as client:
                answer = await client.post(f"http://127.0.0.1:{port}/v1/completions", json={})
            nursery.cancel_scope.cancel()
    assert answer.status_code == 502
    assert answer.text == "the engine cannot be reached\n"


@pytest.mark.realtime
async def test_the_stack_floor_process_exits_0_on_sigterm(relay: Relay) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "narwhal.bench.stack_floor", "--bind", f"127.0.0.1:{port}"]
    argv += ["--upstream", relay.engine, "--front", relay.front]
    await exits_0_on_sigterm(argv, port)


def test_the_stack_floor_refuses_a_bad_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--bind", "nowhere", "--upstream", "http://127.0.0.1:1"]) == 2
    assert main(["--bind", "127.0.0.1:0", "--upstream", "http://127.0.0.1:1/v1"]) == 2
    assert "stack floor:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--bind", "127.0.0.1:0", "--upstream", "http://127.0.0.1:1", "--front", "uvicorn"])


# -- --stack-floor in narwhal bench overhead ------------------------------------------------------


def test_stack_floor_is_off_by_default_and_on_with_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[OverheadSettings] = []

    def run(settings: OverheadSettings, *, echo: Any) -> OverheadReport:
        seen.append(settings)
        return OverheadReport(settings={}, environment={}, levels=(), checks=())

    monkeypatch.setattr(cli, "run_overhead", run)
    cli.main(["overhead", "--quick", "--no-vllm-router"])
    cli.main(["overhead", "--quick", "--no-vllm-router", "--stack-floor"])
    assert [settings.stack_floor for settings in seen] == [False, True]
    assert OverheadSettings(stack_floor=True).as_json()["stack_floor"] is True


def test_the_report_shows_both_stack_floors_and_the_narwhal_over_stack_floor_ratios() -> None:
    level = LevelReport(
        1,
        2,
        (
            result("direct", [1.0, 1.0]),
            result("hypercorn-floor", [3.0, 3.0], cpu_s=0.5),
            result("stack-floor", [2.0, 2.0], cpu_s=0.4),
            result("narwhal", [2.5, 2.5], cpu_s=0.6),
        ),
    )
    over = level.ratios_over("stack-floor")
    assert over is not None
    assert over.added_ttft_p50 == pytest.approx(1.5)  # 1.5 ms over 1 ms
    assert over.cpu_per_request == pytest.approx(1.5)
    text = OverheadReport(settings={}, environment={}, levels=(level,), checks=()).render()
    assert "narwhal / stack-floor: added TTFT p50 1.50x; CPU per request 1.50x" in text
    assert "narwhal / hypercorn-floor: added TTFT p50 0.75x; CPU per request 1.20x" in text
    names = {"direct", "hypercorn-floor", "stack-floor", "narwhal"}
    rows = [line.split()[0] for line in text.splitlines() if set(line.split()[:1]) & names]
    # the rows, then the two ratios' lines
    assert rows == ["direct", "hypercorn-floor", "stack-floor", "narwhal", "narwhal", "narwhal"]
    data = level.as_json()
    assert data["ratios_narwhal_over_stack_floor"]["added_ttft_p50"] == pytest.approx(1.5)
    assert data["ratios_narwhal_over_hypercorn_floor"]["cpu_per_request"] == pytest.approx(1.2)
    assert "ratios_narwhal_over_floor" not in data
