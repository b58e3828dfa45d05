"""vLLM 0.32 shapes and values beyond the captures (pure: plans, no event loop).

``test_vllm032_captures`` compares the simulator with real vLLM 0.32 answers. These tests
cover what the captures do not show, from vLLM's source (``vllm/entrypoints/openai``): the
reasoning and hermes deltas (whose delta shapes ``reference/vllm-0.33-captures`` shows, same in
0.32), stop strings, ``stream_interval``, and the token accounting of silent tokens.
"""

from __future__ import annotations

import json
from typing import Any

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
from tests.sim.vllm_captures import capture, same, shape
from tests.sim.wire_033 import CHUNKS

EOS = 151645
TOOL_CALL, END_TOOL_CALL, END_THINK = 151657, 151658, 151668


@pytest.fixture
def engine() -> SimEngine:
    return SimEngine(MODEL)


def delta_of(line: str) -> Any:
    return captured(line)["choices"][0]["delta"]


def test_plain_stream_values(engine: SimEngine) -> None:
    role, *content, finish, done = plan_events(
        chat(engine, stream=True, narwhal_sim={"output_tokens": 3})
    )
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] is None
    assert [list(c["choices"][0]["delta"]) for c in content] == [["content"]] * 2
    assert all(chunk["choices"][0]["token_ids"] is None for chunk in [*content, finish])
    # The third token is the end of sequence: vLLM shows no text for it.
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["system_fingerprint"].startswith("vllm-0.32.0-")
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
    assert ids[-1] == EOS
    assert usage["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "total_tokens": len(prompt_ids) + 5,
        "completion_tokens": 5,
    }
    assert usage["choices"] == [] and "system_fingerprint" in usage
    assert "system_fingerprint" not in chunks[-1]


def test_the_end_of_sequence_in_logprobs(engine: SimEngine) -> None:
    finish = plan_events(
        chat(engine, stream=True, logprobs=True, narwhal_sim={"output_tokens": 1})
    )[-2]
    (entry,) = finish["choices"][0]["logprobs"]["content"]
    assert finish["choices"][0]["delta"] == {}
    assert entry["token"] == "<|im_end|>" and entry["bytes"] == list(b"<|im_end|>")


