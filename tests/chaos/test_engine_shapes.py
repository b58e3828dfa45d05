"""A stand-in engine with every broken shape, reached through the router's real transport.

Each shape gets more concurrent requests than ``upstream.max_connections``, streaming and not.
Every client gets a correct answer, a 502 envelope, or (after headers) an in-band error and
``[DONE]``; never a 500 and never a hang. Then the engine turns good again: the router must serve
it again (its pool not wedged by leaked connections, issue item 4) and close every connection the
broken shapes left open; the books balance against the client's own tally.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from narwhal.config import (
    AdmissionConfig,
    EngineConfig,
    MonitoringConfig,
    UpstreamConfig,
)
from narwhal.upstream.exchange import AFTER_COMPLETE_S
from tests.chaos.standin import SHAPES, TEXT, StandIn
from tests.chaos.support import (
    Answer,
    Tally,
    chaos_config,
    check_answer,
    collect_leaks,
    count_case,
    open_fleet,
    settle_and_check,
)
from tests.conftest import MODEL, Fleet
from tests.support import sse_payloads

pytestmark = pytest.mark.realtime

READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 2
ANSWER = "".join(TEXT)


@pytest.fixture
async def stand_in(nursery: trio.Nursery) -> AsyncIterator[tuple[StandIn, str]]:
    engine = StandIn()
    url = await nursery.start(engine.serve)
    yield engine, url


def text_of(response: httpx.Response, streamed: bool) -> str:
    if not streamed:
        choice = response.json()["choices"][0]
        return str(choice.get("message", {}).get("content") or choice.get("text") or "")
    text = ""
    for payload in sse_payloads(response.text)[:-1]:
        for choice in json.loads(payload).get("choices", []):
            text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return text


async def ask(fleet: Fleet, tally: Tally, *, stream: bool, chat: bool, kind: str) -> Answer:
    body = {"model": MODEL, "stream": stream, "max_tokens": 4}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = "Hello"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    began = trio.current_time()
    with tally.request(), trio.fail_after(READ_TIMEOUT_S * 4 + 6):
        response = await fleet.client.post(path, json=body)
    latency = trio.current_time() - began
    answer = check_answer(response.status_code, response.content, streamed=stream, where=kind)
    tally.end(answer.terminal)
    count_case(f"engine:{kind}", answer.code or answer.status, latency_s=latency)
    if answer.terminal == "completed":
        assert text_of(response, stream) == ANSWER, f"{kind}: a wrong answer: {response.text!r}"
    return answer


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "good"])
async def test_every_broken_engine_shape(stand_in: tuple[StandIn, str], shape: str) -> None:
    engine, url = stand_in
    config = chaos_config(
        engines=(EngineConfig(name="standin", url=url, dialect="openai", token_ids=False),),
        upstream=UpstreamConfig(
            connect_timeout_s=1.0, read_timeout_s=READ_TIMEOUT_S, max_connections=MAX_CONNECTIONS
        ),
        monitoring=MonitoringConfig(poll_interval_s=0.2),
        admission=AdmissionConfig(mode="open", admission_wait_s=3.0),
    )
    with trio.fail_after(60), collect_leaks() as leaks:
        async with open_fleet(config, simulated=False) as fleet:
            tally = Tally()
            engine.shape = shape
            answers: list[tuple[Answer, float]] = []

            async def one(stream: bool, chat: bool) -> None:
                began = trio.current_time()
                answer = await ask(fleet, tally, stream=stream, chat=chat, kind=shape)
                answers.append((answer, trio.current_time() - began))

            async with trio.open_nursery() as clients:
                for index in range(MAX_CONNECTIONS * 3):
                    clients.start_soon(one, index % 2 == 0, index % 3 != 2)
            terminals = {answer.terminal for answer, _ in answers}
            if shape == "finish_idle":  # issue item 11: the answer was whole
                assert terminals == {"completed"}, answers
                # Each wave of MAX_CONNECTIONS requests holds its connections for at most
                # AFTER_COMPLETE_S after the whole answer: three waves, never a read timeout.
                worst = max(latency for _, latency in answers)
                bound = 3 * AFTER_COMPLETE_S + 0.2
                assert worst < min(bound, READ_TIMEOUT_S), f"waited {worst:.2f} s for a [DONE]"
            elif shape == "bad_length":  # issue item 4
                # Those that met the framing: malformed. Once the engine's circuit opens, the
                # others may be refused (503) or fail as unanswered (502 engine_error).
                codes = {answer.code for answer, _ in answers}
                assert "malformed_engine_response" in codes, answers
                assert codes <= {
                    "malformed_engine_response",
                    "backend_unavailable",
                    "engine_error",
                }, answers
            elif shape not in ("json_200", "http10_close", "short_length"):
                # (Those three carry the whole answer: relaying it is correct too.)
                assert "completed" not in terminals, answers

            # The engine recovers: the router must serve it again, its pool not wedged.
            engine.shape = "good"
            with trio.fail_after(15):
                while True:
                    answer = await ask(fleet, tally, stream=False, chat=True, kind="recovery")
                    if answer.terminal == "completed":
                        break
                    await trio.sleep(0.1)
            async with trio.open_nursery() as clients:
                for index in range(MAX_CONNECTIONS * 3):
                    clients.start_soon(one, index % 2 == 0, True)
            recovered = answers[-MAX_CONNECTIONS * 3 :]
            assert all(a.terminal == "completed" for a, _ in recovered), recovered
            await settle_and_check(fleet.router, tally, client=fleet.client)
            with trio.move_on_after(3):
                while engine.stuck:  # noqa: ASYNC110 - the stand-in's own count
                    await trio.sleep(0.01)
            assert not engine.stuck, f"{engine.stuck} engine connections left open by the router"
        assert not leaks, f"{len(leaks)} messages leak internals, e.g. {leaks[0]}"


async def test_the_stand_in_itself_answers_correctly(stand_in: tuple[StandIn, str]) -> None:
    """The control: with the good shape, every kind of request is a correct answer."""
    _, url = stand_in
    config = chaos_config(
        engines=(EngineConfig(name="standin", url=url, dialect="openai", token_ids=False),),
        upstream=UpstreamConfig(read_timeout_s=READ_TIMEOUT_S, max_connections=MAX_CONNECTIONS),
    )
    with trio.fail_after(30):
        async with open_fleet(config, simulated=False) as fleet:
            tally = Tally()
            for stream in (True, False):
                for chat in (True, False):
                    answer = await ask(fleet, tally, stream=stream, chat=chat, kind="good")
                    assert answer.terminal == "completed"
            await settle_and_check(fleet.router, tally, client=fleet.client)
