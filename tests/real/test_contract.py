"""Narwhal's answers equal vLLM's own, value for value, for the whole request matrix.

Every case is one line of :data:`CASES`; each is sent straight to a real vLLM and through
``narwhal serve``, by raw HTTP and by the official ``openai`` client, and compared (see
:mod:`tests.real.contract` for what the comparison ignores).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.real.contract import (
    CHAT,
    COMPLETIONS,
    CONTINUOUS,
    NAMED,
    STREAM,
    THINKING,
    TOO_LONG,
    TOOLS,
    USAGE,
    Case,
    by_choice,
    chat,
    compare,
    completion,
    differences,
    normalise,
    send,
    stream_differences,
)
from tests.real.servers import metric

pytestmark = [pytest.mark.real_engine, pytest.mark.realtime]

# Chat echo continues the last (assistant) turn, which it echoes.
ECHO: dict[str, Any] = {
    "messages": [*chat("-").body["messages"], {"role": "assistant", "content": "It is"}],
    "echo": True,
    "add_generation_prompt": False,
}
BATCH = ["The quick brown fox", "Once upon a time"]
# Strings the tiny model's greedy outputs contain (the matrix check below says so).
STOP = [" ", "x"]
LONG_CHAT = [{"role": "user", "content": TOO_LONG}]
REQUIRED: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 60}
NAMED_CALL: dict[str, Any] = {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60}

CASES = [
    chat("chat"),
    chat("chat-stream", **STREAM),
    chat("chat-stream-include-usage", **USAGE),
    chat("chat-stream-continuous-usage", **CONTINUOUS),
    chat("chat-token-ids", return_token_ids=True),
    chat("chat-stream-token-ids", return_token_ids=True, **STREAM),
    chat("chat-stream-token-ids-usage", return_token_ids=True, **CONTINUOUS),
    chat("chat-stop", stop=STOP),
    chat("chat-stream-stop", stop=STOP, **STREAM),
    chat("chat-logprobs", logprobs=True, top_logprobs=3),
    chat("chat-stream-logprobs", logprobs=True, top_logprobs=3, **USAGE),
    chat("chat-prompt-logprobs", prompt_logprobs=2),
    chat("chat-echo", **ECHO),
    chat("chat-stream-echo", **ECHO, **STREAM),
    chat("chat-echo-prompt-logprobs", **ECHO, prompt_logprobs=1),
    chat("chat-max-completion-tokens", max_tokens=None, max_completion_tokens=7),
    chat("chat-tools-auto", tools=TOOLS, tool_choice="auto"),
    chat("chat-stream-tools-auto", tools=TOOLS, tool_choice="auto", **STREAM),
    chat("chat-tools-required", **REQUIRED),
    chat("chat-stream-tools-required", **REQUIRED, **STREAM),
    chat("chat-tools-named", **NAMED_CALL),
    chat("chat-stream-tools-named", **NAMED_CALL, **USAGE),
    chat("chat-reasoning", **THINKING),
    chat("chat-stream-reasoning", **THINKING, **USAGE),
    completion("completion"),
    completion("completion-stream", **STREAM),
    completion("completion-stream-include-usage", **USAGE),
    completion("completion-stream-continuous-usage", **CONTINUOUS),
    completion("completion-token-ids", return_token_ids=True),
    completion("completion-stream-token-ids", return_token_ids=True, **STREAM),
    completion("completion-stop", stop=STOP),
    completion("completion-logprobs", logprobs=3),
    completion("completion-stream-logprobs", logprobs=3, **STREAM),
    completion("completion-prompt-logprobs", prompt_logprobs=2),
    completion("completion-echo", echo=True),
    completion("completion-stream-echo", echo=True, **STREAM),
    completion("completion-echo-logprobs", echo=True, logprobs=2),
    completion("completion-batch", prompt=BATCH),
    completion("completion-stream-batch", prompt=BATCH, **USAGE),
    completion("completion-token-prompt", prompt=[17, 42, 99, 256]),
    chat("error-bad-temperature", temperature=-1),
    chat("error-stream-bad-temperature", temperature=-1, **STREAM),
    chat("error-top-logprobs", logprobs=True, top_logprobs=50),
    chat("error-stream-top-logprobs", logprobs=True, top_logprobs=50, **STREAM),
    completion("error-max-tokens-over-context", max_tokens=4000),
    completion("error-prompt-over-context", prompt=TOO_LONG),
    chat("error-stream-prompt-over-context", messages=LONG_CHAT, **STREAM),
    completion("error-stream-prompt-logprobs", prompt_logprobs=1, **STREAM),
    chat("error-unknown-model", model="no-such-model", own_error=True),
    chat("error-bad-messages", messages="hello", own_error=True),
]
IDS = [case.name for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_raw_http_matches_vllm(case: Case, direct: httpx.Client, routed: httpx.Client) -> None:
    expected = send(direct, case)
    actual = send(routed, case)
    found = compare(case, expected, actual)
    assert not found, f"{case.name} differs from vLLM:\n" + "\n".join(found)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_raw_http_through_relay_workers_matches_vllm(
    case: Case, direct: httpx.Client, routed_workers: httpx.Client
) -> None:
    """The same matrix through ``narwhal serve`` with two relay workers under one controller:
    what a worker relays, assembles and refuses is what one process gives."""
    expected = send(direct, case)
    actual = send(routed_workers, case)
    found = compare(case, expected, actual)
    assert not found, f"{case.name} differs from vLLM through relay workers:\n" + "\n".join(found)


def _chunk(content: str | None, finish: str | None = None) -> dict[str, Any]:
    delta = {"role": None, "content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_the_comparison_allows_vllms_coalescing_and_nothing_more() -> None:
    """vLLM ends a stream with the finish on its last tokens' chunk, or on an empty chunk of
    its own (the SDK reads its content as null): the same stream. Other text is a difference.

    (Needs no vLLM: this checks the comparison the tier's verdicts rest on.)
    """
    apart = {0: [_chunk(""), _chunk("Hello"), _chunk(" there"), _chunk(None, "stop")]}
    merged = {0: [_chunk(""), _chunk("Hello"), _chunk(" there", "stop")]}
    assert stream_differences(apart, merged) == []
    assert stream_differences(merged, apart) == []
    other = {0: [_chunk(""), _chunk("Hello"), _chunk(" world", "stop")]}
    assert stream_differences(apart, other) == [
        "(coalesced) 0.tokens.delta.content: 'Hello world', vLLM 'Hello there'"
    ]
    unfinished = {0: [_chunk(""), _chunk("Hello"), _chunk(" there")]}
    assert stream_differences(apart, unfinished) != []


def _counted(content: str | None, sent: int, finish: str | None = None) -> dict[str, Any]:
    usage = {"prompt_tokens": 11, "completion_tokens": sent, "total_tokens": 11 + sent}
    return {**_chunk(content, finish), "usage": usage}


def test_the_comparison_allows_running_usage_to_follow_coalescing() -> None:
    """With ``continuous_usage_stats`` each chunk counts the tokens sent so far, so a first
    chunk that merged two steps counts two: the same stream. The whole output's count and the
    prompt's are still compared. (Needs no vLLM.)"""
    apart = {0: [_counted("Hello", 1), _counted(" there", 2), _counted(None, 2, "stop")]}
    merged = {0: [_counted("Hello there", 2), _counted(None, 2, "stop")]}
    assert stream_differences(apart, merged) == []
    longer = {0: [_counted("Hello there", 2), _counted(None, 3, "stop")]}
    assert stream_differences(apart, longer) == [
        "(coalesced) 0.last.usage.completion_tokens: 3, vLLM 2",
        "(coalesced) 0.last.usage.total_tokens: 14, vLLM 13",
    ]
    other_prompt = {0: [{**_counted("Hello there", 2), "usage": {"prompt_tokens": 12}}]}
    found = stream_differences(apart, other_prompt)
    assert any("first.usage.prompt_tokens" in line for line in found)


def _call(arguments: str, *, first: bool = False, finish: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
    if first:
        call = {**call, "id": "call-1", "type": "function"}
        call["function"] = {"name": "get_weather", "arguments": arguments}
    delta = {"tool_calls": [call]}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_the_comparison_allows_coalesced_tool_call_arguments() -> None:
    """A streamed tool call's arguments are tokens too: vLLM under load merges two steps'
    arguments into one chunk (seen on the tier: a named tool call ending in ``' per col'``
    where the direct run ended in ``' col'``), and that is the same stream. Other arguments
    are a difference. (Needs no vLLM.)"""
    apart = {0: [_call('{"city": "x', first=True), _call(" per"), _call(" col", finish="stop")]}
    merged = {0: [_call('{"city": "x', first=True), _call(" per col", finish="stop")]}
    assert stream_differences(apart, merged) == []
    assert stream_differences(merged, apart) == []
    other = {0: [_call('{"city": "x', first=True), _call(" per row", finish="stop")]}
    assert stream_differences(apart, other) == [
        "(coalesced) 0.tokens.delta.tool_calls.0.function.arguments: "
        '\'{"city": "x per row\', vLLM \'{"city": "x per col\''
    ]


def test_matrix_exercises_what_it_names(direct: httpx.Client) -> None:
    """The cases really reach the features they are named after (else a match proves nothing)."""
    by_name = {case.name: case for case in CASES}

    def body(name: str) -> Any:
        answer = send(direct, by_name[name])
        assert answer.status == 200, (name, answer.body)
        return answer.body

    for name in ("chat-tools-required", "chat-tools-named"):
        # Greedy decoding of the tiny model never closes the call: whole, vLLM gives it back as
        # text; streamed, as tool-call deltas (below).
        message = body(name)["choices"][0]["message"]
        assert message.get("tool_calls") or "<tool_call>" in message["content"], name
    assert body("chat-reasoning")["choices"][0]["message"]["reasoning"]
    assert body("chat-stop")["choices"][0]["finish_reason"] == "stop"
    assert body("completion-stop")["choices"][0]["finish_reason"] == "stop"
    assert body("chat-prompt-logprobs")["prompt_logprobs"]
    assert body("completion-echo")["choices"][0]["text"].startswith("The quick brown fox")
    assert len(body("completion-batch")["choices"]) == 2
    assert body("chat-token-ids")["choices"][0]["token_ids"]
    for name in ("chat-stream-tools-named", "chat-stream-tools-required"):
        assert any(
            event["choices"] and event["choices"][0]["delta"].get("tool_calls")
            for event in body(name)
            if isinstance(event, dict)
        ), name
    error = send(direct, by_name["error-stream-top-logprobs"])
    assert error.status == 200 and error.error is not None  # vLLM's in-band error frame


# -- the official openai client ------------------------------------------------------------------

SDK_FIELDS = {CHAT: ("model", "messages", "stream"), COMPLETIONS: ("model", "prompt", "stream")}


def sdk_call(client: openai.OpenAI, case: Case) -> Any:
    """``case`` through the SDK: its own fields named, vLLM's extras in ``extra_body``."""
    named = {key: case.body[key] for key in SDK_FIELDS[case.route] if key in case.body}
    extra = {key: value for key, value in case.body.items() if key not in named}
    api = client.chat.completions if case.route == CHAT else client.completions
    try:
        result = api.create(**named, extra_body=extra)
        if case.stream:
            return by_choice([chunk.model_dump() for chunk in result])
        return result.model_dump()
    except openai.APIError as exc:
        return sdk_error(case, exc)


def sdk_error(case: Case, exc: openai.APIError) -> dict[str, Any]:
    """What a client learns from an SDK error: the status (an in-band frame's code, where the
    SDK raised mid-stream: Narwhal answers those with the status), the param, the message."""
    body = exc.body if isinstance(exc.body, dict) else {}
    body = body.get("error", body) if isinstance(body.get("error"), dict) else body
    status = exc.status_code if isinstance(exc, openai.APIStatusError) else exc.code
    status = int(status) if isinstance(status, str) and status.isdigit() else status
    param = body.get("param")
    seen = {
        "status": status,
        "param": param.removeprefix("body.") if isinstance(param, str) else param,
    }
    if not case.own_error:
        seen["message"] = body.get("message")
    return seen


@pytest.fixture
def sdk_clients(vllm_url: str, narwhal_url: str) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    # Closed at the end: a client left to the garbage collector leaves its keep-alive sockets
    # to it, and their ResourceWarning fails whichever later test is running when it collects.
    with (
        openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=2) as to_vllm,
        openai.OpenAI(base_url=f"{narwhal_url}/v1", api_key="unused", max_retries=2) as routed,
    ):
        yield to_vllm, routed


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_openai_client_sees_what_vllm_gives(
    case: Case, sdk_clients: tuple[openai.OpenAI, openai.OpenAI], vllm_url: str
) -> None:
    to_vllm, to_narwhal = sdk_clients
    expected = normalise(sdk_call(to_vllm, case))
    before = httpx.get(f"{vllm_url}/metrics").text
    actual = normalise(sdk_call(to_narwhal, case))
    after = httpx.get(f"{vllm_url}/metrics").text
    found = stream_differences(expected, actual) if case.stream else differences(expected, actual)
    assert not found, f"{case.name} differs from vLLM:\n" + "\n".join(found)
    if not case.own_error:  # one SDK call is one POST at the engine: nothing was retried
        posts = metric(after, "http_requests_total", handler=case.route) - metric(
            before, "http_requests_total", handler=case.route
        )
        assert posts == 1, f"{case.name}: {posts:g} POSTs reached vLLM for one SDK call"
