"""SGLang 0.5.23 shapes (against the captures) and OpenAI's shapes (pure)."""

from __future__ import annotations

import re

import pytest

from narwhal.sim import SimEngine, profile
from tests.sim.helpers import (
    CHAT,
    MODEL,
    captured,
    chat,
    completion,
    json_body,
    plan_events,
    skeleton,
)
from tests.sim.wire_033 import CHUNKS


@pytest.fixture
def sglang() -> SimEngine:
    return SimEngine(MODEL, dialect="sglang")


@pytest.fixture
def openai() -> SimEngine:
    return SimEngine(MODEL, dialect="openai")


def capture(name: str) -> object:
    return skeleton(captured(CHUNKS[f"sglang: sglang {name}"]))


# --- SGLang -----------------------------------------------------------------------------------


def test_sglang_chat_stream(sglang: SimEngine) -> None:
    events = plan_events(
        chat(
            sglang,
            stream=True,
            stream_options={"include_usage": True},
            narwhal_sim={"output_tokens": 4, "reasoning_tokens": 1},
        )
    )
    role, reasoning, *content, finish, usage, done = events
    assert skeleton(role) == capture("chat first chunk")
    assert skeleton(reasoning) == capture("chat reasoning delta")
    assert reasoning["choices"][0]["delta"]["reasoning_content"]
    assert all(c["choices"][0]["delta"]["content"] for c in content) and len(content) == 3
    assert skeleton(finish) == capture("chat final chunk (EOS token id as matched_stop)")
    assert finish["choices"][0]["matched_stop"] == 151645
    assert skeleton(usage) == capture("chat usage chunk")
    assert usage["usage"]["completion_tokens"] == 4 and usage["usage"]["reasoning_tokens"] == 1
    assert all(e["usage"] is None for e in events[:-2])
    assert all("token_ids" not in e["choices"][0] for e in events[:-2])
    assert done == "[DONE]"


def test_sglang_tool_calls(sglang: SimEngine) -> None:
    events = plan_events(chat(sglang, stream=True, narwhal_sim={"tool_calls": 1}))
    header, args = events[1], events[2]
    assert skeleton(header) == capture("chat tool-call header delta")
    assert skeleton(args) == capture("chat tool-call args delta")
    fragment = args["choices"][0]["delta"]["tool_calls"][0]
    assert (fragment["id"], fragment["type"], fragment["function"]["name"]) == (
        None,
        "function",
        None,
    )
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_sglang_refuses_token_ids_on_streaming_chat(sglang: SimEngine) -> None:
    plan = chat(sglang, stream=True, return_token_ids=True)
    assert plan.status == 400
    body = json_body(plan)
    assert skeleton(body) == capture("non-stream error body")
    assert "return_token_ids" in body["message"]


def test_sglang_completions_return_token_ids(sglang: SimEngine) -> None:
    events = plan_events(
        completion(sglang, stream=True, return_token_ids=True, narwhal_sim={"output_tokens": 3})
    )
    assert skeleton(events[0]) == capture("completion first delta (return_token_ids)")
    assert "prompt_token_ids" not in events[1]["choices"][0]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    plain = plan_events(completion(sglang, stream=True, narwhal_sim={"output_tokens": 2}))
    assert "token_ids" not in plain[0]["choices"][0]


def test_sglang_non_streaming_chat(sglang: SimEngine) -> None:
    body = json_body(chat(sglang, return_token_ids=True, narwhal_sim={"output_tokens": 3}))
    assert skeleton(body) == capture("chat non-stream (return_token_ids)")
    assert len(body["choices"][0]["response_token_ids"]) == 3


def test_sglang_non_streaming_tool_calls_and_completions(sglang: SimEngine) -> None:
    message = json_body(chat(sglang, narwhal_sim={"tool_calls": 2}))["choices"][0]["message"]
    assert [call["index"] for call in message["tool_calls"]] == [0, 1]
    assert message["content"] is None
    body = json_body(completion(sglang, return_token_ids=True, logprobs=1, max_tokens=3))
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["tokens"]) == 3
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None


def test_sglang_stop_string_is_matched_stop(sglang: SimEngine) -> None:
    finish = plan_events(chat(sglang, stream=True, stop="END", narwhal_sim={"output_tokens": 2}))[
        -2
    ]
    assert finish["choices"][0]["matched_stop"] == "END"


def test_sglang_continuous_usage_needs_no_include_usage(sglang: SimEngine) -> None:
    events = plan_events(
        chat(
            sglang,
            stream=True,
            stream_options={"continuous_usage_stats": True},
            narwhal_sim={"output_tokens": 2},
        )
    )
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [0, 1, 2, 2]


def test_sglang_errors_are_flat(sglang: SimEngine) -> None:
    plan = chat(sglang, narwhal_sim={"fault": "http_500"})
    assert plan.status == 500
    body = json_body(plan)
    assert body["object"] == "error" and body["code"] == 500
    frames = plan_events(
        chat(sglang, stream=True, narwhal_sim={"fault": "error_frame", "fault_at": 1})
    )
    error = frames[-2]
    assert skeleton(error) == capture("streaming error frame")
    raw = chat(sglang, stream=True, narwhal_sim={"fault": "error_frame", "fault_at": 1}).body
    # The engines write this frame with json.dumps: spaces after ':' and ','.
    assert re.search(rb'data: \{"error": \{"object": "error", "message": ', raw)