def test_chat_logprobs_with_two_alternatives(engine: SimEngine) -> None:
    chunk = plan_events(
        chat(engine, stream=True, logprobs=True, top_logprobs=2, narwhal_sim={"output_tokens": 3})
    )[1]
    real = capture("chat_stream_logprobs").events()[1]
    assert same(
        shape(chunk["choices"][0]["logprobs"]["content"][0]),
        shape(real["choices"][0]["logprobs"]["content"][0]),
    )
    entry = chunk["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == chunk["choices"][0]["delta"]["content"]
    assert entry["bytes"] == list(entry["token"].encode())
    top = entry["top_logprobs"]
    assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
    assert top[1]["token"] != entry["token"] and top[1]["logprob"] < entry["logprob"]


def test_reasoning_deltas_come_first(engine: SimEngine) -> None:
    fields = {"narwhal_sim": {"output_tokens": 6, "reasoning_tokens": 2}}
    chunks = plan_events(chat(engine, stream=True, return_token_ids=True, **fields))[1:-1]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    # </think> and the end of sequence show nothing (vLLM's parser strips the one, the
    # detokenizer skips the other); their IDs travel in empty deltas.
    assert [list(delta) for delta in deltas] == [["reasoning"]] * 2 + [[]] + [["content"]] * 2 + [
        []
    ]
    assert chunks[2]["choices"][0]["token_ids"] == [END_THINK]
    assert delta_of(CHUNKS["chunks: chat reasoning delta"]).keys() == deltas[0].keys()
    plain = plan_events(chat(engine, stream=True, **fields))[1:-1]
    assert [list(c["choices"][0]["delta"]) for c in plain] == [["reasoning"]] * 2 + [
        ["content"]
    ] * 2 + [[]]


def test_tool_calls_in_the_hermes_shape(engine: SimEngine) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    plan = chat(engine, stream=True, tools=tools, narwhal_sim={"tool_calls": 2})
    _role, *chunks, finish, done = plan_events(plan)
    header, args = chunks[0], chunks[1]
    assert skeleton(header["choices"][0]["delta"]) == skeleton(
        delta_of(CHUNKS["chunks: chat tool-call header delta (hermes parser)"])
    )
    assert skeleton(args["choices"][0]["delta"]) == skeleton(
        delta_of(CHUNKS["chunks: chat tool-call args delta"])
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


def test_hermes_markup_travels_in_hidden_chunks_with_ids(engine: SimEngine) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    events = plan_events(
        chat(engine, stream=True, return_token_ids=True, tools=tools, narwhal_sim={"tool_calls": 1})
    )[1:-1]
    empty = [e["choices"][0]["token_ids"] for e in events if not e["choices"][0]["delta"]]
    assert empty == [[TOOL_CALL], [END_TOOL_CALL], [EOS]]
    fields = {"return_token_ids": True, "tools": tools, "narwhal_sim": {"tool_calls": 1}}
    body = json_body(chat(engine, **fields))
    assert body["choices"][0]["token_ids"][0] == TOOL_CALL
    assert body["usage"]["completion_tokens"] == 7  # <tool_call>, 4 fragments, </tool_call>, EOS


def test_stop_string_is_the_stop_reason(engine: SimEngine) -> None:
    finish = plan_events(
        chat(engine, stream=True, stop=["</answer>"], narwhal_sim={"output_tokens": 2})
    )[-2]
    expected = captured(CHUNKS["chunks: chat final chunk with stop string (stop=['</answer>'])"])
    assert finish["choices"][0]["stop_reason"] == "</answer>"
    assert finish["choices"][0]["finish_reason"] == "stop"
    # An answer that ends on a stop string has no end-of-sequence token: text on the finish.
    assert skeleton(finish["choices"][0]["delta"]) == skeleton(expected["choices"][0]["delta"])


def test_max_tokens_cut_is_a_length_finish(engine: SimEngine) -> None:
    events = plan_events(
        chat(engine, stream=True, max_tokens=4, stop="x", narwhal_sim={"output_tokens": 9})
    )
    assert sum(1 for e in events[1:-1] if e["choices"][0]["delta"].get("content")) == 4
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"][0]["stop_reason"] is None


def test_chat_non_streaming_with_tool_calls_and_reasoning(engine: SimEngine) -> None:
    plan = chat(engine, return_token_ids=True, narwhal_sim={"tool_calls": 1, "reasoning_tokens": 2})
    body = json_body(plan)
    real = capture("chat_nonstream_tool_named").json()
    assert [key for key in body] == [key for key in real]
    assert list(body["choices"][0]) == list(real["choices"][0])
    assert list(body["choices"][0]["message"]) == list(real["choices"][0]["message"])
    message = body["choices"][0]["message"]
    # A call the hermes parser found: content null (a forced call's is "").
    assert message["content"] is None and message["reasoning"]
    # 2 reasoning, </think>, <tool_call>, 4 fragments, </tool_call>, the end of sequence.
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"]) == 10
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert plan.head_delay_s > 0 and plan.frames[0].delay_s == 0


def test_plain_non_streaming_answer(engine: SimEngine) -> None:
    body = json_body(chat(engine, narwhal_sim={"output_tokens": 4}))
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert "tool_calls" not in choice["message"]
    assert choice["token_ids"] is None and body["prompt_token_ids"] is None
    assert body["usage"]["completion_tokens"] == 4
    assert body["prompt_logprobs"] is None


def test_completion_streams_end_on_the_end_of_sequence(engine: SimEngine) -> None:
    events = plan_events(completion(engine, stream=True, narwhal_sim={"output_tokens": 3}))[:-1]
    assert [bool(e["choices"][0]["text"]) for e in events] == [True, True, False]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "system_fingerprint" in events[-1]


def test_completion_logprob_offsets_are_absolute(engine: SimEngine) -> None:
    events = plan_events(
        completion(engine, stream=True, logprobs=2, narwhal_sim={"output_tokens": 4})
    )[:-1]
    real = capture("completions_stream_logprobs").events()[1]
    assert skeleton(events[1]["choices"][0]["logprobs"]) == skeleton(real["choices"][0]["logprobs"])
    offset = 0
    for event in events:
        choice = event["choices"][0]
        assert choice["logprobs"]["text_offset"] == [offset]
        assert len(choice["logprobs"]["top_logprobs"][0]) == 2
        offset += len(choice["logprobs"]["tokens"][0])
    assert events[-1]["choices"][0]["logprobs"]["tokens"] == ["<|im_end|>"]
    assert events[-1]["choices"][0]["text"] == ""


def test_completion_prompt_ids_on_the_first_chunk_only(engine: SimEngine) -> None:
    events = plan_events(
        completion(engine, stream=True, return_token_ids=True, narwhal_sim={"output_tokens": 3})
    )[:-1]
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
    assert skeleton(usage) == skeleton(capture("completions_stream_logprobs").events()[-2])
    assert events[-3]["choices"][0]["stop_reason"] == "\n"
    assert "system_fingerprint" not in events[-3]
    alone = plan_events(
        completion(engine, stream=True, stop="\n", narwhal_sim={"output_tokens": 2})
    )[-2]
    assert alone["choices"][0]["stop_reason"] == "\n" and "system_fingerprint" in alone


def test_completions_continuous_usage_has_no_details(engine: SimEngine) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = plan_events(
        completion(engine, stream=True, stream_options=options, narwhal_sim={"output_tokens": 2})
    )[:-2]
    assert [list(c["usage"]) for c in chunks] == [
        ["prompt_tokens", "total_tokens", "completion_tokens"]
    ] * 2
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2]


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
    # The end of sequence rides with the last text, as vLLM's interval output carries it.
    assert events[-1]["choices"][0]["token_ids"] == [EOS]


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
    assert events[-1]["choices"][0]["delta"]["content"]  # a word and the end of sequence


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


@pytest.mark.parametrize(("capture_name", "path", "body", "status"), _ERRORS)
def test_errors_are_vllms_exact_bodies(
    engine: SimEngine, capture_name: str, path: str, body: dict[str, Any], status: int
) -> None:
    plan = engine.plan(path, body)
    assert plan.status == status
    assert json_body(plan) == captured(CHUNKS[capture_name])


def test_malformed_json_is_vllms_400(engine: SimEngine) -> None:
    plan = engine.respond("POST", CHAT, b"{'model': 1}")
    assert plan.status == 400
    expected = captured(CHUNKS["errors: malformed JSON: HTTP 400"])
    assert skeleton(json_body(plan)) == skeleton(expected)
    assert json_body(plan)["error"]["param"] == "body.1"


@pytest.mark.parametrize(
    ("method", "path", "capture_name", "status"),
    [
        ("GET", "/v1/nothing", "errors: unknown route: HTTP 404", 404),
        ("GET", CHAT, "errors: wrong method: HTTP 405", 405),
        ("GET", "/v1/models/qwen3-8b", "errors: unknown route: HTTP 404", 404),
    ],
)
def test_routes_answer_like_fastapi(
    engine: SimEngine, method: str, path: str, capture_name: str, status: int
) -> None:
    plan = engine.respond(method, path)
    assert (plan.status, json_body(plan)) == (status, captured(CHUNKS[capture_name]))


def test_more_than_one_choice_is_refused(engine: SimEngine) -> None:
    plan = chat(engine, n=2)
    assert plan.status == 400
    assert json_body(plan)["error"]["param"] == "n"
