"""Non-streaming assembly: the seed's table, row by row, on the chunk shapes engines really send.

The streams below are the captures of ``shared/reference/vllm-0.33-captures/`` (vLLM 0.33.0's and
SGLang 0.5.23's own serialization), written as the SSE lines the router decodes.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

import pytest

from narwhal.errors import EngineResponseError
from narwhal.protocol.assembly import Assembler

Route = Literal["chat", "completions"]


def parse(sse: str) -> list[dict[str, Any]]:
    """The data objects of an SSE transcript (``[DONE]`` and blank lines dropped)."""
    chunks = []
    for line in sse.strip().splitlines():
        line = line.strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def assemble(
    sse: str | list[dict[str, Any]],
    route: Route = "chat",
    *,
    expose: bool = False,
    estimate: int = 99,
) -> dict[str, Any]:
    chunks = parse(sse) if isinstance(sse, str) else sse
    assembler = Assembler(route, expose_token_ids=expose, prompt_tokens_estimate=estimate)
    for chunk in chunks:
        assembler.feed(chunk)
    return assembler.result()


def chat_chunk(choice: dict[str, Any], **top: Any) -> dict[str, Any]:
    """A vLLM-shaped chat chunk around one choice."""
    return {
        "id": "chatcmpl-abc123",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "qwen3-8b",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}],
        **top,
    }


def delta_chunk(**delta: Any) -> dict[str, Any]:
    return chat_chunk({"delta": delta})


# -- vLLM 0.33 chat ------------------------------------------------------------------------------

VLLM_PLAIN = """
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}

data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}

data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}

data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-3e8a1c2d","kv_transfer_params":null}

