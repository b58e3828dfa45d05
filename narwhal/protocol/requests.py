"""Parse and validate completion request bodies (pure, no I/O).

The router interprets a handful of fields (model, messages or prompt, stream, stream_options,
n, best_of, max_tokens, max_completion_tokens, return_token_ids, and the unsupported options
audio, modalities and tools); everything else passes to the engine untouched and unchecked.
Validation order, first failure wins (docs: Errors and refusals): invalid JSON / shape / type
(400), then model (404; a missing or non-string model is a 400), then sampling width, then
unsupported option. (413 is the shell's job: it never hands an oversized body to this module.)

The parsed object is checked in place, in one pass over the fields the router reads, and kept as
the request's ``body``: nothing is copied or rewritten.
"""

from __future__ import annotations

from typing import Any, Final, Literal, NoReturn

import attrs
import orjson

from narwhal.errors import (
    InvalidRequest,
    InvalidSamplingWidth,
    ModelNotFound,
    UnsupportedOption,
)

__all__ = ["CompletionRequest", "InvalidRequest", "Route", "parse_request"]

Route = Literal["chat", "completions"]

# Tells "absent" from an explicit JSON null where the difference matters.
_MISSING: Final = object()


@attrs.frozen
class CompletionRequest:
    """A validated completion request.

    Attributes:
        route: ``"chat"`` for ``/v1/chat/completions``, ``"completions"`` for ``/v1/completions``.
        body: the client's JSON object exactly as sent (never mutated).
        stream: whether the client asked for a stream.
        include_usage: the client asked ``stream_options.include_usage`` on a stream.
        continuous_usage: the client asked ``stream_options.continuous_usage_stats`` on a stream.
        wants_token_ids: the client asked ``return_token_ids``.
        max_output_tokens: the output cap the engine will apply, if the client set one: on chat
            ``max_completion_tokens`` if not null, else ``max_tokens``; on completions
            ``max_tokens`` (the legacy route has no ``max_completion_tokens``). None when unset.
        prompt_chars: characters of prompt text (for the characters-per-token estimate): chat
            string contents, text parts and tool-call argument strings; completions string
            prompts. Zero for a token-ID prompt.
        prompt_token_count: the prompt's length in tokens when the client sent token IDs (all
            prompts of a batch together), else None.
        prompt_count: how many prompts a completions request carries (an array of strings or of
            token-ID arrays is a batch, one choice each); 1 for chat.
    """

    route: Route
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    wants_token_ids: bool
    max_output_tokens: int | None
    prompt_chars: int
    prompt_token_count: int | None = None
    prompt_count: int = 1


def parse_request(raw: bytes, route: Route, model: str) -> CompletionRequest:
    """Parse ``raw`` (a complete body within the size limit) and validate it.

    Args:
        raw: the request body as received.
        route: which completion route received it.
        model: the configured model name; the request must name exactly this one.

    Returns:
        The validated request, holding the parsed body itself.

    Raises:
        InvalidRequest: invalid JSON (``param`` None), a body that is not an object (``param``
            None), a router-interpreted field of the wrong type or range, or a missing or
            non-string ``model`` (``param`` names the field).
        ModelNotFound: the body names another model.
        InvalidSamplingWidth: ``n`` or ``best_of`` above 1.
        UnsupportedOption: a non-streaming request for audio, a non-text modality or a
            non-function tool.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", param=None) from exc
    if type(body) is not dict:
        raise InvalidRequest(
            f"The request body must be a JSON object, got {_describe(body)}.", param=None
        )

    # 1. Shape and types of every field the router interprets.
    prompt_token_count: int | None = None
    prompt_count = 1
    if route == "chat":
        prompt_chars = _chat_prompt_chars(body)
    else:
        prompt_chars, prompt_token_count, prompt_count = _completions_prompt(body)
    stream = _optional_bool(body, "stream")
    include_usage, continuous_usage = _stream_options(body, stream)
    n = _optional_int(body, "n", 1)
    best_of = _optional_int(body, "best_of", 1)
    max_output_tokens = _max_tokens(body, route)
    if route == "chat":
        max_completion_tokens = _optional_int(body, "max_completion_tokens", 1)
        if max_completion_tokens is not None:
            max_output_tokens = max_completion_tokens
    wants_token_ids = _optional_bool(body, "return_token_ids")
    modalities = _modalities(body)
    tools = _tools(body)

    # 2. The model.
    _check_model(body.get("model", _MISSING), model)

    # 3. Sampling width: one sequence per request.
    if n is not None and n > 1:
        raise InvalidSamplingWidth(
            f"Invalid sampling width: `n` is {n}, but Narwhal serves one sequence per request; "
            "send `n` = 1 or omit it.",
            param="n",
        )
    if best_of is not None and best_of > 1:
        raise InvalidSamplingWidth(
            f"Invalid sampling width: `best_of` is {best_of}, but Narwhal serves one sequence "
            "per request; send `best_of` = 1 or omit it.",
            param="best_of",
        )

    # 4. Options a non-streaming response cannot carry.
    if not stream:
        _check_supported(body, modalities, tools)

    return CompletionRequest(
        route=route,
        body=body,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        wants_token_ids=wants_token_ids,
        max_output_tokens=max_output_tokens,
        prompt_chars=prompt_chars,
        prompt_token_count=prompt_token_count,
        prompt_count=prompt_count,
    )


# -- diagnostics --------------------------------------------------------------------------------


def _describe(value: object) -> str:
    """Name a JSON value's kind for a message, with the value itself when it is a short scalar."""
    if value is None:
        return "null"
    if value is True or value is False:
        return f"a Boolean ({'true' if value else 'false'})"
    if type(value) is int or type(value) is float:
        return f"a number ({value!r})"
    if type(value) is str:
        return "a string"
    if type(value) is list:
        return "an array"
    return "an object"


