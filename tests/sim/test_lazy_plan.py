"""A streamed plan shapes its chunks as it is played: the same frames as the eager plan."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from narwhal.sim import LinearTiming, SimEngine
from narwhal.sim import engine as engine_module
from narwhal.sim.engine import LazyFrames, SimPlan
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, plan_events

EXACT = LinearTiming(prefill_base_s=0.5, prefill_per_token_s=0.0, decode_step_s=0.25)
MESSAGES = [{"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
USAGE = {"include_usage": True, "continuous_usage_stats": True}

# (path, body fields beyond model and stream): every dialect plans each of them.
BODIES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"messages": MESSAGES}),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "stream_options": USAGE}),
    (CHAT, {"messages": MESSAGES, "stream_interval": 3}),
    (CHAT, {"messages": MESSAGES, "narwhal_sim": {"tokens_per_chunk": 4}}),
    (CHAT, {"messages": MESSAGES, "tools": TOOLS, "narwhal_sim": {"tool_calls": 2}}),
    (CHAT, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}),
    (CHAT, {"messages": MESSAGES, "narwhal_sim": {"reasoning_tokens": 5, "hidden_tokens": 2}}),
    (CHAT, {"messages": MESSAGES, "narwhal_sim": {"refusal": "I can't help with that."}}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 1, "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": MESSAGES, "narwhal_sim": {"output_tokens": 300, "fault": "no_done"}}),
    (COMPLETIONS, {"prompt": "Once upon", "logprobs": 3, "stream_options": USAGE}),
    (COMPLETIONS, {"prompt": "Once upon", "echo": True, "return_token_ids": True}),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 200, "narwhal_sim": {"output_tokens": 200}}),
]
VLLM_BODIES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"messages": MESSAGES, "return_token_ids": True, "narwhal_sim": {"hidden_tokens": 3}}),
    (CHAT, {"messages": MESSAGES, "echo": True, "stream_options": USAGE}),
    (CHAT, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "logprobs": True}),
]
CASES = [
    (dialect, path, fields) for dialect in ("vllm", "sglang", "openai") for path, fields in BODIES
] + [("vllm", path, fields) for path, fields in VLLM_BODIES]


def plan_of(dialect: str, path: str, fields: dict[str, Any]) -> SimPlan:
    engine = SimEngine(MODEL, dialect=dialect, timing=EXACT, seed=7, name="e")  # type: ignore[arg-type]
    return engine.plan(path, {"model": MODEL, "stream": True, **fields})


@pytest.mark.parametrize(("dialect", "path", "fields"), CASES)
def test_lazy_frames_are_the_eager_frames(
    dialect: str, path: str, fields: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    lazy = plan_of(dialect, path, fields)
    assert lazy.status == 200 and isinstance(lazy.frames, LazyFrames)
    played = list(lazy.frames)  # a pass keeps nothing: the next makes the same frames again
    assert list(lazy.frames) == played
    monkeypatch.setattr(engine_module, "_LAZY_FAULTS", frozenset())  # every plan eager
    eager = plan_of(dialect, path, fields)
    assert isinstance(eager.frames, tuple)
    assert played == list(eager.frames)  # bytes, delays, steps and holds
    assert lazy == eager
    assert (lazy.output_tokens, lazy.prompt_tokens, lazy.first_token_s) == (
        eager.output_tokens,
        eager.prompt_tokens,
        eager.first_token_s,
    )


def test_a_step_model_plan_is_lazy_with_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "messages": MESSAGES,
        "narwhal_sim": {"output_tokens": 90},
    }
    lazy = SimEngine(MODEL, seed=1).plan(CHAT, body)  # h100-llama3-8b: the step loop
    assert lazy.batched and isinstance(lazy.frames, LazyFrames)
    monkeypatch.setattr(engine_module, "_LAZY_FAULTS", frozenset())
    eager = SimEngine(MODEL, seed=1).plan(CHAT, body)
    assert list(lazy.frames) == list(eager.frames)
    steps = [f.step for f in lazy.frames]
    assert steps[-3:] == [89, 90, 90]  # a token, the last one with the finish, [DONE]


def test_planning_a_long_stream_shapes_no_chunk() -> None:
    engine = SimEngine(MODEL, timing=EXACT)
    body = {"messages": MESSAGES, "stream": True, "narwhal_sim": {"output_tokens": 100_000}}
    plan = engine.plan(CHAT, body)
    frames = plan.frames
    assert isinstance(frames, LazyFrames)
    assert frames.shaped == 0  # the sizes the step loop reads need no chunk
    assert (plan.output_tokens, plan.first_token_s) == (100_000, 0.5)
    first = next(iter(frames))
    assert first.data.startswith(b'data: {"id":') and frames.shaped == engine_module._BLOCK


async def test_a_stream_shapes_a_block_at_a_time_as_it_plays(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimEngine(MODEL, timing=EXACT)
    body = {"messages": MESSAGES, "stream": True, "narwhal_sim": {"output_tokens": 10_000}}
    plan = engine.plan(CHAT, body)
    frames = plan.frames
    assert isinstance(frames, LazyFrames)
    block = engine_module._BLOCK
    stream = engine.stream(plan)
    with trio.fail_after(100):
        await stream.wait_head()
        assert frames.shaped == 0
        pieces = [await stream.__anext__() for _ in range(block)]
        assert frames.shaped == block  # the role chunk and 63 tokens
        assert trio.current_time() == 0.5 + (block - 2) * 0.25
        pieces.append(await stream.__anext__())
        assert frames.shaped == 2 * block
    stream.close()
    assert stream.state == "closed_early" and engine.statistics().closed_early == 1
    assert b"".join(pieces) == plan.body[: len(b"".join(pieces))]


async def test_a_lazy_stream_completes_and_a_short_one_ends_exactly_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimEngine(MODEL, timing=EXACT)
    body = {"messages": MESSAGES, "stream": True, "narwhal_sim": {"output_tokens": 150}}
    plan = engine.plan(CHAT, body)
    ends: list[str] = []
    stream = engine.stream(plan, on_end=ends.append)
    with trio.fail_after(100):
        await stream.wait_head()
        played = b"".join([piece async for piece in stream])
    assert played == plan.body and plan_events(plan)[-1] == "[DONE]"
    assert trio.current_time() == plan.duration_s == 0.5 + 149 * 0.25
    stream.close()
    assert ends == ["completed"]
