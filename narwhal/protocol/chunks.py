"""What a streamed chunk carries, and the repairs a relay may make to it (pure, no I/O).

Three jobs, all on the hot path (every relayed chunk passes through here once):

* **Inspect**: is this an *output event* (docs: Request lifecycle), does it finish a
  choice, does it carry usage, and how many validated token IDs does it hold?
* **Validate token identity**: on every output event from an engine that provides IDs, each
  choice's ``token_ids`` must be a list of integers >= 0 (a Boolean is not an ID; ``[]`` is valid
  and counts zero). On other events IDs are checked and counted when present, never required.
* **Repair for the client**: put back what the router itself asked for (token IDs, a usage
  chunk) the way the engine would have sent it without the request, and coalesce several
  fragments of one tool call inside a delta (openai-python before 3.14 mis-assembles them).
  A chat chunk that exists only because IDs were asked for (:func:`only_hidden_ids`) is not
  forwarded at all.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import attrs

from narwhal.errors import EngineResponseError

__all__ = ["ChunkFacts", "Exposure", "expose", "inspect_chunk", "only_hidden_ids"]

_TEXT_KEYS = ("content", "reasoning", "reasoning_content", "refusal")


class ChunkFacts(NamedTuple):
    """What one decoded chunk carries (a named tuple: one is made for every chunk relayed, and
    a tuple is the cheapest immutable record to make).

    Attributes:
        output: at least one choice has an output event (non-empty text, or any tool-call or
            function-call fragment).
        finish: at least one choice has a non-null ``finish_reason``.
        usage: the chunk has a non-null top-level ``usage``.
        usage_only: ``choices`` is empty and ``usage`` is set (the final usage chunk).
        token_ids: validated token IDs in the chunk, over all choices.
        has_token_ids: at least one choice carried a ``token_ids`` list.
    """

    output: bool
    finish: bool
    usage: bool
    usage_only: bool
    token_ids: int
    has_token_ids: bool


def _malformed(message: str, param: str) -> EngineResponseError:
    return EngineResponseError(message, param=param, code="malformed_engine_response")


def _count_ids(value: Any, param: str) -> int:
    if type(value) is not list:
        raise _malformed(f"`{param}` must be a list of token IDs", param)
    for item in value:
        # `type(x) is int` rejects Booleans, which are ints to isinstance().
        if type(item) is not int or item < 0:
            raise _malformed(f"`{param}` holds {item!r}, not a token ID (an integer >= 0)", param)
    return len(value)


def inspect_chunk(
    chunk: Any, route: Literal["chat", "completions"], *, ids_required: bool
) -> ChunkFacts:
    """Classify a decoded chunk and validate its token IDs.

    Args:
        chunk: the decoded JSON of one data event (not ``[DONE]``, not an error frame).
        route: which API the chunk belongs to.
        ids_required: the engine was asked for token IDs, so every output event must carry them.

    Raises:
        EngineResponseError: the chunk is not a chunk, or its token IDs break the rules.
    """
    if type(chunk) is not dict:
        raise _malformed("engine sent an event that is not a JSON object", "")
    choices = chunk.get("choices")
    if type(choices) is not list:
        raise _malformed("engine chunk has no `choices` list", "choices")
    usage = chunk.get("usage") is not None
    output = finish = has_ids = False
    count = 0
    for position, choice in enumerate(choices):
        if type(choice) is not dict:
            raise _malformed("a choice is not an object", f"choices[{position}]")
        index = choice.get("index", position)
        this_output = _choice_has_output(choice, route, index)
        ids = choice.get("token_ids")
        if ids is not None:
            count += _count_ids(ids, f"choices[{index}].token_ids")
            has_ids = True
        elif this_output and ids_required:
            raise _malformed(
                "engine sent generated output without its token IDs", f"choices[{index}].token_ids"
            )
        output = output or this_output
        if choice.get("finish_reason") is not None:
            finish = True
    return ChunkFacts(output, finish, usage, usage and not choices, count, has_ids)


def _choice_has_output(choice: dict[str, Any], route: str, index: Any) -> bool:
    if route == "completions":
        text = choice.get("text")
        return type(text) is str and text != ""
    delta = choice.get("delta")
    if delta is None:
        return False
    if type(delta) is not dict:
        raise _malformed("`delta` is not an object", f"choices[{index}].delta")
    for key in _TEXT_KEYS:
        value = delta.get(key)
        if type(value) is str and value:
            return True
    return bool(delta.get("tool_calls")) or delta.get("function_call") is not None


@attrs.frozen(slots=True)
class Exposure:
    """What the client asked for, against what the router asked the engine for.

    Attributes:
        hide_token_ids: the router asked for token IDs the client did not ask for.
        drop_usage_chunk: the router forced ``include_usage`` the client did not ask for.
    """

    hide_token_ids: bool
    drop_usage_chunk: bool


def expose(chunk: dict[str, Any], route: str, exposure: Exposure) -> bool:
    """Repair ``chunk`` in place for the client; return whether anything changed.

    Token IDs the client did not ask for become null with the key kept, which is exactly how
    vLLM answers a request without ``return_token_ids``. Several fragments of one tool call
    within one delta are coalesced into one fragment.
    """
    changed = False
    if exposure.hide_token_ids:
        if chunk.get("prompt_token_ids") is not None:
            chunk["prompt_token_ids"] = None
            changed = True
    for choice in chunk["choices"]:
        if exposure.hide_token_ids:
            if choice.get("token_ids") is not None:
                choice["token_ids"] = None
                changed = True
            if choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
                changed = True
        if route == "chat":
            delta = choice.get("delta")
            calls = delta.get("tool_calls") if delta else None
            if calls and len(calls) > 1:
                merged = coalesce_tool_calls(calls)
                if merged is not None:
                    delta["tool_calls"] = merged
                    changed = True
    return changed


# What every chunk carries (its identity), and what the router hides or does not count as
# content of its own: the token IDs, and continuous usage, which the next chunk repeats.
_CHUNK_IDENTITY = frozenset(("id", "object", "created", "model", "choices"))
_HIDDEN_TOP = frozenset(("prompt_token_ids", "usage"))
_HIDDEN_CHOICE = frozenset(("index", "delta", "token_ids", "prompt_token_ids"))


def only_hidden_ids(chunk: dict[str, Any]) -> bool:
    """Whether a chat chunk carries nothing for a client that did not ask for token IDs.

    vLLM sends a chunk for every token when ``return_token_ids`` is set, even for a token whose
    text its parsers hold back (``{"delta": {}, "token_ids": [161]}``); without the field it
    sends no chunk for such a token. A chunk is such a chunk when it has at least one choice,
    every choice has an empty delta and no other key with a value but its IDs (no finish, no
    logprobs), and the chunk has no top-level key with a value but its identity, its prompt IDs
    and continuous usage (which the next chunk repeats, counted further). A usage-only chunk
    (no choices) is not one.
    """
    choices = chunk["choices"]
    if not choices:
        return False
    for key, value in chunk.items():
        if value is not None and key not in _CHUNK_IDENTITY and key not in _HIDDEN_TOP:
            return False
    for choice in choices:
        if type(choice) is not dict or choice.get("delta"):
            return False
        for key, value in choice.items():
            if value is not None and key not in _HIDDEN_CHOICE:
                return False
    return True


def coalesce_tool_calls(calls: list[Any]) -> list[dict[str, Any]] | None:
    """Merge fragments that share an ``index``; ``None`` when every index appears once.

    Within one delta, strings concatenate in order (``id``, ``function.name``,
    ``function.arguments``), ``type`` keeps its first value, and the merged fragment takes the
    place of the first one.
    """
    indices = [call.get("index") if type(call) is dict else None for call in calls]
    if len(set(indices)) == len(indices):
        return None
    merged: dict[Any, dict[str, Any]] = {}
    order: list[dict[str, Any]] = []
    for call, index in zip(calls, indices, strict=True):
        if type(call) is not dict or index is None:
            order.append(call)
            continue
        target = merged.get(index)
        if target is None:
            target = dict(call)
            if type(call.get("function")) is dict:
                target["function"] = dict(call["function"])
            merged[index] = target
            order.append(target)
            continue
        _merge_fragment(target, call)
    return order


def _merge_fragment(target: dict[str, Any], fragment: dict[str, Any]) -> None:
    for key, value in fragment.items():
        if value is None or key == "index":
            continue
        if key == "function" and type(value) is dict:
            function = target.get("function")
            if type(function) is not dict:
                target["function"] = dict(value)
                continue
            for name, part in value.items():
                if part is None:
                    continue
                previous = function.get(name)
                function[name] = previous + part if type(previous) is str else part
        elif key == "type":
            target.setdefault("type", value)
            if target["type"] is None:
                target["type"] = value
        else:
            previous = target.get(key)
            target[key] = previous + value if type(previous) is str else value