def _wrong(path: str, expected: str, value: object) -> NoReturn:
    """Raise the 400 for a field that is absent or not what the router needs."""
    if value is _MISSING:
        raise InvalidRequest(f"`{path}` is required: it must be {expected}.", param=path)
    raise InvalidRequest(f"`{path}` must be {expected}, got {_describe(value)}.", param=path)


# -- scalar fields ------------------------------------------------------------------------------


def _optional_bool(body: dict[str, Any], key: str, prefix: str = "") -> bool:
    """A Boolean or null field; absent and null read as false. ``prefix`` leads the path."""
    value = body.get(key)
    if value is None:
        return False
    if value is True or value is False:
        return value
    _wrong(prefix + key, "a Boolean or null", value)


def _optional_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    """An integer field of at least ``minimum``, or null. A Boolean is not an integer."""
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int:
        _wrong(key, f"an integer of at least {minimum} or null", value)
    if value < minimum:
        raise InvalidRequest(f"`{key}` must be at least {minimum}, got {value}.", param=key)
    return value


def _max_tokens(body: dict[str, Any], route: Route) -> int | None:
    """``max_tokens``: at least 1, as vLLM's sampling parameters require.

    On completions 0 is allowed with ``echo: true``: the prompt comes back without generation
    (vLLM and OpenAI both answer it).
    """
    echo_only = route == "completions" and body.get("echo") is True
    return _optional_int(body, "max_tokens", 0 if echo_only else 1)


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """``stream_options``: (include_usage, continuous_usage_stats), each false unless streaming."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if type(options) is not dict:
        _wrong("stream_options", "an object or null", options)
    include_usage = _optional_bool(options, "include_usage", "stream_options.")
    continuous_usage = _optional_bool(options, "continuous_usage_stats", "stream_options.")
    # vLLM refuses stream options on a non-streaming request, but lets an empty object through.
    if options and not stream:
        raise InvalidRequest(
            "`stream_options` can only be set when `stream` is true.", param="stream_options"
        )
    return include_usage and stream, continuous_usage and stream


def _check_model(value: object, configured: str) -> None:
    if type(value) is not str:
        _wrong("model", "a string naming the model", value)
    if value != configured:
        raise ModelNotFound(
            f"The model `{value}` does not exist here; this router serves `{configured}`.",
            param="model",
        )


# -- prompts ------------------------------------------------------------------------------------


def _chat_prompt_chars(body: dict[str, Any]) -> int:
    """Check ``messages`` and count the characters of its prompt text."""
    messages = body.get("messages", _MISSING)
    if type(messages) is not list:
        _wrong("messages", "a non-empty array of message objects", messages)
    if not messages:
        raise InvalidRequest("`messages` must not be empty.", param="messages")
    chars = 0
    for index, message in enumerate(messages):
        if type(message) is not dict:
            _wrong(f"messages[{index}]", "a message object", message)
        role = message.get("role", _MISSING)
        if type(role) is not str:
            _wrong(f"messages[{index}].role", "a string", role)
        content = message.get("content")
        if type(content) is str:
            chars += len(content)
        elif type(content) is list:
            chars += _content_parts_chars(content, index)
        elif content is not None:
            _wrong(
                f"messages[{index}].content",
                "a string or an array of content parts",
                content,
            )
        tool_calls = message.get("tool_calls")
        if type(tool_calls) is list:
            chars += _tool_call_chars(tool_calls)
    return chars


def _content_parts_chars(parts: list[Any], index: int) -> int:
    chars = 0
    for number, part in enumerate(parts):
        if type(part) is not dict:
            _wrong(f"messages[{index}].content[{number}]", "a content part object", part)
        if part.get("type") == "text":
            text = part.get("text", _MISSING)
            if type(text) is not str:
                _wrong(f"messages[{index}].content[{number}].text", "a string", text)
            chars += len(text)
    return chars


def _tool_call_chars(tool_calls: list[Any]) -> int:
    """Characters of tool-call arguments in the history: sizing only, so nothing is checked."""
    chars = 0
    for call in tool_calls:
        if type(call) is dict:
            function = call.get("function")
            if type(function) is dict:
                arguments = function.get("arguments")
                if type(arguments) is str:
                    chars += len(arguments)
    return chars


_PROMPT_KINDS: Final = (
    "a non-empty string, an array of strings, an array of token IDs or an array of token-ID arrays"
)


def _completions_prompt(body: dict[str, Any]) -> tuple[int, int | None, int]:
    """Check ``prompt``: (characters of text, token count for token IDs, number of prompts)."""
    prompt = body.get("prompt", _MISSING)
    if type(prompt) is str:
        if not prompt:
            raise InvalidRequest("`prompt` must not be empty.", param="prompt")
        return len(prompt), None, 1
    if type(prompt) is not list:
        _wrong("prompt", _PROMPT_KINDS, prompt)
    if not prompt:
        raise InvalidRequest("`prompt` must not be empty.", param="prompt")
    first = prompt[0]
    if type(first) is int:
        _check_token_ids(prompt, "prompt")
        return 0, len(prompt), 1
    if type(first) is str:
        # One type() per element in C; the per-element loop runs only to locate a fault.
        if set(map(type, prompt)) != {str} or not all(prompt):
            for number, item in enumerate(prompt):
                if type(item) is not str:
                    _wrong(f"prompt[{number}]", "a string, like the first prompt", item)
                if not item:
                    raise InvalidRequest(
                        f"`prompt[{number}]` must not be empty.", param=f"prompt[{number}]"
                    )
        return sum(map(len, prompt)), None, len(prompt)
    if type(first) is list:
        tokens = 0
        for number, item in enumerate(prompt):
            if type(item) is not list:
                _wrong(f"prompt[{number}]", "an array of token IDs, like the first prompt", item)
            _check_token_ids(item, f"prompt[{number}]")
            tokens += len(item)
        return 0, tokens, len(prompt)
    _wrong("prompt[0]", "a string, a token ID or an array of token IDs", first)


def _check_token_ids(ids: list[Any], path: str) -> None:
    """Every element a non-negative integer (not a Boolean); the list non-empty."""
    if not ids:
        raise InvalidRequest(f"`{path}` must not be empty.", param=path)
    if set(map(type, ids)) == {int} and min(ids) >= 0:
        return
    for number, token in enumerate(ids):
        if type(token) is not int or token < 0:
            _wrong(f"{path}[{number}]", "a token ID (an integer of at least 0)", token)


# -- options the router may refuse --------------------------------------------------------------


def _modalities(body: dict[str, Any]) -> list[str] | None:
    value = body.get("modalities")
    if value is None:
        return None
    if type(value) is not list:
        _wrong("modalities", "an array of strings or null", value)
    for number, item in enumerate(value):
        if type(item) is not str:
            _wrong(f"modalities[{number}]", "a string", item)
    return value


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    value = body.get("tools")
    if value is None:
        return None
    if type(value) is not list:
        _wrong("tools", "an array of tool objects or null", value)
    for number, tool in enumerate(value):
        if type(tool) is not dict:
            _wrong(f"tools[{number}]", "a tool object", tool)
        kind = tool.get("type", _MISSING)
        if type(kind) is not str:
            _wrong(f"tools[{number}].type", "a string", kind)
    return value


def _check_supported(
    body: dict[str, Any], modalities: list[str] | None, tools: list[dict[str, Any]] | None
) -> None:
    """Refuse what a non-streaming (assembled) response cannot carry."""
    if body.get("audio") is not None:
        raise UnsupportedOption(
            "Audio output is not supported on non-streaming requests.", param="audio"
        )
    if modalities is not None:
        for modality in modalities:
            if modality != "text":
                raise UnsupportedOption(
                    f"The output modality `{modality}` is not supported on non-streaming "
                    'requests; only "text" is.',
                    param="modalities",
                )
    if tools is not None:
        for tool in tools:
            if tool["type"] != "function":
                raise UnsupportedOption(
                    f"Tools of type `{tool['type']}` are not supported on non-streaming "
                    'requests; only "function" tools are.',
                    param="tools",
                )