data: [DONE]
"""  # noqa: E501

VLLM_INCLUDE_USAGE = """
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3},"system_fingerprint":"vllm-0.33.0-3e8a1c2d"}
data: [DONE]
"""  # noqa: E501

VLLM_CONTINUOUS_USAGE = """
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":4,"total_tokens":4,"completion_tokens":0,"completion_tokens_details":null},"prompt_token_ids":null,"prompt_text":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1,"completion_tokens_details":null},"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"usage":{"prompt_tokens":4,"total_tokens":6,"completion_tokens":2,"completion_tokens_details":null},"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"completion_tokens_details":null},"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3},"system_fingerprint":"vllm-0.33.0-3e8a1c2d"}
"""  # noqa: E501

VLLM_TOKEN_IDS_LOGPROBS = """
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[151644,872,198,9707],"prompt_text":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":{"content":[{"token":"Hello","logprob":-0.01,"bytes":[72,101,108,108,111],"top_logprobs":[{"token":"Hello","logprob":-0.01,"bytes":[72,101,108,108,111]}]}]},"finish_reason":null,"token_ids":[9707]}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":{"content":[{"token":" world","logprob":-0.3,"bytes":[32,119,111,114,108,100],"top_logprobs":[{"token":" world","logprob":-0.3,"bytes":[32,119,111,114,108,100]}]}]},"finish_reason":null,"token_ids":[1879]}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":{"content":[{"token":"!","logprob":-0.5,"bytes":[33],"top_logprobs":[{"token":"!","logprob":-0.5,"bytes":[33]}]}]},"finish_reason":"stop","stop_reason":null,"token_ids":[0],"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-3e8a1c2d","kv_transfer_params":null}
data: [DONE]
"""  # noqa: E501

VLLM_TOOL_CALLS = """
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"reasoning":"Let me think"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":null,"tool_calls":[{"id":"chatcmpl-tool-9f1c2","type":"function","index":0,"function":{"name":"get_weather"}},{"index":0,"function":{"arguments":"{\\"city\\": \\""}}]},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"Paris\\"}"}}]},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"fp_3e8a1c2d","kv_transfer_params":null}
"""  # noqa: E501

# vLLM 0.33's own non-streaming body for the same answer (captures/chunks.txt).
VLLM_TOOL_CALLS_NON_STREAMING = {
    "role": "assistant",
    "content": None,
    "refusal": None,
    "tool_calls": [
        {
            "id": "chatcmpl-tool-9f1c2",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
    "reasoning": "Let me think",
}


def test_vllm_plain_stream_concatenates_content_and_keeps_metadata() -> None:
    body = assemble(VLLM_PLAIN)

    assert body["id"] == "chatcmpl-abc123"
    assert body["object"] == "chat.completion"
    assert body["created"] == 1796017983
    assert body["model"] == "qwen3-8b"
    assert body["system_fingerprint"] == "vllm-0.33.0-3e8a1c2d"
    assert body["prompt_text"] is None
    assert body["kv_transfer_params"] is None
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": "Hello world!", "refusal": None}
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None


def test_vllm_keys_the_router_did_not_expose_stay_null_like_vllm_answers() -> None:
    body = assemble(VLLM_PLAIN)

    assert "prompt_token_ids" in body
    assert body["prompt_token_ids"] is None
    assert "token_ids" in body["choices"][0]
    assert body["choices"][0]["token_ids"] is None


def test_include_usage_takes_the_engine_usage_and_the_late_fingerprint() -> None:
    body = assemble(VLLM_INCLUDE_USAGE)

    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    assert body["system_fingerprint"] == "vllm-0.33.0-3e8a1c2d"
    # finish_reason and stop_reason survive the usage-only frame that followed them.
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] is None
    assert body["choices"][0]["message"]["content"] == "Hello world!"


def test_continuous_usage_the_last_non_null_usage_wins() -> None:
    body = assemble(VLLM_CONTINUOUS_USAGE)

    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}


def test_return_token_ids_and_logprobs_exposed_to_a_client_that_asked() -> None:
    chunks = parse(VLLM_TOKEN_IDS_LOGPROBS)
    assembler = Assembler("chat", expose_token_ids=True, prompt_tokens_estimate=99)
    for chunk in chunks:
        assembler.feed(chunk)
    body = assembler.result()

    assert assembler.output_tokens == 3
    assert assembler.token_ids_seen
    assert body["prompt_token_ids"] == [151644, 872, 198, 9707]
    [choice] = body["choices"]
    assert choice["token_ids"] == [9707, 1879, 0]
    assert choice["message"]["content"] == "Hello world!"
    assert [entry["token"] for entry in choice["logprobs"]["content"]] == ["Hello", " world", "!"]
    assert choice["logprobs"]["content"][1] == chunks[2]["choices"][0]["logprobs"]["content"][0]
    assert choice["logprobs"]["refusal"] is None
    # No engine usage: prompt from the prompt IDs, output from the IDs.
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_token_ids_the_router_asked_for_itself_are_hidden_but_still_counted() -> None:
    assembler = Assembler("chat", expose_token_ids=False, prompt_tokens_estimate=99)
    for chunk in parse(VLLM_TOKEN_IDS_LOGPROBS):
        assembler.feed(chunk)
    body = assembler.result()

    assert assembler.output_tokens == 3
    assert body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_vllm_tool_call_with_two_fragments_in_one_delta_matches_vllms_own_body() -> None:
    body = assemble(VLLM_TOOL_CALLS)

    [choice] = body["choices"]
    assert choice["message"] == VLLM_TOOL_CALLS_NON_STREAMING
    assert choice["finish_reason"] == "tool_calls"
    assert body["system_fingerprint"] == "fp_3e8a1c2d"


def test_vllm_reasoning_delta_concatenates_under_reasoning() -> None:
    body = assemble(
        [
            delta_chunk(role="assistant", content=""),
            delta_chunk(reasoning="Let me"),
            delta_chunk(reasoning=" think"),
            delta_chunk(content="42"),
        ]
    )

    message = body["choices"][0]["message"]
    assert message["reasoning"] == "Let me think"
    assert "reasoning_content" not in message
    assert message["content"] == "42"


def test_reasoning_content_is_assembled_under_its_own_key_beside_reasoning() -> None:
    # vLLM 0.11.1-0.15 mirrors reasoning into reasoning_content and sends an explicit null
    # beside content deltas.
    body = assemble(
        [
            delta_chunk(reasoning="think", reasoning_content="think"),
            delta_chunk(reasoning=" hard", reasoning_content=" hard"),
            delta_chunk(content="hi", reasoning_content=None),
        ]
    )

    message = body["choices"][0]["message"]
    assert message["reasoning"] == "think hard"
    assert message["reasoning_content"] == "think hard"
    assert message["content"] == "hi"


def test_vllm_stop_string_is_kept_as_stop_reason() -> None:
    stop = """
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"The answer"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"."},"logprobs":null,"finish_reason":"stop","stop_reason":"</answer>","token_ids":null,"weight_versions":null}],"kv_transfer_params":null}
data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5},"system_fingerprint":"fp_3e8a1c2d"}
"""  # noqa: E501
    body = assemble(stop)

    [choice] = body["choices"]
    assert choice["message"]["content"] == "The answer."
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "</answer>"
    assert body["usage"]["completion_tokens"] == 5


def test_finish_and_stop_reason_survive_later_frames_of_any_kind() -> None:
    body = assemble(
        [
            chat_chunk({"delta": {"content": "x"}, "finish_reason": "stop", "stop_reason": 7}),
            # A late carrier chunk for the same choice must not erase what the finish set.
            chat_chunk({"delta": {}, "finish_reason": None, "stop_reason": None}),
            {"id": "chatcmpl-abc123", "choices": [], "usage": {"prompt_tokens": 1}},
        ]
    )

    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == 7
    assert body["usage"] == {"prompt_tokens": 1}


def test_vllm_id_only_carrier_chunks_are_counted_ids_not_chunks() -> None:
    assembler = Assembler("chat", expose_token_ids=True, prompt_tokens_estimate=10)
    assembler.feed(
        chat_chunk({"delta": {"role": "assistant", "content": ""}}, prompt_token_ids=[1])
    )
    # Parser-suppressed tokens (a tool-call tag) arrive on an empty delta.
    assembler.feed(chat_chunk({"delta": {}, "token_ids": [151657, 198]}))
    # stream_interval > 1 or speculative decoding: several tokens in one chunk.
    assembler.feed(chat_chunk({"delta": {"content": "Hello world"}, "token_ids": [9707, 1879]}))
    assembler.feed(chat_chunk({"delta": {}, "finish_reason": "stop", "token_ids": [151658]}))
    body = assembler.result()

    assert assembler.output_tokens == 5
    assert body["choices"][0]["token_ids"] == [151657, 198, 9707, 1879, 151658]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}


def test_usage_computed_from_the_estimate_without_prompt_ids() -> None:
    body = assemble(
        [
            chat_chunk({"delta": {"content": "ab"}, "token_ids": [1, 2]}),
            chat_chunk({"delta": {"content": "c"}, "token_ids": [3], "finish_reason": "length"}),
        ],
        estimate=17,
    )

    assert body["usage"] == {"prompt_tokens": 17, "completion_tokens": 3, "total_tokens": 20}


def test_usage_without_any_ids_falls_back_to_counting_output_events() -> None:
    # No usage, no IDs (an engine without token accounting): the role chunk with content ""
    # is not an output event; the three content chunks are.
    body = assemble(VLLM_PLAIN, estimate=5)

    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_empty_id_lists_count_zero_and_are_not_a_fallback() -> None:
    assembler = Assembler("chat", expose_token_ids=True, prompt_tokens_estimate=2)
    assembler.feed(chat_chunk({"delta": {"content": "x"}, "token_ids": []}))
    body = assembler.result()

    assert assembler.output_tokens == 0
    assert body["choices"][0]["token_ids"] == []
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


def test_n2_interleaved_choices_are_assembled_by_index() -> None:
    body = assemble(
        [
            chat_chunk({"index": 1, "delta": {"role": "assistant", "content": ""}}),
            chat_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}),
            chat_chunk({"index": 1, "delta": {"content": "B"}}),
            chat_chunk({"index": 0, "delta": {"content": "A"}, "finish_reason": "stop"}),
            chat_chunk({"index": 1, "delta": {"content": "b"}, "finish_reason": "length"}),
        ]
    )

    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["A", "Bb"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]


def test_metadata_last_non_null_wins_and_nulls_never_erase() -> None:
    body = assemble(
        [
            chat_chunk(
                {"delta": {"content": "a"}}, service_tier="default", kv_transfer_params=None
            ),
            chat_chunk({"delta": {"content": "b"}}, service_tier=None, system_fingerprint="fp_1"),
            {"id": "chatcmpl-abc123", "choices": [], "metrics": {"ttft_s": 0.1}, "usage": None},
        ]
    )

    assert body["service_tier"] == "default"
    assert body["system_fingerprint"] == "fp_1"
    assert body["kv_transfer_params"] is None
    assert body["metrics"] == {"ttft_s": 0.1}
    assert body["object"] == "chat.completion"


def test_content_and_refusal_are_null_when_nothing_but_empty_strings_arrived() -> None:
    body = assemble([delta_chunk(role="assistant", content=""), delta_chunk(content=None)])

    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "refusal": None}
    assert "tool_calls" not in message
    assert "function_call" not in message


def test_refusal_and_its_logprobs_concatenate() -> None:
    def refusal(text: str) -> dict[str, Any]:
        entry = {"token": text, "logprob": -0.1, "bytes": None, "top_logprobs": []}
        return chat_chunk({"delta": {"refusal": text}, "logprobs": {"refusal": [entry]}})

    body = assemble([refusal("I can't"), refusal(" help with that.")])

    [choice] = body["choices"]
    assert choice["message"]["refusal"] == "I can't help with that."
    assert choice["message"]["content"] is None
    assert choice["logprobs"]["content"] is None
    assert [e["token"] for e in choice["logprobs"]["refusal"]] == ["I can't", " help with that."]


def test_chat_logprobs_concatenate_in_stream_order_with_several_tokens_a_chunk() -> None:
    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -1.0, "bytes": None, "top_logprobs": []}

    body = assemble(
        [
            chat_chunk(
                {"delta": {"content": "ab"}, "logprobs": {"content": [entry("a"), entry("b")]}}
            ),
            chat_chunk({"delta": {"content": "c"}, "logprobs": None}),
            chat_chunk(
                {"delta": {"content": "d"}, "logprobs": {"content": [entry("d")], "refusal": None}}
            ),
        ]
    )

    tokens = [e["token"] for e in body["choices"][0]["logprobs"]["content"]]
    assert tokens == ["a", "b", "d"]


# -- SGLang 0.5.23 chat ---------------------------------------------------------------------------

SGLANG_TOOL_CALLS = """
data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"","reasoning_content":null},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}
data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":"think"},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}
data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null,"tool_calls":[{"id":"call_0","index":0,"type":"function","function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}
data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null,"tool_calls":[{"id":null,"index":0,"type":"function","function":{"name":null,"arguments":"{\\"city\\": \\"Paris\\"}"}}]},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}
data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null},"logprobs":null,"finish_reason":"stop","matched_stop":151645}],"usage":null}
data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"prompt_tokens_details":null,"reasoning_tokens":0,"completion_tokens_details":null}}
data: [DONE]
"""  # noqa: E501


def test_sglang_tool_call_with_repeated_type_and_null_id_and_name() -> None:
    body = assemble(SGLANG_TOOL_CALLS)

    [choice] = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "reasoning_content": "think",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    # SGLang's matched_stop comes from the finish chunk and survives the usage chunk.
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == 151645
    assert "stop_reason" not in choice
    assert "token_ids" not in choice
    assert "prompt_token_ids" not in body
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["reasoning_tokens"] == 0


def test_sglang_ids_chunk_is_metadata() -> None:
    chunks = parse(SGLANG_TOOL_CALLS)
    sglext = {"input_ids": [1, 2, 3], "output_ids": [[9707, 1879, 0]]}
    chunks.insert(-1, {"id": "abc", "choices": [], "usage": None, "sglext": sglext})

    body = assemble(chunks)

    assert body["sglext"] == sglext
    assert body["usage"]["total_tokens"] == 7


# -- tool calls ----------------------------------------------------------------------------------


def tool_delta(*fragments: dict[str, Any]) -> dict[str, Any]:
    return delta_chunk(tool_calls=list(fragments))


def test_tool_calls_grouped_by_index_returned_in_index_order() -> None:
    body = assemble(
        [
            tool_delta({"index": 1, "id": "call_b", "type": "function", "function": {"name": "b"}}),
            tool_delta({"index": 0, "id": "call_a", "type": "function", "function": {"name": "a"}}),
            tool_delta({"index": 1, "function": {"arguments": '{"y"'}}),
            tool_delta(
                {"index": 0, "function": {"arguments": "{}"}},
                {"index": 1, "function": {"arguments": ": 2}"}},
            ),
        ]
    )

    calls = body["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_a", "a", "{}"),
        ("call_b", "b", '{"y": 2}'),
    ]


def test_tool_call_id_name_and_arguments_concatenate_independently() -> None:
    body = assemble(
        [
            tool_delta({"index": 0, "id": "functions.get_", "function": {"name": "get_"}}),
            tool_delta({"index": 0, "id": "weather:0", "function": {"name": "weather"}}),
            tool_delta({"index": 0, "type": "function", "function": {"arguments": "not json"}}),
        ]
    )

    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call == {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "not json"},
    }


def test_tool_call_arguments_default_to_an_empty_string() -> None:
    body = assemble([tool_delta({"index": 0, "id": "c", "function": {"name": "now"}})])

    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == ""


def test_legacy_function_call_fragments_concatenate_into_one_field() -> None:
    body = assemble(
        [
            delta_chunk(role="assistant", content=None, function_call={"name": "get_"}),
            delta_chunk(function_call={"name": "weather", "arguments": '{"city":'}),
            delta_chunk(function_call={"arguments": ' "Paris"}'}),
            chat_chunk({"delta": {}, "finish_reason": "function_call"}),
        ]
    )

    [choice] = body["choices"]
    assert choice["message"]["function_call"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "function_call"


# -- completions ---------------------------------------------------------------------------------

COMPLETIONS_IDS_LOGPROBS_USAGE = """
data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" Paris","logprobs":{"text_offset":[0],"token_logprobs":[-0.05],"tokens":[" Paris"],"top_logprobs":[{" Paris":-0.05,"X":-5.0}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":[151644,872,198,9707],"token_ids":[12366],"weight_versions":null}],"kv_transfer_params":null}
data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":",","logprobs":{"text_offset":[6],"token_logprobs":[-0.7],"tokens":[","],"top_logprobs":[{",":-0.7,"X":-5.0}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[11],"weight_versions":null}],"kv_transfer_params":null}
data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" obviously","logprobs":{"text_offset":[7],"token_logprobs":[-1.1],"tokens":[" obviously"],"top_logprobs":[{" obviously":-1.1,"X":-5.0}]},"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":[13],"weight_versions":null}],"kv_transfer_params":null}
data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3},"system_fingerprint":"vllm-0.33.0-3e8a1c2d"}
data: [DONE]
"""  # noqa: E501


def test_completions_text_logprobs_and_offsets_concatenate_in_stream_order() -> None:
    body = assemble(COMPLETIONS_IDS_LOGPROBS_USAGE, "completions", expose=True)

    assert body["object"] == "text_completion"
    assert body["system_fingerprint"] == "vllm-0.33.0-3e8a1c2d"
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    [choice] = body["choices"]
    assert choice["text"] == " Paris, obviously"
    assert choice["logprobs"] == {
        "tokens": [" Paris", ",", " obviously"],
        "token_logprobs": [-0.05, -0.7, -1.1],
        "top_logprobs": [
            {" Paris": -0.05, "X": -5.0},
            {",": -0.7, "X": -5.0},
            {" obviously": -1.1, "X": -5.0},
        ],
        "text_offset": [0, 6, 7],
    }
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    # Completions carry prompt IDs at choice level, like vLLM's own non-streaming body.
    assert choice["prompt_token_ids"] == [151644, 872, 198, 9707]
    assert choice["token_ids"] == [12366, 11, 13]
    assert "prompt_token_ids" not in body


def test_completions_ids_hidden_when_the_client_did_not_ask() -> None:
    body = assemble(COMPLETIONS_IDS_LOGPROBS_USAGE, "completions", expose=False)

    [choice] = body["choices"]
    assert choice["prompt_token_ids"] is None
    assert choice["token_ids"] is None


def test_completions_usage_computed_from_choice_level_prompt_ids() -> None:
    chunks = parse(COMPLETIONS_IDS_LOGPROBS_USAGE)[:-1]

    body = assemble(chunks, "completions", estimate=50)

    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_completions_stop_string_survives_the_usage_only_frame() -> None:
    stream = """
