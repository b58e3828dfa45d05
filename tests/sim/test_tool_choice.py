"""A ``tool_choice`` that forces a call gets one, in each dialect's shape; ``auto`` gets text."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.sim import SimEngine
from tests.sim.helpers import chat, json_body, plan_events, skeleton

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {}}},
]
NAMED = {"type": "function", "function": {"name": "lookup"}}

# vLLM 0.32, tool_choice "required" (reference/vllm-0.32-cpu-captures/chat_stream_tool_required):
# the name alone, then the arguments, each delta with content null; the finish in an empty delta.
VLLM_NAME_DELTA = {
    "content": None,
    "tool_calls": [
        {
            "id": "chatcmpl-tool-a3eb444914458118",
            "type": "function",
            "index": 0,
            "function": {"name": "get_weather"},
        }
    ],
}
VLLM_ARGUMENTS_DELTA = {
    "content": None,
    "tool_calls": [{"index": 0, "function": {"arguments": "[]"}}],
}


def deltas(events: list[Any]) -> list[dict[str, Any]]:
    return [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]


def finish_reason(events: list[Any]) -> str:
    reasons = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict)]
    return next(r for r in reasons if r is not None)


def streamed_calls(events: list[Any]) -> dict[int, dict[str, str]]:
    """Tool calls accumulated from the stream, by index: id, name and arguments."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas(events):
        for fragment in delta.get("tool_calls") or []:
            call = calls.setdefault(fragment["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = fragment.get("id") or call["id"]
            function = fragment.get("function") or {}
            call["name"] = function.get("name") or call["name"]
            call["arguments"] += function.get("arguments") or ""
    return calls


@pytest.mark.parametrize(
    ("choice", "name", "finish"),
    [("required", "get_weather", "tool_calls"), (NAMED, "lookup", "stop")],
)
def test_vllm_streams_a_forced_call_as_vllm_does(choice: Any, name: str, finish: str) -> None:
    engine = SimEngine("m", dialect="vllm")
    events = plan_events(chat(engine, stream=True, tools=TOOLS, tool_choice=choice))
    calling = [d for d in deltas(events) if "tool_calls" in d]
    assert skeleton(calling[0]) == skeleton(VLLM_NAME_DELTA)
    assert calling[0]["tool_calls"][0]["function"] == {"name": name}
    assert calling[0]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert all(skeleton(d) == skeleton(VLLM_ARGUMENTS_DELTA) for d in calling[1:])
    assert len(calling) > 1
    assert deltas(events)[-1] == {}  # the finish chunk
    assert finish_reason(events) == finish
    (call,) = streamed_calls(events).values()
    assert call["name"] == name
    assert orjson.loads(call["arguments"]).keys() == {"city", "days"}
    assert not any(d.get("content") for d in deltas(events))


@pytest.mark.parametrize(
    ("choice", "name", "finish"),
    [("required", "get_weather", "tool_calls"), (NAMED, "lookup", "stop")],
)
def test_vllm_answers_a_forced_call_without_streaming(choice: Any, name: str, finish: str) -> None:
    engine = SimEngine("m", dialect="vllm")
    body = json_body(chat(engine, tools=TOOLS, tool_choice=choice))
    choice_body = body["choices"][0]
    message = choice_body["message"]
    assert message["content"] == ""  # vLLM: "" when the call was forced (null for a parser)
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == name and call["id"].startswith("chatcmpl-tool-")
    assert orjson.loads(call["function"]["arguments"]).keys() == {"city", "days"}
    assert choice_body["finish_reason"] == finish


@pytest.mark.parametrize("dialect", ["sglang", "openai"])
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_other_dialects_stream_a_forced_call_in_their_shape(dialect: str, choice: Any) -> None:
    engine = SimEngine("m", dialect=dialect)  # type: ignore[arg-type]
    events = plan_events(chat(engine, stream=True, tools=TOOLS, tool_choice=choice))
    name = "get_weather" if choice == "required" else "lookup"
    calling = [d for d in deltas(events) if d.get("tool_calls")]
    header = calling[0]["tool_calls"][0]
    assert header["function"] == {"name": name, "arguments": ""} and header["id"]
    (call,) = streamed_calls(events).values()
    assert call["name"] == name
    assert orjson.loads(call["arguments"]).keys() == {"city", "days"}
    named_stop = dialect == "openai" and choice == NAMED
    assert finish_reason(events) == ("stop" if named_stop else "tool_calls")
    body = json_body(chat(engine, tools=TOOLS, tool_choice=choice))
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == name


def test_the_directive_sets_how_many_forced_calls() -> None:
    engine = SimEngine("m", dialect="vllm")
    plan = chat(
        engine, stream=True, tools=TOOLS, tool_choice="required", narwhal_sim={"tool_calls": 2}
    )
    calls = streamed_calls(plan_events(plan))
    assert [call["name"] for call in calls.values()] == ["get_weather", "lookup"]
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_auto_and_none_answer_in_text(choice: Any) -> None:
    engine = SimEngine("m", dialect="vllm")
    fields: dict[str, Any] = {"tools": TOOLS}
    if choice is not None:
        fields["tool_choice"] = choice
    events = plan_events(chat(engine, stream=True, **fields))
    assert not streamed_calls(events)
    assert any(d.get("content") for d in deltas(events))
    assert finish_reason(events) == "stop"


def test_a_named_tool_that_is_not_among_the_tools_is_vllms_400() -> None:
    engine = SimEngine("m", dialect="vllm")
    choice = {"type": "function", "function": {"name": "nowhere"}}
    plan = chat(engine, tools=TOOLS, tool_choice=choice)
    assert plan.status == 400
    error = json_body(plan)["error"]
    assert error["param"] == "tool_choice"
    assert error["message"] == (
        "The tool specified in `tool_choice` does not match any of the specified `tools` "
        "(parameter=tool_choice)"
    )
