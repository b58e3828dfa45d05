"""The relay path end to end, in virtual time: router in front of simulated engines."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.conftest import MODEL, StartFleet
from tests.support import sse_payloads


def frames(text: str) -> list[Any]:
    return [p if p == "[DONE]" else json.loads(p) for p in sse_payloads(text)]


async def test_streamed_chat_keeps_the_engine_shape_and_hides_what_the_router_asked(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(stream=True, narwhal_sim={"output_tokens": 3})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = frames(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    role = chunks[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "prompt_token_ids" in role and role["prompt_token_ids"] is None
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 2  # the third token ends the sequence: vLLM shows no text for it
    for chunk in content:
        assert "token_ids" in chunk["choices"][0] and chunk["choices"][0]["token_ids"] is None
    # The router forced include_usage upstream: the usage chunk is dropped and the
    # fingerprint sits on the finish chunk, as vLLM sends it without include_usage.
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "system_fingerprint" in chunks[-1]
    sent = [body for sim in fleet.sims.values() for body in sim.requests if "messages" in body]
    upstream = sent[-1]
    assert upstream["stream"] is True
    assert upstream["return_token_ids"] is True and upstream["stream_interval"] == 1
    assert upstream["stream_options"]["include_usage"] is True
    assert upstream["narwhal_sim"] == {"output_tokens": 3}
    fleet.assert_quiescent()
    assert fleet.counters()["completed"] == 1


async def test_streamed_chat_with_usage_and_token_ids_when_the_client_asks(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
        narwhal_sim={"output_tokens": 4},
    )
    chunks = frames(response.text)[:-1]
    assert isinstance(chunks[0]["prompt_token_ids"], list)
    ids = [i for c in chunks if c["choices"] for i in (c["choices"][0].get("token_ids") or [])]
    assert len(ids) == 4
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


async def test_non_streamed_chat_is_assembled(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(narwhal_sim={"output_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0].get("token_ids") is None
    assert body.get("prompt_token_ids") is None
    fleet.assert_quiescent()


async def test_non_streamed_chat_returns_ids_when_asked(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    body = (await fleet.chat(return_token_ids=True, narwhal_sim={"output_tokens": 5})).json()
    assert len(body["choices"][0]["token_ids"]) == 5
    assert isinstance(body["prompt_token_ids"], list) and body["prompt_token_ids"]


async def test_completions_stream_and_assembly(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    streamed = await fleet.completion(stream=True, logprobs=1, narwhal_sim={"output_tokens": 3})
    chunks = frames(streamed.text)[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[0]["object"] == "text_completion"
    assembled = (await fleet.completion(logprobs=1, narwhal_sim={"output_tokens": 3})).json()
    choice = assembled["choices"][0]
    # The last token ends the sequence: no text, but vLLM's logprobs name it ("<|im_end|>").
    assert text and choice["text"] == "".join(choice["logprobs"]["tokens"][:-1])
    assert len(choice["logprobs"]["tokens"]) == 3
    assert len(choice["logprobs"]["text_offset"]) == 3
    assert assembled["usage"]["completion_tokens"] == 3


async def test_streamed_tool_call_fragments_are_coalesced(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(
        stream=True,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        narwhal_sim={"tool_calls": 1},
    )
    chunks = frames(response.text)[:-1]
    for chunk in chunks:
        calls = chunk["choices"][0]["delta"].get("tool_calls") if chunk["choices"] else None
        if calls:
            indices = [call["index"] for call in calls]
            assert len(indices) == len(set(indices))
    first = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls"))
    call = first["choices"][0]["delta"]["tool_calls"][0]
    assert call["id"] and call["function"]["name"] == "get_weather"


async def test_non_streamed_tool_calls_are_assembled(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = (await fleet.chat(tools=tools, narwhal_sim={"tool_calls": 2})).json()
    calls = body["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 2
    for call in calls:
        assert call["id"] and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        json.loads(call["function"]["arguments"])
    assert body["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("dialect", ["sglang", "openai"])
async def test_other_dialects_relay_and_assemble(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, dialect: str
) -> None:
    fleet = await start_fleet([("sim-x", dialect)])
    streamed = await fleet.chat(stream=True, narwhal_sim={"output_tokens": 4})
    chunks = frames(streamed.text)[:-1]
    assert all(c["choices"] for c in chunks), "the forced usage chunk must not reach the client"
    upstream = fleet.sims["sim-x"].requests[-1]
    assert "return_token_ids" not in upstream
    body = (await fleet.chat(narwhal_sim={"output_tokens": 4})).json()
    assert body["usage"]["completion_tokens"] == 4
    ready = fleet.router.statistics().as_json()
    assert ready["engines"][0]["token_accounting"] == "unavailable"
    fleet.assert_quiescent()


async def test_ttft_and_gaps_follow_the_simulated_engine(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    start = trio.current_time()
    async with fleet.client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "narwhal_sim": {"output_tokens": 3, "ttft_s": 0.25, "itl_s": 0.05},
        },
    ) as response:
        assert response.status_code == 200
        # Headers go out with the first output event, not before.
        assert trio.current_time() - start == pytest.approx(0.25)
        await response.aread()
    assert trio.current_time() - start == pytest.approx(0.35)


async def test_forcing_usage_does_not_turn_on_continuous_usage(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    response = await fleet.chat(
        stream=True,
        stream_options={"continuous_usage_stats": True},
        narwhal_sim={"output_tokens": 3},
    )
    chunks = frames(response.text)[:-1]
    assert all(chunk.get("usage") is None for chunk in chunks)
    sent = fleet.sims["sim-a"].requests[-1]["stream_options"]
    assert sent == {"include_usage": True}


async def test_continuous_usage_passes_when_the_client_asks_for_it(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    response = await fleet.chat(
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        narwhal_sim={"output_tokens": 3},
    )
    chunks = frames(response.text)[:-1]
    assert all(chunk.get("usage") is not None for chunk in chunks)