# --- OpenAI -----------------------------------------------------------------------------------


def test_openai_chat_stream(openai: SimEngine) -> None:
    events = plan_events(chat(openai, stream=True, narwhal_sim={"output_tokens": 3}))
    role, *content, finish, done = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert [list(c["choices"][0]["delta"]) for c in content] == [["content"]] * 3
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    for event in events[:-1]:
        assert list(event)[:7] == [
            "id",
            "object",
            "created",
            "model",
            "service_tier",
            "system_fingerprint",
            "choices",
        ]
        assert "usage" not in event
        assert "token_ids" not in event["choices"][0]
    assert done == "[DONE]"


def test_openai_usage_keys_only_with_include_usage(openai: SimEngine) -> None:
    events = plan_events(
        chat(
            openai,
            stream=True,
            return_token_ids=True,
            stream_options={"include_usage": True},
            narwhal_sim={"output_tokens": 2},
        )
    )
    assert all(e["usage"] is None for e in events[:-2])
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 2
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 2
    assert all("token_ids" not in e["choices"][0] for e in events[:-2])


def test_openai_refusal_deltas(openai: SimEngine) -> None:
    events = plan_events(
        chat(openai, stream=True, narwhal_sim={"refusal": "I can't help with that."})
    )
    role, *refusals, _finish, _ = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": None, "refusal": ""}
    text = "".join(e["choices"][0]["delta"]["refusal"] for e in refusals)
    assert text == "I can't help with that."
    body = json_body(chat(openai, narwhal_sim={"refusal": "No."}))
    assert body["choices"][0]["message"]["refusal"] == "No."
    assert body["choices"][0]["message"]["content"] is None


def test_openai_tool_calls(openai: SimEngine) -> None:
    events = plan_events(chat(openai, stream=True, narwhal_sim={"tool_calls": 1}))
    header = events[1]["choices"][0]["delta"]["tool_calls"]
    assert header == [
        {
            "index": 0,
            "id": header[0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    assert header[0]["id"].startswith("call_")
    later = events[2]["choices"][0]["delta"]["tool_calls"][0]
    assert set(later) == {"index", "function"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_openai_reasoning_is_hidden_but_timed_and_counted() -> None:
    timing = profile("zero")
    engine = SimEngine(MODEL, dialect="openai", timing=timing)
    fields = {"stream": True, "stream_options": {"include_usage": True}}
    directives = {"output_tokens": 4, "reasoning_tokens": 2, "ttft_s": 0.5, "itl_s": 0.25}
    plan = chat(engine, **fields, narwhal_sim=directives)
    events = plan_events(plan)
    assert all("reasoning" not in str(e["choices"]) for e in events[:-1] if e["choices"])
    details = events[-2]["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == 2
    assert plan.frames[0].delay_s == 0.5 + 2 * 0.25  # the role chunk waits for visible output


def test_openai_completions(openai: SimEngine) -> None:
    events = plan_events(
        completion(openai, stream=True, logprobs=1, narwhal_sim={"output_tokens": 2})
    )
    first, _second, finish, done = events
    assert list(first) == ["id", "object", "created", "choices", "model", "system_fingerprint"]
    assert list(first["choices"][0]["logprobs"]) == [
        "tokens",
        "token_logprobs",
        "top_logprobs",
        "text_offset",
    ]
    assert finish["choices"][0]["text"] == "" and finish["choices"][0]["finish_reason"] == "stop"
    assert done == "[DONE]"


def test_openai_completions_usage_and_body(openai: SimEngine) -> None:
    events = plan_events(
        completion(
            openai,
            stream=True,
            stream_options={"include_usage": True},
            narwhal_sim={"output_tokens": 2},
        )
    )
    assert all(e["usage"] is None for e in events[:-2])
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2
    body = json_body(completion(openai, logprobs=2, narwhal_sim={"output_tokens": 3}))
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    assert len(body["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    chat_body = json_body(chat(openai, narwhal_sim={"tool_calls": 1, "reasoning_tokens": 2}))
    message = chat_body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["type"] == "function"
    assert chat_body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2


def test_openai_errors_use_the_openai_envelope(openai: SimEngine) -> None:
    missing = json_body(openai.plan(CHAT, {"model": MODEL}))["error"]
    assert missing["type"] == "invalid_request_error" and missing["param"] == "messages"
    assert missing["code"] is None
    wrong_model = json_body(chat(openai, model="other"))["error"]
    assert wrong_model["code"] == "model_not_found"
    unknown = openai.respond("POST", "/v1/other")
    assert unknown.status == 404 and "error" in json_body(unknown)
    busy = chat(openai, narwhal_sim={"fault": "http_503"})
    assert busy.status == 503 and json_body(busy)["error"]["type"] == "server_error"
