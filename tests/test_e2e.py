"""End to end on real sockets: Hypercorn serving Narwhal in front of simulated engine servers,
driven by the official ``openai`` client, the way users run it. Real clock, bounded."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial

import openai
import pytest
import trio

from narwhal.config import Config, EngineConfig, ServingConfig
from narwhal.scheduling.profiles import get_profile
from narwhal.server import serve
from narwhal.sim.engine import SimEngine
from narwhal.sim.server import serve_sim
from narwhal.sim.timing import StepTiming
from tests.support import wait_ready

pytestmark = pytest.mark.realtime

MODEL = "llama-3.1-8b-instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
async def router_url(nursery: trio.Nursery) -> AsyncIterator[str]:
    engines = []
    for index, dialect in enumerate(("vllm", "vllm")):
        engine = SimEngine(
            MODEL, dialect=dialect, timing=StepTiming(get_profile("h100-llama3-8b")), seed=index
        )
        url = await nursery.start(partial(serve_sim, engine, "127.0.0.1:0"))
        engines.append(EngineConfig(name=f"engine-{index}", url=url, dialect=dialect))
    config = Config(serving=ServingConfig(model=MODEL), engines=tuple(engines))
    urls = await nursery.start(partial(serve, config, bind="127.0.0.1:0"))
    url = urls[0]
    await wait_ready(url)
    yield url


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


async def in_thread(function: partial[object]) -> object:
    with trio.fail_after(30):
        return await trio.to_thread.run_sync(function)


async def test_openai_streaming_chat(router_url: str) -> None:
    def run() -> tuple[str, str | None, int]:
        with openai_client(router_url) as client:
            text, finish, chunks = "", None, 0
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello"}],
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"narwhal_sim": {"output_tokens": 12}},
            )
            usage = None
            for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            assert usage is not None
            return text, finish, usage.completion_tokens

    text, finish, tokens = await in_thread(partial(run))  # type: ignore[misc]
    assert text and finish in ("stop", "length") and tokens == 12


async def test_openai_non_streaming_chat_and_completion(router_url: str) -> None:
    def run() -> None:
        with openai_client(router_url) as client:
            reply = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello"}],
                extra_body={"narwhal_sim": {"output_tokens": 7}, "return_token_ids": True},
            )
            assert reply.choices[0].message.content
            assert reply.usage is not None and reply.usage.completion_tokens == 7
            assert len(reply.choices[0].token_ids) == 7  # type: ignore[attr-defined]
            completion = client.completions.create(
                model=MODEL, prompt="The capital of France is", max_tokens=5
            )
            assert completion.choices[0].text
            assert completion.usage is not None and completion.usage.completion_tokens == 5

    await in_thread(partial(run))


async def test_openai_tool_calls_streamed_and_assembled(router_url: str) -> None:
    def run() -> None:
        with openai_client(router_url) as client:
            with client.chat.completions.stream(
                model=MODEL,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=TOOLS,  # type: ignore[arg-type]
                extra_body={"narwhal_sim": {"tool_calls": 2}},
            ) as stream:
                final = stream.get_final_completion()
            calls = final.choices[0].message.tool_calls or []
            assert len(calls) == 2, calls  # no phantom calls from split fragments
            for call in calls:
                assert call.id and call.function.name == "get_weather"  # type: ignore[union-attr]
                json.loads(call.function.arguments)  # type: ignore[union-attr]
            reply = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=TOOLS,  # type: ignore[arg-type]
                extra_body={"narwhal_sim": {"tool_calls": 2}},
            )
            assembled = reply.choices[0].message.tool_calls or []
            assert [c.function.name for c in assembled] == ["get_weather", "get_weather"]  # type: ignore[union-attr]
            assert reply.choices[0].finish_reason == "tool_calls"

    await in_thread(partial(run))


async def test_openai_sees_the_error_envelopes(router_url: str) -> None:
    def run() -> None:
        with openai_client(router_url) as client:
            with pytest.raises(openai.NotFoundError) as missing:
                client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "x"}]
                )
            assert missing.value.code == "model_not_found"
            with pytest.raises(openai.BadRequestError) as wide:
                client.chat.completions.create(
                    model=MODEL, n=2, messages=[{"role": "user", "content": "x"}]
                )
            assert wide.value.code == "invalid_sampling_width"
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                stream=True,
                extra_body={"narwhal_sim": {"fault": "error_frame", "fault_at": 3}},
            )
            with pytest.raises(openai.APIError) as in_band:
                for _ in stream:
                    pass
            assert in_band.value.code == "engine_error"

    await in_thread(partial(run))
