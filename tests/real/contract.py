"""The contract between Narwhal and a real vLLM: the same request, sent both ways, must match.

Each :class:`Case` is sent straight to vLLM and through Narwhal; the two answers are compared
value for value, ignoring only what differs between any two calls to vLLM itself (response and
tool-call ids, ``created`` timestamps). Whole responses must be equal; streams must be the same
list of events. Errors compare by status, ``param`` and, where vLLM wrote the error, its message:
Narwhal's envelope normalises ``type`` and ``code`` (docs: Errors), and errors Narwhal finds
itself (an unknown model) are its own words.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import attrs
import httpx

from tests.real.servers import MAX_MODEL_LEN, MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                # An enum bounds the call: greedy decoding of a free string runs to max_tokens,
                # and vLLM parses a cut call differently streamed (deltas) and whole (text).
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
STREAM: dict[str, Any] = {"stream": True}
USAGE: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
CONTINUOUS: dict[str, Any] = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}
THINKING: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
# Far longer than the context (about a token per two characters of this text).
TOO_LONG = "the weather in Paris, " * (MAX_MODEL_LEN // 2)

VOLATILE = frozenset({"id", "created"})


@attrs.frozen
class Case:
    """One request of the matrix; ``own_error`` when Narwhal, not vLLM, answers it."""

    name: str
    route: str
    body: dict[str, Any]
    own_error: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def chat(name: str, /, *, own_error: bool = False, **fields: Any) -> Case:
    """A chat case: greedy, short, with ``fields`` over the defaults."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **fields}
    return Case(name, CHAT, _present(body), own_error)


def completion(name: str, /, *, own_error: bool = False, **fields: Any) -> Case:
    """A completions case: greedy, short, with ``fields`` over the defaults."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    body.update(fields)
    return Case(name, COMPLETIONS, _present(body), own_error)


def _present(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without the defaults a case removed (set to ``None``)."""
    return {key: value for key, value in body.items() if value is not None}


@attrs.frozen
class Answer:
    """One answer, decoded: a JSON body, or a stream's events (``"[DONE]"`` kept)."""

    status: int
    streamed: bool
    body: Any
    headers: httpx.Headers

    @property
    def error(self) -> dict[str, Any] | None:
        """The error envelope's inside, for a whole error answer or a stream's error event."""
        if not self.streamed:
            if self.status >= 400 and isinstance(self.body, dict):
                whole = self.body.get("error")
                return whole if isinstance(whole, dict) else None
            return None
        for event in self.body:
            if isinstance(event, dict) and isinstance(event.get("error"), dict):
                inside: dict[str, Any] = event["error"]
                return inside
        return None


def send(client: httpx.Client, case: Case, headers: dict[str, str] | None = None) -> Answer:
    """Send ``case`` and decode the answer (whole or streamed)."""
    with client.stream("POST", case.route, json=case.body, headers=headers) as response:
        raw = response.read()
    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        return Answer(response.status_code, True, sse_events(raw), response.headers)
    return Answer(response.status_code, False, json.loads(raw), response.headers)


def sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` events of an SSE body, JSON-decoded (``[DONE]`` as the string)."""
    events: list[Any] = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if not data:
            continue
        text = "\n".join(data)
        events.append(text if text == "[DONE]" else json.loads(text))
    return events


def normalise(value: Any) -> Any:
    """``value`` with ids and timestamps blanked, recursively."""
    if isinstance(value, dict):
        return {
            key: ("<volatile>" if key in VOLATILE else normalise(item))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [normalise(item) for item in value]
    return value


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Every place where ``actual`` differs from ``expected``, as readable lines."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = []
        for key in expected.keys() | actual.keys():
            where = f"{path}.{key}" if path else str(key)
            if key not in actual:
                found.append(f"{where}: missing (vLLM: {expected[key]!r:.120})")
            elif key not in expected:
                found.append(f"{where}: extra {actual[key]!r:.120}")
            else:
                found.extend(differences(expected[key], actual[key], where))
        return sorted(found)
    if isinstance(expected, list) and isinstance(actual, list):
        found = []
        if len(expected) != len(actual):
            found.append(f"{path}: {len(actual)} items, vLLM {len(expected)}")
        for index, (left, right) in enumerate(zip(expected, actual, strict=False)):
            found.extend(differences(left, right, f"{path}[{index}]"))
        return found
    if expected != actual or type(expected) is not type(actual):
        return [f"{path}: {actual!r:.120}, vLLM {expected!r:.120}"]
    return []


def early_rejection(answer: Answer) -> int | None:
    """The 4xx code of a stream that errs before any output: vLLM's 200 carrying
    ``{"error": {..., "code": 400}}`` (after a role chunk at most), which Narwhal answers with
    that status, its response headers not yet sent (docs: Errors)."""
    if not answer.streamed or answer.status != 200 or answer.error is None:
        return None
    for event in answer.body:
        if isinstance(event, dict) and "error" in event:
            break
        if not _role_only(event):
            return None
    code = answer.error.get("code")
    code = int(code) if isinstance(code, str) and code.isdigit() else code
    return code if type(code) is int and 400 <= code < 500 else None


def _role_only(event: Any) -> bool:
    """A chat chunk whose only news is the role (with vLLM's empty content)."""
    if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
        return False
    return all(
        isinstance(choice, dict)
        and choice.get("finish_reason") is None
        and set(choice.get("delta") or {}) <= {"role", "content"}
        and not (choice.get("delta") or {}).get("content")
        for choice in event["choices"]
    )


def by_choice(events: list[Any]) -> dict[Any, list[Any]]:
    """A stream's events, one list per choice index (usage-only and ``[DONE]`` apart).

    Several choices (batch prompts) interleave as the engine's steps happen to finish: their
    order across choices is timing, their order within a choice is the answer.
    """
    lanes: dict[Any, list[Any]] = {}
    for event in events:
        choices = event.get("choices") if isinstance(event, dict) else None
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
            lane = choices[0].get("index")
        else:
            lane = "usage" if isinstance(event, dict) and event.get("usage") else str(event)[:20]
        lanes.setdefault(lane, []).append(event)
    return lanes


def compare(case: Case, direct: Answer, routed: Answer) -> list[str]:
    """What differs between vLLM's own answer and Narwhal's, for ``case``."""
    found: list[str] = []
    expected_status = early_rejection(direct) or direct.status
    if expected_status != routed.status:
        found.append(f"status: {routed.status}, vLLM {direct.status}")
    expected_error, actual_error = direct.error, routed.error
    if expected_error is not None or actual_error is not None:
        if expected_error is None or actual_error is None:
            return [*found, f"error: {actual_error!r:.200}, vLLM {expected_error!r:.200}"]
        expected_param = expected_error.get("param")
        if isinstance(expected_param, str):  # FastAPI's prefix, which Narwhal strips
            expected_param = expected_param.removeprefix("body.")
        if expected_param != actual_error.get("param"):
            found.append(f"error.param: {actual_error.get('param')!r}, vLLM {expected_param!r}")
        if not case.own_error and expected_error.get("message") != actual_error.get("message"):
            found.append(
                f"error.message: {actual_error.get('message')!r}, "
                f"vLLM {expected_error.get('message')!r}"
            )
        for key in ("message", "type", "param", "code"):
            if key not in actual_error:
                found.append(f"error.{key}: missing from the envelope")
        return found
    if direct.streamed != routed.streamed:
        return [*found, f"streamed: {routed.streamed}, vLLM {direct.streamed}"]
    expected, actual = normalise(direct.body), normalise(routed.body)
    if direct.streamed:
        expected, actual = by_choice(expected), by_choice(actual)
        return [*found, *stream_differences(expected, actual)]
    return [*found, *differences(expected, actual)]


# Where a stream chunk's choice carries its tokens (and a streamed tool call's arguments, by
# the call's index: _take_tokens). vLLM puts what each step produced in one chunk, and merges
# the outputs of several steps into one chunk when its consumer lags (a loaded machine): two
# runs of one request may then split the same tokens differently.
_TOKEN_PATHS: tuple[tuple[str, ...], ...] = (
    ("delta", "content"),
    ("delta", "reasoning_content"),
    ("delta", "reasoning"),
    ("text",),
    ("token_ids",),
    ("logprobs", "content"),
    ("logprobs", "tokens"),
    ("logprobs", "token_logprobs"),
    ("logprobs", "top_logprobs"),
    ("logprobs", "text_offset"),
)


def _take_tokens(chunk: Any) -> tuple[Any, dict[str, Any]]:
    """``chunk`` without its token fields, and the tokens it carried (by path).

    A token field is taken off whether it carried tokens or null: vLLM ends a stream either
    with its last tokens and the finish in one chunk, or with the tokens and then a finish
    chunk of its own whose delta is empty (null content, as the SDK reads it).
    """
    rest = copy.deepcopy(chunk)
    tokens: dict[str, Any] = {}
    choices = rest.get("choices") if isinstance(rest, dict) else None
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)):
        return rest, tokens
    for path in _TOKEN_PATHS:
        holder = choices[0]
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and path[-1] in holder:
            value = holder.pop(path[-1])
            if value is not None:
                tokens[".".join(path)] = value
    # A streamed tool call's arguments are tokens too, merged alike: by the call's index.
    delta = choices[0].get("delta")
    calls = delta.get("tool_calls") if isinstance(delta, dict) else None
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" in function:
            value = function.pop("arguments")
            if value is not None:
                tokens[f"delta.tool_calls.{call.get('index')}.function.arguments"] = value
    return rest, tokens


def coalesced(lane: list[Any]) -> dict[str, Any]:
    """A choice's chunks as vLLM's coalescing cannot change them: the first and the last chunk
    without their tokens, and every token field concatenated over the chunks."""
    parts = [_take_tokens(chunk) for chunk in lane]
    tokens: dict[str, Any] = {}
    for _, carried in parts:
        for path, value in carried.items():
            tokens[path] = tokens[path] + value if path in tokens else value
    if not parts:
        return {}
    first, carried = parts[0]
    if carried:
        _drop_running_counts(first)
    return {"first": first, "last": parts[-1][0], "tokens": tokens}


def _drop_running_counts(chunk: Any) -> None:
    """Take off a chunk's running output counts (``continuous_usage_stats``): they count the
    tokens sent so far, so they move with how many steps vLLM merged into the chunk. The last
    chunk's counts (the whole output) and the prompt's stay compared."""
    usage = chunk.get("usage") if isinstance(chunk, dict) else None
    if isinstance(usage, dict):
        usage.pop("completion_tokens", None)
        usage.pop("total_tokens", None)


def stream_differences(expected: dict[Any, list[Any]], actual: dict[Any, list[Any]]) -> list[str]:
    """Where two streams' choices differ, chunk for chunk; where they differ only in how
    vLLM split the same tokens into chunks (see :data:`_TOKEN_PATHS`), nothing."""
    found = differences(expected, actual)
    lanes = (expected, actual)
    if not found or expected.keys() != actual.keys():
        return found
    if not all(isinstance(chunks, list) for side in lanes for chunks in side.values()):
        return found  # not two streams (an error's fields)
    merged = differences(
        {lane: coalesced(chunks) for lane, chunks in expected.items()},
        {lane: coalesced(chunks) for lane, chunks in actual.items()},
    )
    return [f"(coalesced) {line}" for line in merged]
