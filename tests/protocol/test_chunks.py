"""Chunk inspection, the token-ID rules, and the repairs made for clients."""

from typing import Any

import orjson
import pytest

from narwhal.errors import EngineResponseError
from narwhal.protocol.chunks import Exposure, coalesce_tool_calls, expose, inspect_chunk

ROLE = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,'
    '"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    '"logprobs":null,"finish_reason":null}],"prompt_token_ids":[151644,872],"prompt_text":null}'
)
CONTENT = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,'
    '"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,'
    '"finish_reason":null,"token_ids":[9707]}],"kv_transfer_params":null}'
)
TOOL_HEADER = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,'
    '"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":null,"tool_calls":['
    '{"id":"chatcmpl-tool-9f1c2","type":"function","index":0,"function":{"name":"get_weather"}},'
    '{"index":0,"function":{"arguments":"{\\"city\\": \\""}}]},"logprobs":null,'
    '"finish_reason":null,"token_ids":[1,2]}],"kv_transfer_params":null}'
)
USAGE = (
    '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,'
    '"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":12,"total_tokens":17,'
    '"completion_tokens":5},"system_fingerprint":"fp_3e8a1c2d"}'
)


def load(text: str) -> dict[str, Any]:
    value: dict[str, Any] = orjson.loads(text)
    return value


def test_role_chunk_is_not_an_output_event() -> None:
    facts = inspect_chunk(load(ROLE), "chat", ids_required=True)
    assert not facts.output and not facts.finish and facts.token_ids == 0


def test_content_chunk_counts_its_ids() -> None:
    facts = inspect_chunk(load(CONTENT), "chat", ids_required=True)
    assert facts.output and facts.token_ids == 1 and facts.has_token_ids


def test_several_tokens_in_one_chunk_count_as_ids_not_chunks() -> None:
    chunk = load(CONTENT)
    chunk["choices"][0]["token_ids"] = [1, 2, 3]
    assert inspect_chunk(chunk, "chat", ids_required=True).token_ids == 3


def test_empty_id_list_is_valid_and_counts_zero() -> None:
    chunk = load(CONTENT)
    chunk["choices"][0]["token_ids"] = []
    assert inspect_chunk(chunk, "chat", ids_required=True).token_ids == 0


@pytest.mark.parametrize(
    "ids",
    [None, [True], [1, False], [-1], [1.0], ["3"], "12", {"0": 1}],
)
def test_output_without_valid_ids_fails(ids: Any) -> None:
    chunk = load(CONTENT)
    chunk["choices"][0]["token_ids"] = ids
    with pytest.raises(EngineResponseError) as caught:
        inspect_chunk(chunk, "chat", ids_required=True)
    assert caught.value.code == "malformed_engine_response"
    assert caught.value.param == "choices[0].token_ids"


def test_output_without_the_key_fails_when_ids_are_required() -> None:
    chunk = load(CONTENT)
    del chunk["choices"][0]["token_ids"]
    with pytest.raises(EngineResponseError):
        inspect_chunk(chunk, "chat", ids_required=True)
    assert inspect_chunk(chunk, "chat", ids_required=False).output


def test_ids_on_non_output_events_are_checked_but_not_required() -> None:
    carrier = load(CONTENT)
    carrier["choices"][0]["delta"] = {}
    carrier["choices"][0]["token_ids"] = [7, 8]
    facts = inspect_chunk(carrier, "chat", ids_required=True)
    assert not facts.output and facts.token_ids == 2
    carrier["choices"][0]["token_ids"] = [True]
    with pytest.raises(EngineResponseError):
        inspect_chunk(carrier, "chat", ids_required=False)


@pytest.mark.parametrize(
    ("delta", "output"),
    [
        ({"content": ""}, False),
        ({"content": None}, False),
        ({}, False),
        ({"role": "assistant"}, False),
        ({"reasoning": "hm"}, True),
        ({"reasoning_content": "hm"}, True),
        ({"refusal": "no"}, True),
        ({"tool_calls": [{"index": 0, "function": {"arguments": ""}}]}, True),
        ({"function_call": {"name": "f"}}, True),
    ],
)
def test_output_event_definition(delta: dict[str, Any], output: bool) -> None:
    chunk = {"choices": [{"index": 0, "delta": delta, "token_ids": [1]}]}
    assert inspect_chunk(chunk, "chat", ids_required=True).output is output


def test_completion_text_is_output() -> None:
    chunk = {"choices": [{"index": 0, "text": " Paris", "token_ids": [12366]}]}
    assert inspect_chunk(chunk, "completions", ids_required=True).output
    chunk["choices"][0]["text"] = ""
    assert not inspect_chunk(chunk, "completions", ids_required=True).output


def test_usage_only_chunk() -> None:
    facts = inspect_chunk(load(USAGE), "chat", ids_required=True)
    assert facts.usage and facts.usage_only and not facts.output


@pytest.mark.parametrize("chunk", [[], "x", {"choices": None}, {"choices": [3]}])
def test_malformed_chunks(chunk: Any) -> None:
    with pytest.raises(EngineResponseError):
        inspect_chunk(chunk, "chat", ids_required=False)


def test_hidden_ids_become_null_with_the_key_kept() -> None:
    role, content = load(ROLE), load(CONTENT)
    exposure = Exposure(hide_token_ids=True, drop_usage_chunk=True)
    assert expose(role, "chat", exposure)
    assert "prompt_token_ids" in role and role["prompt_token_ids"] is None
    assert expose(content, "chat", exposure)
    assert content["choices"][0]["token_ids"] is None


def test_ids_kept_when_the_client_asked() -> None:
    content = load(CONTENT)
    assert not expose(content, "chat", Exposure(hide_token_ids=False, drop_usage_chunk=False))
    assert content["choices"][0]["token_ids"] == [9707]


def test_same_index_tool_fragments_are_coalesced() -> None:
    chunk = load(TOOL_HEADER)
    assert expose(chunk, "chat", Exposure(hide_token_ids=False, drop_usage_chunk=False))
    assert chunk["choices"][0]["delta"]["tool_calls"] == [
        {
            "id": "chatcmpl-tool-9f1c2",
            "type": "function",
            "index": 0,
            "function": {"name": "get_weather", "arguments": '{"city": "'},
        }
    ]


def test_distinct_indices_are_left_alone() -> None:
    calls = [{"index": 0, "function": {"arguments": "a"}}, {"index": 1, "id": "x"}]
    assert coalesce_tool_calls(calls) is None


def test_coalescing_keeps_order_and_concatenates_in_order() -> None:
    calls = [
        {"index": 1, "id": "b", "function": {"name": "g"}},
        {"index": 0, "id": "a", "type": "function", "function": {"name": "f"}},
        {"index": 1, "type": "function", "function": {"arguments": "{"}},
        {"index": 1, "function": {"arguments": "}"}},
    ]
    assert coalesce_tool_calls(calls) == [
        {"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        {"index": 0, "id": "a", "type": "function", "function": {"name": "f"}},
    ]
