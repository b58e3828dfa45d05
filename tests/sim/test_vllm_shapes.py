"""vLLM 0.33 shapes, key for key against the captures (pure: plans, no event loop)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from narwhal.sim import SimEngine
from tests.sim.helpers import (
    CHAT,
    COMPLETIONS,
    MODEL,
    captured,
    chat,
    completion,
    json_body,
    plan_events,
    skeleton,
)
from tests.sim.wire_033 import CHUNKS, STREAMS


@pytest.fixture
def engine() -> SimEngine:
    return SimEngine(MODEL)


def same_shapes(produced: list[Any], captured_lines: list[str]) -> None:
    expected = [line.removeprefix("data: ") for line in captured_lines]
    assert len(produced) == len(expected)
    for ours, theirs in zip(produced, expected, strict=True):
        if theirs == "[DONE]":
            assert ours == "[DONE]"
        else:
            assert skeleton(ours) == skeleton(orjson.loads(theirs))


@pytest.mark.parametrize(
    ("capture", "fields"),
    [
        ("streams: CHAT: plain stream, no stream_options", {}),
        ("streams: CHAT: include_usage", {"stream_options": {"include_usage": True}}),
        (
            "streams: CHAT: include_usage + continuous_usage_stats",
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        ),
        (
            "streams: CHAT: return_token_ids + logprobs/top_logprobs=1",
            {"return_token_ids": True, "logprobs": True, "top_logprobs": 1},
        ),
    ],
)
def test_chat_streams_match_the_captures(engine: SimEngine, capture: str, fields: Any) -> None:
    plan = chat(engine, stream=True, narwhal_sim={"output_tokens": 3}, **fields)
    assert plan.status == 200 and plan.streaming
    same_shapes(plan_events(plan), STREAMS[capture])


def test_plain_stream_values(engine: SimEngine) -> None:
    role, *content, finish, done = plan_events(
        chat(engine, stream=True, narwhal_sim={"output_tokens": 3})
    )
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] is None
    assert all(chunk["choices"][0]["token_ids"] is None for chunk in [*content, finish])
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["system_fingerprint"].startswith("vllm-0.33.0-")
    assert len({chunk["id"] for chunk in [role, *content, finish]}) == 1
    assert done == "[DONE]"


def test_token_ids_with_return_token_ids(engine: SimEngine) -> None:
    role, *chunks, usage, _ = plan_events(
        chat(
            engine,
            stream=True,
            return_token_ids=True,
            stream_options={"include_usage": True},
            narwhal_sim={"output_tokens": 5},
        )
    )
    prompt_ids = role["prompt_token_ids"]
    assert isinstance(prompt_ids, list) and all(isinstance(i, int) and i >= 0 for i in prompt_ids)
    ids = [i for chunk in chunks for i in chunk["choices"][0]["token_ids"]]
    assert len(ids) == 5 and all(type(i) is int and i >= 0 for i in ids)
    assert usage["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "total_tokens": len(prompt_ids) + 5,
        "completion_tokens": 5,
    }
    assert usage["choices"] == [] and "system_fingerprint" in usage
    assert "system_fingerprint" not in chunks[-1]


def test_chat_logprobs_with_two_alternatives(engine: SimEngine) -> None:
    chunk = plan_events(
        chat(engine, stream=True, logprobs=True, top_logprobs=2, narwhal_sim={"output_tokens": 2})
    )[1]
    key = "chunks: chat content delta with logprobs (logprobs=true, top_logprobs=2)"
    assert skeleton(chunk) == skeleton(captured(CHUNKS[key]))
    entry = chunk["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == chunk["choices"][0]["delta"]["content"]
    assert entry["bytes"] == list(entry["token"].encode())
    top = entry["top_logprobs"]
    assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
    assert top[1]["token"] != entry["token"] and top[1]["logprob"] < entry["logprob"]


def test_reasoning_deltas_come_first(engine: SimEngine) -> None:
    chunks = plan_events(
        chat(engine, stream=True, narwhal_sim={"output_tokens": 5, "reasoning_tokens": 2})
    )[1:-1]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert [list(delta) for delta in deltas] == [["reasoning"]] * 2 + [["content"]] * 3
    assert skeleton(chunks[0]) == skeleton(captured(CHUNKS["chunks: chat reasoning delta"]))


def test_tool_calls_in_the_hermes_shape(engine: SimEngine) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    plan = chat(engine, stream=True, tools=tools, narwhal_sim={"tool_calls": 2})
    _role, *chunks, finish, done = plan_events(plan)
    header, args = chunks[0], chunks[1]
    assert skeleton(header) == skeleton(
        captured(CHUNKS["chunks: chat tool-call header delta (hermes parser)"])
    )
    assert skeleton(args) == skeleton(captured(CHUNKS["chunks: chat tool-call args delta"]))
    assert skeleton(finish) == skeleton(
        captured(CHUNKS["chunks: chat final chunk (finish_reason, include_usage off)"])
    )
    first = header["choices"][0]["delta"]["tool_calls"]
    assert len(first) == 2 and first[0]["index"] == first[1]["index"] == 0
    assert first[0]["id"].startswith("chatcmpl-tool-") and first[0]["function"] == {
        "name": "lookup"
    }
    calls: dict[int, str] = {}
    for chunk in chunks:
        for fragment in chunk["choices"][0]["delta"]["tool_calls"]:
            calls[fragment["index"]] = calls.get(fragment["index"], "") + fragment["function"].get(
                "arguments", ""
            )
    assert sorted(calls) == [0, 1]
    assert all(json.loads(arguments)["city"] for arguments in calls.values())
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert finish["choices"][0]["delta"] == {}
    assert done == "[DONE]"


def test_stop_string_is_the_stop_reason(engine: SimEngine) -> None:
    finish = plan_events(
        chat(engine, stream=True, stop=["</answer>"], narwhal_sim={"output_tokens": 2})
    )[-2]
    expected = captured(CHUNKS["chunks: chat final chunk with stop string (stop=['</answer>'])"])
    assert finish["choices"][0]["stop_reason"] == "</answer>"
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert skeleton(finish["choices"]) == skeleton(expected["choices"])


def test_max_tokens_cut_is_a_length_finish(engine: SimEngine) -> None:
    events = plan_events(
        chat(engine, stream=True, max_tokens=4, stop="x", narwhal_sim={"output_tokens": 9})
    )
    assert sum(1 for e in events[1:-1] if e["choices"][0]["delta"].get("content")) == 4
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"][0]["stop_reason"] is None


def test_chat_non_streaming_matches_the_capture(engine: SimEngine) -> None:
    plan = chat(engine, return_token_ids=True, narwhal_sim={"tool_calls": 1, "reasoning_tokens": 2})
    body = json_body(plan)
    key = "chunks: chat non-streaming (JSONResponse(content=model_dump()))"
    assert skeleton(body) == skeleton(captured(CHUNKS[key]))
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"]
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"]) == 7
    assert plan.head_delay_s > 0 and plan.frames[0].delay_s == 0


def test_plain_non_streaming_answer(engine: SimEngine) -> None:
    body = json_body(chat(engine, narwhal_sim={"output_tokens": 4}))
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert "tool_calls" not in choice["message"]
    assert choice["token_ids"] is None and body["prompt_token_ids"] is None
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("capture", "fields"),
    [
        ("streams: COMPLETIONS: plain stream", {}),
        (
            "streams: COMPLETIONS: return_token_ids + logprobs=1 + include_usage",
            {"return_token_ids": True, "logprobs": 1, "stream_options": {"include_usage": True}},
        ),
    ],
)
def test_completion_streams_match_the_captures(
    engine: SimEngine, capture: str, fields: Any
) -> None:
    plan = completion(engine, stream=True, max_tokens=3, **fields)
    events = plan_events(plan)
    same_shapes(events, STREAMS[capture])
    finish = [e for e in events[:-1] if e["choices"]][-1]
    assert finish["choices"][0]["finish_reason"] == "length"


def test_completion_logprob_offsets_are_absolute(engine: SimEngine) -> None:
    events = plan_events(
        completion(engine, stream=True, logprobs=2, narwhal_sim={"output_tokens": 4})
    )[:-1]
    key = "chunks: completion delta with logprobs=2"
    assert skeleton(events[1]) == skeleton(captured(CHUNKS[key]))
    offset = 0
    for event in events:
        choice = event["choices"][0]
        assert choice["logprobs"]["text_offset"] == [offset]
        assert choice["logprobs"]["tokens"] == [choice["text"]]
        assert len(choice["logprobs"]["top_logprobs"][0]) == 2
        offset += len(choice["text"])


def test_completion_prompt_ids_on_the_first_chunk_only(engine: SimEngine) -> None:
    events = plan_events(
        completion(engine, stream=True, return_token_ids=True, narwhal_sim={"output_tokens": 3})
    )[:-1]
    first = "chunks: completion first delta (return_token_ids=true)"
    assert skeleton(events[0]) == skeleton(captured(CHUNKS[first]))
    prompt_ids = events[0]["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) == 6  # 24 characters
    assert [e["choices"][0]["prompt_token_ids"] for e in events[1:]] == [None, None]


def test_completion_final_chunk_and_usage_chunk(engine: SimEngine) -> None:
    events = plan_events(
        completion(
            engine,
            stream=True,
            stop="\n",
            stream_options={"include_usage": True},
            narwhal_sim={"output_tokens": 2},
        )
    )
    usage = events[-2]
    assert skeleton(usage) == skeleton(captured(CHUNKS["chunks: completion usage-only chunk"]))
    assert events[-3]["choices"][0]["stop_reason"] == "\n"
    alone = plan_events(
        completion(engine, stream=True, stop="\n", narwhal_sim={"output_tokens": 2})
    )[-2]
    key = "chunks: completion final delta (stop string, include_usage off)"
    assert skeleton(alone) == skeleton(captured(CHUNKS[key]))


def test_completion_non_streaming_matches_the_capture(engine: SimEngine) -> None:
    body = json_body(completion(engine, return_token_ids=True, narwhal_sim={"output_tokens": 2}))
    assert skeleton(body) == skeleton(captured(CHUNKS["chunks: completion non-streaming"]))
    assert body["usage"]["prompt_tokens"] == len(body["choices"][0]["prompt_token_ids"])


def test_completions_default_to_sixteen_tokens(engine: SimEngine) -> None:
    body = json_body(engine.plan(COMPLETIONS, {"prompt": "x" * 40, "seed": 3}))
    assert body["usage"]["completion_tokens"] <= 16


def test_token_id_prompts_count_exactly(engine: SimEngine) -> None:
    body = json_body(
        engine.plan(COMPLETIONS, {"prompt": [5, 6, 7], "return_token_ids": True, "max_tokens": 2})
    )
    assert body["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert body["usage"]["prompt_tokens"] == 3


def test_ignore_token_ids_mimics_vllm_before_0_10_2(engine: SimEngine) -> None:
    events = plan_events(
        chat(
            engine,
            stream=True,
            return_token_ids=True,
            narwhal_sim={"output_tokens": 2, "ignore_token_ids": True},
        )
    )
    assert "prompt_token_ids" not in events[0]
    assert all("token_ids" not in e["choices"][0] for e in events[1:-1])
    body = json_body(
        completion(engine, return_token_ids=True, narwhal_sim={"ignore_token_ids": True})
    )
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]


def test_stream_interval_sends_the_first_token_alone(engine: SimEngine) -> None:
    events = plan_events(
        chat(
            engine,
            stream=True,
            return_token_ids=True,
            stream_interval=3,
            narwhal_sim={"output_tokens": 8},
        )
    )[1:-1]
    assert [len(e["choices"][0]["token_ids"]) for e in events] == [1, 3, 3, 1]


def test_tokens_per_chunk_directive(engine: SimEngine) -> None:
    events = plan_events(
        chat(
            engine,
            stream=True,
            return_token_ids=True,
            logprobs=True,
            narwhal_sim={"output_tokens": 6, "tokens_per_chunk": 2},
        )
    )[1:-1]
    assert [len(e["choices"][0]["token_ids"]) for e in events] == [2, 2, 2]
    assert all(len(e["choices"][0]["logprobs"]["content"]) == 2 for e in events)


# --- errors: exact bodies ---------------------------------------------------------------------

_ERRORS: list[tuple[str, str, dict[str, Any], int]] = [
    ("errors: chat stream_options without stream: HTTP 400", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     400),
    ("errors: chat missing messages: HTTP 400", CHAT, {"model": MODEL}, 400),
    ("errors: chat n wrong type: HTTP 400", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "n": "two"}, 400),
    ("errors: chat top_logprobs without logprobs: HTTP 400", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("errors: chat tools empty: HTTP 400", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400),
    ("errors: chat tool_choice without tools: HTTP 400", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400),
    ("errors: chat stream_interval 0: HTTP 400", CHAT,
     {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_interval": 0},
     400),
    ("errors: cmpl logprobs negative: HTTP 400", COMPLETIONS, {"prompt": "x", "logprobs": -5}, 400),
    ("errors: cmpl empty prompt: HTTP 400", COMPLETIONS, {"prompt": ""}, 400),
    ("chunks: error: _check_model -> HTTP 404", CHAT,
     {"model": "foo", "messages": [{"role": "user", "content": "hi"}]}, 404),
]  # fmt: skip


@pytest.mark.parametrize(("capture", "path", "body", "status"), _ERRORS)
def test_errors_are_vllms_exact_bodies(
    engine: SimEngine, capture: str, path: str, body: dict[str, Any], status: int
) -> None:
    plan = engine.plan(path, body)
    assert plan.status == status
    assert json_body(plan) == captured(CHUNKS[capture])


def test_malformed_json_is_vllms_400(engine: SimEngine) -> None:
    plan = engine.respond("POST", CHAT, b"{'model': 1}")
    assert plan.status == 400
    expected = captured(CHUNKS["errors: malformed JSON: HTTP 400"])
    assert skeleton(json_body(plan)) == skeleton(expected)
    assert json_body(plan)["error"]["param"] == "body.1"


@pytest.mark.parametrize(
    ("method", "path", "capture", "status"),
    [
        ("GET", "/v1/nothing", "errors: unknown route: HTTP 404", 404),
        ("GET", CHAT, "errors: wrong method: HTTP 405", 405),
    ],
)
def test_routes_answer_like_fastapi(
    engine: SimEngine, method: str, path: str, capture: str, status: int
) -> None:
    plan = engine.respond(method, path)
    assert (plan.status, json_body(plan)) == (status, captured(CHUNKS[capture]))


def test_more_than_one_choice_is_refused(engine: SimEngine) -> None:
    plan = chat(engine, n=2)
    assert plan.status == 400
    assert json_body(plan)["error"]["param"] == "n"