data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}
data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":".","logprobs":null,"finish_reason":"stop","stop_reason":"\\n","prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}
data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3},"system_fingerprint":"fp_3e8a1c2d"}
"""  # noqa: E501
    body = assemble(stream, "completions")

    [choice] = body["choices"]
    assert choice["text"] == " Paris."
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "\n"
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3}


def test_sglang_completions_matched_stop_and_omitted_null_ids() -> None:
    first = (
        '{"id":"abc","object":"text_completion","created":1767225600,"model":"m","choices":'
        '[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"matched_stop":null,'
        '"token_ids":[12366],"prompt_token_ids":[1,2,3]}],"usage":null}'
    )
    last = {
        "id": "abc",
        "choices": [{"index": 0, "text": ".", "finish_reason": "stop", "matched_stop": "."}],
        "usage": None,
    }
    body = assemble([json.loads(first), last], "completions", expose=True)

    [choice] = body["choices"]
    assert choice["text"] == " Paris."
    assert choice["matched_stop"] == "."
    assert choice["token_ids"] == [12366]
    assert choice["prompt_token_ids"] == [1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


# -- what assembly does not touch ----------------------------------------------------------------


def test_explicit_nulls_of_unknown_fields_are_fine() -> None:
    body = assemble(
        [
            chat_chunk(
                {
                    "delta": {"content": "x", "audio": None, "annotations": None},
                    "weight_versions": None,
                    "routed_experts": None,
                    "hidden_states": None,
                }
            )
        ]
    )

    assert body["choices"][0]["message"]["content"] == "x"
    assert "weight_versions" not in body["choices"][0]


def test_feeding_never_mutates_the_chunks_and_result_is_repeatable() -> None:
    chunks = parse(VLLM_TOKEN_IDS_LOGPROBS) + parse(VLLM_TOOL_CALLS)
    pristine = copy.deepcopy(chunks)
    assembler = Assembler("chat", expose_token_ids=True, prompt_tokens_estimate=1)
    for chunk in chunks:
        assembler.feed(chunk)

    first = assembler.result()
    assert assembler.result() == first
    assert chunks == pristine


def test_result_before_any_chunk_is_a_well_formed_empty_body() -> None:
    body = Assembler("completions", expose_token_ids=False, prompt_tokens_estimate=3).result()

    assert body == {
        "object": "text_completion",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
    }


# -- 502: unsupported and malformed ---------------------------------------------------------------

UNSUPPORTED = "unsupported_engine_field"
MALFORMED = "malformed_engine_response"


def completion_chunk(**choice: Any) -> dict[str, Any]:
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": "x", **choice}]}


FEED_ERRORS: list[tuple[str, Route, dict[str, Any], str, str]] = [
    # unsupported: fields with a value that assembly does not understand
    (
        "delta audio",
        "chat",
        delta_chunk(audio={"id": "audio_1", "data": "UklGR"}),
        UNSUPPORTED,
        "choices[0].delta.audio",
    ),
    (
        "delta annotations",
        "chat",
        delta_chunk(content="x", annotations=[{"type": "url_citation"}]),
        UNSUPPORTED,
        "choices[0].delta.annotations",
    ),
    (
        "custom tool call",
        "chat",
        tool_delta({"index": 0, "id": "c", "type": "custom", "custom": {"name": "x", "input": ""}}),
        UNSUPPORTED,
        "choices[0].delta.tool_calls[0].type",
    ),
    (
        "custom tool output without a type",
        "chat",
        tool_delta({"index": 0, "custom": {"input": "x"}}),
        UNSUPPORTED,
        "choices[0].delta.tool_calls[0].custom",
    ),
    (
        "unknown function field",
        "chat",
        tool_delta({"index": 0, "function": {"name": "f", "strict": True}}),
        UNSUPPORTED,
        "choices[0].delta.tool_calls[0].function.strict",
    ),
    (
        "unknown choice field",
        "chat",
        chat_chunk({"delta": {}, "hidden_states": [[0.1]]}),
        UNSUPPORTED,
        "choices[0].hidden_states",
    ),
    (
        "unknown field named by the choice index",
        "chat",
        chat_chunk({"index": 1, "delta": {"audio": {"data": ""}}}),
        UNSUPPORTED,
        "choices[1].delta.audio",
    ),
    ("text in a chat choice", "chat", chat_chunk({"text": "x"}), UNSUPPORTED, "choices[0].text"),
    (
        "unknown chat logprobs array",
        "chat",
        chat_chunk({"delta": {}, "logprobs": {"content": [], "audio": []}}),
        UNSUPPORTED,
        "choices[0].logprobs.audio",
    ),
    (
        "delta in a completion choice",
        "completions",
        completion_chunk(delta={"content": "x"}),
        UNSUPPORTED,
        "choices[0].delta",
    ),
    (
        "chat logprobs in a completion",
        "completions",
        completion_chunk(logprobs={"content": []}),
        UNSUPPORTED,
        "choices[0].logprobs.content",
    ),
    # malformed: supported fields of the wrong shape
    ("chunk not an object", "chat", [], MALFORMED, ""),  # type: ignore[list-item]
    ("choices missing", "chat", {"id": "x"}, MALFORMED, "choices"),
    ("choices not a list", "chat", {"id": "x", "choices": {"0": {}}}, MALFORMED, "choices"),
    ("choice not an object", "chat", {"choices": ["x"]}, MALFORMED, "choices[0]"),
    ("choice index not an int", "chat", chat_chunk({"index": "0"}), MALFORMED, "choices[0].index"),
    ("choice index negative", "chat", chat_chunk({"index": -1}), MALFORMED, "choices[0].index"),
    (
        "usage not an object",
        "chat",
        {"choices": [], "usage": [1, 2, 3]},
        MALFORMED,
        "usage",
    ),
    (
        "prompt_token_ids not a list",
        "chat",
        chat_chunk({"delta": {}}, prompt_token_ids="1 2 3"),
        MALFORMED,
        "prompt_token_ids",
    ),
    ("delta not an object", "chat", chat_chunk({"delta": "x"}), MALFORMED, "choices[0].delta"),
    (
        "content not a string",
        "chat",
        delta_chunk(content=["Hello"]),
        MALFORMED,
        "choices[0].delta.content",
    ),
    (
        "reasoning not a string",
        "chat",
        delta_chunk(reasoning=1),
        MALFORMED,
        "choices[0].delta.reasoning",
    ),
    (
        "reasoning_content not a string",
        "chat",
        delta_chunk(reasoning_content={"text": "x"}),
        MALFORMED,
        "choices[0].delta.reasoning_content",
    ),
    (
        "refusal not a string",
        "chat",
        delta_chunk(refusal=True),
        MALFORMED,
        "choices[0].delta.refusal",
    ),
    ("role not a string", "chat", delta_chunk(role=1), MALFORMED, "choices[0].delta.role"),
    (
        "tool_calls not a list",
        "chat",
        delta_chunk(tool_calls={"index": 0}),
        MALFORMED,
        "choices[0].delta.tool_calls",
    ),
    (
        "tool call fragment not an object",
        "chat",
        tool_delta("call"),  # type: ignore[arg-type]
        MALFORMED,
        "choices[0].delta.tool_calls[0]",
    ),
    (
        "tool call fragment without an index",
        "chat",
        tool_delta({"id": "c", "function": {"name": "f"}}),
        MALFORMED,
        "choices[0].delta.tool_calls[0].index",
    ),
    (
        "tool call fragment with a Boolean index",
        "chat",
        tool_delta({"index": 0, "id": "c"}, {"index": True}),
        MALFORMED,
        "choices[0].delta.tool_calls[1].index",
    ),
    (
        "tool call id not a string",
        "chat",
        tool_delta({"index": 0, "id": 7}),
        MALFORMED,
        "choices[0].delta.tool_calls[0].id",
    ),
    (
        "tool call type not a string",
        "chat",
        tool_delta({"index": 0, "type": ["function"]}),
        MALFORMED,
        "choices[0].delta.tool_calls[0].type",
    ),
    (
        "tool call function not an object",
        "chat",
        tool_delta({"index": 0, "function": "f"}),
        MALFORMED,
        "choices[0].delta.tool_calls[0].function",
    ),
    (
        "tool call name not a string",
        "chat",
        tool_delta({"index": 0, "function": {"name": 1}}),
        MALFORMED,
        "choices[0].delta.tool_calls[0].function.name",
    ),
    (
        "tool call arguments already parsed",
        "chat",
        tool_delta({"index": 0, "function": {"arguments": {"city": "Paris"}}}),
        MALFORMED,
        "choices[0].delta.tool_calls[0].function.arguments",
    ),
    (
        "function_call not an object",
        "chat",
        delta_chunk(function_call="f"),
        MALFORMED,
        "choices[0].delta.function_call",
    ),
    (
        "function_call arguments not a string",
        "chat",
        delta_chunk(function_call={"arguments": 1}),
        MALFORMED,
        "choices[0].delta.function_call.arguments",
    ),
    (
        "logprobs not an object",
        "chat",
        chat_chunk({"delta": {}, "logprobs": [1]}),
        MALFORMED,
        "choices[0].logprobs",
    ),
    (
        "logprobs.content not a list",
        "chat",
        chat_chunk({"delta": {}, "logprobs": {"content": {"token": "x"}}}),
        MALFORMED,
        "choices[0].logprobs.content",
    ),
    (
        "logprobs.refusal not a list",
        "chat",
        chat_chunk({"delta": {}, "logprobs": {"refusal": "x"}}),
        MALFORMED,
        "choices[0].logprobs.refusal",
    ),
    (
        "finish_reason not a string",
        "chat",
        chat_chunk({"delta": {}, "finish_reason": 1}),
        MALFORMED,
        "choices[0].finish_reason",
    ),
    (
        "stop_reason neither string nor int",
        "chat",
        chat_chunk({"delta": {}, "finish_reason": "stop", "stop_reason": ["</a>"]}),
        MALFORMED,
        "choices[0].stop_reason",
    ),
    (
        "matched_stop a Boolean",
        "chat",
        chat_chunk({"delta": {}, "finish_reason": "stop", "matched_stop": True}),
        MALFORMED,
        "choices[0].matched_stop",
    ),
    (
        "token_ids not a list",
        "chat",
        chat_chunk({"delta": {"content": "x"}, "token_ids": 9707}),
        MALFORMED,
        "choices[0].token_ids",
    ),
    (
        "choice prompt_token_ids not a list",
        "completions",
        completion_chunk(prompt_token_ids={"ids": [1]}),
        MALFORMED,
        "choices[0].prompt_token_ids",
    ),
    ("text not a string", "completions", completion_chunk(text=5), MALFORMED, "choices[0].text"),
    (
        "text_offset not a list",
        "completions",
        completion_chunk(logprobs={"tokens": ["x"], "text_offset": 0}),
        MALFORMED,
        "choices[0].logprobs.text_offset",
    ),
]


@pytest.mark.parametrize(
    ("route", "chunk", "code", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in FEED_ERRORS],
)
def test_feed_refuses_with_502(route: Route, chunk: dict[str, Any], code: str, param: str) -> None:
    assembler = Assembler(route, expose_token_ids=False, prompt_tokens_estimate=1)

    with pytest.raises(EngineResponseError) as caught:
        assembler.feed(chunk)

    error = caught.value
    assert error.http_status == 502
    assert (error.code, error.param) == (code, param)
    assert error.headers == {"x-should-retry": "false"}
    assert error.envelope()["error"]["type"] == "upstream_error"


RESULT_ERRORS: list[tuple[str, list[dict[str, Any]], str]] = [
    (
        "tool call whose id never arrived",
        [tool_delta({"id": None, "index": 0, "type": "function", "function": {"name": "f"}})],
        "choices[0].message.tool_calls[0].id",
    ),
    (
        "tool call with an empty id",
        [tool_delta({"id": "", "index": 0, "function": {"name": "f", "arguments": "{}"}})],
        "choices[0].message.tool_calls[0].id",
    ),
    (
        "second tool call without a name",
        [
            tool_delta({"index": 0, "id": "a", "function": {"name": "f"}}),
            tool_delta({"index": 1, "id": "b", "function": {"arguments": "{}"}}),
        ],
        "choices[0].message.tool_calls[1].function.name",
    ),
    (
        "second tool call, by position, without an id",
        [
            tool_delta({"index": 4, "function": {"name": "g"}}),
            tool_delta({"index": 2, "id": "a", "function": {"name": "f"}}),
        ],
        "choices[0].message.tool_calls[1].id",
    ),
    (
        "legacy function_call without a name",
        [delta_chunk(function_call={"arguments": "{}"})],
        "choices[0].message.function_call.name",
    ),
]


@pytest.mark.parametrize(
    ("chunks", "param"), [pytest.param(*case[1:], id=case[0]) for case in RESULT_ERRORS]
)
def test_result_refuses_incomplete_calls_with_502(chunks: list[dict[str, Any]], param: str) -> None:
    assembler = Assembler("chat", expose_token_ids=False, prompt_tokens_estimate=1)
    for chunk in chunks:
        assembler.feed(chunk)

    with pytest.raises(EngineResponseError) as caught:
        assembler.result()

    assert (caught.value.code, caught.value.param) == (MALFORMED, param)
