"""Request parsing and validation: every refusal row, the order, and the sizing fields."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.errors import (
    InvalidRequest,
    InvalidSamplingWidth,
    ModelNotFound,
    UnsupportedOption,
)
from narwhal.protocol.requests import CompletionRequest, Route, parse_request

MODEL = "narwhal/test-model"
DROP = object()  # an override that removes the field


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    return _apply(body, fields)


def completions(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time"}
    return _apply(body, fields)


def _apply(body: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    for key, value in fields.items():
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def parse(body: object, route: Route = "chat") -> CompletionRequest:
    return parse_request(orjson.dumps(body), route, MODEL)


def refusal(body: object, route: Route = "chat") -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(body, route)
    return info.value


def assert_invalid(error: InvalidRequest, param: str | None) -> None:
    assert type(error) is InvalidRequest
    assert error.http_status == 400
    assert error.code == "invalid_request"
    assert error.param == param
    assert error.envelope()["error"]["type"] == "invalid_request_error"


# -- accepted requests --------------------------------------------------------------------------


def test_minimal_chat_request() -> None:
    body = chat()
    request = parse(body)
    assert request == CompletionRequest(
        route="chat",
        body=body,
        stream=False,
        include_usage=False,
        continuous_usage=False,
        wants_token_ids=False,
        max_output_tokens=None,
        prompt_chars=5,
        prompt_token_count=None,
        prompt_count=1,
    )


def test_minimal_completions_request() -> None:
    request = parse(completions(), "completions")
    assert request.route == "completions"
    assert request.prompt_chars == len("Once upon a time")
    assert request.prompt_token_count is None
    assert request.prompt_count == 1


def test_unknown_fields_pass_through_untouched() -> None:
    extras = {
        "temperature": "not even a number",
        "logprobs": {"odd": [1, 2]},
        "vendor_extension": None,
        "messages_extra": [1, "two", {"three": 3.0}],
    }
    raw = orjson.dumps(chat(**extras))
    request = parse_request(raw, "chat", MODEL)
    assert request.body == orjson.loads(raw)
    for key, value in extras.items():
        assert request.body[key] == value


def test_route_specific_fields_are_not_interpreted_on_the_other_route() -> None:
    # `prompt` means nothing to chat, `messages` nothing to completions.
    assert parse(chat(prompt=42)).body["prompt"] == 42
    assert parse(completions(messages="nope"), "completions").body["messages"] == "nope"


def test_nulls_read_as_unset() -> None:
    request = parse(
        chat(
            stream=None,
            stream_options=None,
            n=None,
            best_of=None,
            max_tokens=None,
            max_completion_tokens=None,
            return_token_ids=None,
            modalities=None,
            tools=None,
            audio=None,
        )
    )
    assert not request.stream
    assert not request.include_usage
    assert not request.wants_token_ids
    assert request.max_output_tokens is None


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_sampling_width_one_is_accepted(route: Route) -> None:
    make = chat if route == "chat" else completions
    parse(make(n=1, best_of=1), route)


def test_chat_message_shapes_accepted() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "assistant"},
        {"role": "tool", "content": [], "tool_call_id": "x"},
        {"role": "anything-goes"},
    ]
    assert parse(chat(messages=messages)).prompt_chars == len("Be brief.") + len("Look")


@pytest.mark.parametrize(
    "prompt",
    ["x", ["a", "b"], [1, 2, 3], [[1], [2, 3]], [0]],
)
def test_completions_prompt_shapes_accepted(prompt: Any) -> None:
    parse(completions(prompt=prompt), "completions")


# -- 400: invalid JSON and body shape -----------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"{'model': 'x'}",
        b'{"model": "x",}',
        b"NaN",
        b'{"model": "\xff"}',  # invalid UTF-8
        b'{"model": "\xed\xa0\x80"}',  # an encoded surrogate
        b"[" * 2000 + b"]" * 2000,  # deeper than the parser allows
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_unparseable_body_is_400_with_null_param(raw: bytes, route: Route) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw, route, MODEL)
    assert_invalid(info.value, None)
    assert "not valid JSON" in info.value.message


@pytest.mark.parametrize("body", [[], [chat()], "chat", 3, None, True])
def test_body_that_is_not_an_object_is_400_with_null_param(body: object) -> None:
    error = refusal(body)
    assert_invalid(error, None)
    assert "must be a JSON object" in error.message


# -- 400: router-interpreted field types, each with its param path ------------------------------

CHAT_TYPE_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"messages": DROP}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": {"role": "user"}}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}, "b"]}, "messages[1]"),
    ({"messages": [None]}, "messages[0]"),
    ({"messages": [{"content": "a"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}, {"role": None}]}, "messages[1].role"),
    ({"messages": [{"role": "user"}, {"role": 7}]}, "messages[1].role"),
    (
        {"messages": [{"role": "system"}, {"role": "user"}, {"role": "user", "content": 5}]},
        "messages[2].content",
    ),
    ({"messages": [{"role": "user", "content": True}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": {"type": "text"}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}
            ]
        },
        "messages[0].content[1].text",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": 1}]}
            ]
        },
        "messages[0].content[1].text",
    ),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_completion_tokens": "10"}, "max_completion_tokens"),
]

COMPLETIONS_TYPE_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"prompt": DROP}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"prompt": [None]}, "prompt[0]"),
    ({"prompt": [1.5]}, "prompt[0]"),
    ({"prompt": [True, 1]}, "prompt[0]"),
    ({"prompt": ["a", 1]}, "prompt[1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [1, 2, "a"]}, "prompt[2]"),
    ({"prompt": [1, True]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, 2.0]}, "prompt[1]"),
    ({"prompt": [[1], 2]}, "prompt[1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": [[1], [2, False]]}, "prompt[1][1]"),
    ({"prompt": [[1], [2, "x"]]}, "prompt[1][1]"),
]

# Fields both routes interpret.
SHARED_TYPE_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"stream": "true"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream": 0}, "stream"),
    ({"stream_options": True}, "stream_options"),
    ({"stream_options": [], "stream": True}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (
        {"stream": True, "stream_options": {"continuous_usage_stats": 0}},
        "stream_options.continuous_usage_stats",
    ),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    ({"stream": None, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"n": True}, "n"),
    ({"n": False}, "n"),
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"n": 1.0}, "n"),
    ({"n": "1"}, "n"),
    ({"best_of": True}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 2.5}, "best_of"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 16.0}, "max_tokens"),
    ({"max_tokens": [16]}, "max_tokens"),
    ({"return_token_ids": "yes"}, "return_token_ids"),
    ({"return_token_ids": 1}, "return_token_ids"),
    ({"modalities": "text"}, "modalities"),
    ({"modalities": {"text": True}}, "modalities"),
    ({"modalities": ["text", None]}, "modalities[1]"),
    ({"modalities": [1]}, "modalities[0]"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": "function"}, "tools"),
    ({"tools": [{"type": "function"}, "x"]}, "tools[1]"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}, {"type": None}]}, "tools[1].type"),
    ({"model": DROP}, "model"),
    ({"model": None}, "model"),
    ({"model": 3}, "model"),
    ({"model": [MODEL]}, "model"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_TYPE_ERRORS + SHARED_TYPE_ERRORS)
def test_chat_type_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert_invalid(refusal(chat(**fields)), param)


@pytest.mark.parametrize(("fields", "param"), COMPLETIONS_TYPE_ERRORS + SHARED_TYPE_ERRORS)
def test_completions_type_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert_invalid(refusal(completions(**fields), "completions"), param)


def test_messages_are_clear() -> None:
    messages = [{"role": "a"}, {"role": "b"}, {"role": "c", "content": 5}]
    assert refusal(chat(messages=messages)).message == (
        "`messages[2].content` must be a string or an array of content parts, got a number (5)."
    )
    assert refusal(chat(n=True)).message == (
        "`n` must be an integer of at least 1 or null, got a Boolean (true)."
    )
    assert refusal(chat(max_tokens=-3)).message == "`max_tokens` must be at least 1, got -3."
    assert refusal(chat(messages=DROP)).message.startswith("`messages` is required")
    assert refusal(chat(model=DROP)).message.startswith("`model` is required")
    assert "got null" in refusal(chat(model=None)).message
    assert "got an array" in refusal(chat(messages=[[]])).message
    assert "got an object" in refusal(chat(stream={})).message


def test_empty_stream_options_without_stream_is_accepted_as_vllm_does() -> None:
    request = parse(chat(stream_options={}))
    assert not request.stream
    assert not request.include_usage


# -- 404 and the model row ----------------------------------------------------------------------


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("name", ["other-model", "", MODEL.upper(), MODEL + " "])
def test_other_model_is_404(route: Route, name: str) -> None:
    make = chat if route == "chat" else completions
    with pytest.raises(ModelNotFound) as info:
        parse(make(model=name), route)
    error = info.value
    assert error.http_status == 404
    assert error.code == "model_not_found"
    assert error.param == "model"
    assert error.envelope()["error"]["type"] == "invalid_request_error"


# -- 400 invalid_sampling_width -----------------------------------------------------------------


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"n": 128}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 3}, "best_of"),
        ({"n": 2, "best_of": 3}, "n"),
        ({"n": 2, "stream": True}, "n"),
    ],
)
def test_sampling_width_above_one(route: Route, fields: dict[str, Any], param: str) -> None:
    make = chat if route == "chat" else completions
    with pytest.raises(InvalidSamplingWidth) as info:
        parse(make(**fields), route)
    error = info.value
    assert error.http_status == 400
    assert error.code == "invalid_sampling_width"
    assert error.param == param
    assert "Invalid sampling width" in error.message


# -- 400 unsupported_option, only when not streaming --------------------------------------------

UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"audio": {}}, "audio"),
    ({"audio": False}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"modalities": ["image"]}, "modalities"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "web"}]}, "tools"),
    ({"audio": {}, "modalities": ["audio"], "tools": [{"type": "x"}]}, "audio"),
    ({"modalities": ["audio"], "tools": [{"type": "x"}]}, "modalities"),
]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [DROP, None, False])
@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED)
def test_unsupported_option_when_not_streaming(
    route: Route, stream: object, fields: dict[str, Any], param: str
) -> None:
    make = chat if route == "chat" else completions
    with pytest.raises(UnsupportedOption) as info:
        parse(make(stream=stream, **fields), route)
    error = info.value
    assert error.http_status == 400
    assert error.code == "unsupported_option"
    assert error.param == param


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED)
def test_unsupported_options_are_accepted_when_streaming(
    route: Route, fields: dict[str, Any], param: str
) -> None:
    make = chat if route == "chat" else completions
    assert parse(make(stream=True, **fields), route).stream


@pytest.mark.parametrize(
    "fields",
    [
        {"modalities": ["text"]},
        {"modalities": []},
        {"tools": []},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"tools": [{"type": "function"}, {"type": "function"}], "tool_choice": "auto"},
    ],
)
def test_text_modality_and_function_tools_are_supported(fields: dict[str, Any]) -> None:
    assert not parse(chat(**fields)).stream


# -- the order: first failure wins --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error_type", "param"),
    [
        # type errors come before the model
        ({"model": "other", "messages": []}, InvalidRequest, "messages"),
        ({"model": "other", "stream": "yes"}, InvalidRequest, "stream"),
        ({"model": "other", "n": True}, InvalidRequest, "n"),
        ({"model": "other", "tools": [{}]}, InvalidRequest, "tools[0].type"),
        ({"model": DROP, "max_tokens": -1}, InvalidRequest, "max_tokens"),
        # the model comes before sampling width and unsupported options
        ({"model": "other", "n": 2}, ModelNotFound, "model"),
        ({"model": "other", "best_of": 2}, ModelNotFound, "model"),
        ({"model": "other", "audio": {}}, ModelNotFound, "model"),
        ({"model": DROP, "n": 2}, InvalidRequest, "model"),
        ({"model": 5, "audio": {}}, InvalidRequest, "model"),
        # sampling width comes before unsupported options
        ({"n": 2, "audio": {}}, InvalidSamplingWidth, "n"),
        ({"best_of": 2, "tools": [{"type": "custom"}]}, InvalidSamplingWidth, "best_of"),
        # a type error comes before an unsupported option on the same field family
        ({"modalities": ["audio", 3]}, InvalidRequest, "modalities[1]"),
        ({"tools": [{"type": "custom"}, {"type": 1}]}, InvalidRequest, "tools[1].type"),
    ],
)
def test_first_failure_wins(
    fields: dict[str, Any], error_type: type[InvalidRequest], param: str
) -> None:
    error = refusal(chat(**fields))
    assert type(error) is error_type
    assert error.param == param


def test_invalid_json_comes_first() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(b'{"model": "other", "n": 2', "chat", MODEL)
    assert_invalid(info.value, None)


# -- the fields the router reads ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "stream", "include_usage", "continuous"),
    [
        ({}, False, False, False),
        ({"stream": True}, True, False, False),
        ({"stream": True, "stream_options": None}, True, False, False),
        ({"stream": True, "stream_options": {}}, True, False, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True, True, False),
        ({"stream": True, "stream_options": {"include_usage": False}}, True, False, False),
        ({"stream": True, "stream_options": {"include_usage": None}}, True, False, False),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            True,
            False,
            True,
        ),
        (
            {
                "stream": True,
                "stream_options": {
                    "include_usage": True,
                    "continuous_usage_stats": True,
                    "include_obfuscation": "anything",
                },
            },
            True,
            True,
            True,
        ),
        ({"stream": False}, False, False, False),
        ({"stream": False, "stream_options": {}}, False, False, False),
    ],
)
def test_stream_flags(
    fields: dict[str, Any], stream: bool, include_usage: bool, continuous: bool
) -> None:
    request = parse(chat(**fields))
    assert (request.stream, request.include_usage, request.continuous_usage) == (
        stream,
        include_usage,
        continuous,
    )


@pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), (None, False)])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_wants_token_ids(route: Route, value: bool | None, expected: bool) -> None:
    make = chat if route == "chat" else completions
    assert parse(make(return_token_ids=value), route).wants_token_ids is expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"max_tokens": 1}, 1),
        ({"max_tokens": 100}, 100),
        ({"max_completion_tokens": 50}, 50),
        ({"max_tokens": 100, "max_completion_tokens": 50}, 50),
        ({"max_tokens": 100, "max_completion_tokens": None}, 100),
        ({"max_tokens": None, "max_completion_tokens": 7}, 7),
    ],
)
def test_chat_max_output_tokens(fields: dict[str, Any], expected: int | None) -> None:
    assert parse(chat(**fields)).max_output_tokens == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"max_tokens": 100}, 100),
        # the legacy route has no max_completion_tokens: the engine ignores it, and so do we
        ({"max_tokens": 100, "max_completion_tokens": 50}, 100),
        ({"max_completion_tokens": "not interpreted here"}, None),
    ],
)
def test_completions_max_output_tokens(fields: dict[str, Any], expected: int | None) -> None:
    assert parse(completions(**fields), "completions").max_output_tokens == expected


AT_LEAST_1 = "`max_tokens` must be at least 1, got 0."


@pytest.mark.parametrize(
    ("route", "fields", "param", "message"),
    [
        ("chat", {"max_tokens": 0}, "max_tokens", AT_LEAST_1),
        ("chat", {"max_tokens": 0, "echo": True}, "max_tokens", AT_LEAST_1),
        (
            "chat",
            {"max_completion_tokens": 0},
            "max_completion_tokens",
            "`max_completion_tokens` must be at least 1, got 0.",
        ),
        ("completions", {"max_tokens": 0}, "max_tokens", AT_LEAST_1),
        ("completions", {"max_tokens": 0, "echo": 1}, "max_tokens", AT_LEAST_1),
        (
            "completions",
            {"max_tokens": -1, "echo": True},
            "max_tokens",
            "`max_tokens` must be at least 0, got -1.",
        ),
        ("completions", {"max_tokens": True}, "max_tokens", "an integer of at least 1 or null"),
    ],
)
def test_max_tokens_is_at_least_1_as_vllm_requires(
    route: Route, fields: dict[str, Any], param: str, message: str
) -> None:
    make = chat if route == "chat" else completions
    error = refusal(make(**fields), route)
    assert_invalid(error, param)
    assert message in error.message


def test_max_tokens_0_with_echo_returns_the_prompt_on_completions() -> None:
    request = parse(completions(max_tokens=0, echo=True), "completions")
    assert request.max_output_tokens == 0


@pytest.mark.parametrize(
    ("messages", "chars"),
    [
        ([{"role": "user", "content": "héllo wörld"}], 11),
        ([{"role": "user", "content": "🦭"}], 1),
        ([{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}], 5),
        ([{"role": "user", "content": None}], 0),
        ([{"role": "user"}], 0),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "abc"},
                        {"type": "image_url", "image_url": {"url": "data:..."}},
                        {"type": "text", "text": "defg"},
                    ],
                }
            ],
            7,
        ),
        (
            [
                {"role": "user", "content": "ab"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"arguments": '{"x":1}'}},
                        {"id": "2", "type": "function", "function": {"name": "no-args"}},
                        "malformed history is the engine's business",
                    ],
                },
                {"role": "tool", "tool_call_id": "1", "content": "42"},
            ],
            2 + 7 + 2,
        ),
    ],
)
def test_chat_prompt_chars(messages: list[Any], chars: int) -> None:
    request = parse(chat(messages=messages))
    assert request.prompt_chars == chars
    assert request.prompt_token_count is None
    assert request.prompt_count == 1


@pytest.mark.parametrize(
    ("prompt", "chars", "tokens", "count"),
    [
        ("héllo", 5, None, 1),
        (["ab", "cde"], 5, None, 2),
        ([5, 6, 7], 0, 3, 1),
        ([0], 0, 1, 1),
        ([[1, 2], [3], [4, 5, 6]], 0, 6, 3),
        (list(range(50_000)), 0, 50_000, 1),
    ],
)
def test_completions_prompt_sizing(prompt: Any, chars: int, tokens: int | None, count: int) -> None:
    request = parse(completions(prompt=prompt), "completions")
    assert request.prompt_chars == chars
    assert request.prompt_token_count == tokens
    assert request.prompt_count == count


def test_body_is_the_parsed_object_unchanged() -> None:
    raw = orjson.dumps(
        chat(stream=True, stream_options={"include_usage": True}, n=None, extra={"k": [1]})
    )
    request = parse_request(raw, "chat", MODEL)
    assert orjson.dumps(request.body) == raw


def test_duplicate_keys_follow_the_parser() -> None:
    # orjson keeps the last value: the router judges what the engine will see.
    raw = b'{"model": "other", "model": "%s", "messages": [{"role": "user"}]}' % MODEL.encode()
    assert parse_request(raw, "chat", MODEL).body["model"] == MODEL


def test_an_integer_too_large_for_the_parser_is_not_an_integer() -> None:
    raw = b'{"model": "%s", "prompt": "x", "max_tokens": 1%s}' % (MODEL.encode(), b"0" * 30)
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw, "completions", MODEL)
    assert_invalid(info.value, "max_tokens")
