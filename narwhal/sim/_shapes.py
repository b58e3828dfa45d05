"""Each dialect's exact response shapes (pure).

The key sets and orders follow real vLLM 0.32 answers (``tests/sim/captures/``, and vLLM's
source where no capture shows a case), ``reference/vllm-0.33-captures/`` for SGLang 0.5.23, and
OpenAI's published chunk and response objects. Stream chunks come back as :class:`Chunk`
values (a JSON object and the output step after which it may be sent): one at a time
(:func:`iter_stream_chunks`, so that the engine shapes a stream as it is played), or all at once
(:func:`stream_chunks`, so that faults can be applied before serialisation).

vLLM serialises a stream chunk with the keys it set (``exclude_unset``): ``token_ids`` is on
every output chunk (null unless asked), ``stop_reason`` on the finish chunk only,
``prompt_token_ids`` and ``prompt_text`` on the first chunk only, ``system_fingerprint`` on the
finish chunk (on the usage chunk instead when ``include_usage`` is on); the usage chunk drops its
nulls; a non-streaming body is a full dump, every null included.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import orjson

from narwhal.sim import _text
from narwhal.sim._answer import SILENT, Answer, Group, Token
from narwhal.sim._request import Dialect, SimFailure

__all__ = [
    "Chunk",
    "error_body",
    "error_frame",
    "iter_stream_chunks",
    "response_body",
    "route_not_found",
    "stream_chunks",
]


@attrs.define
class Chunk:
    """One stream event before serialisation.

    Attributes:
        step: the request's output step after which it may be sent (see :mod:`._answer`).
        obj: the JSON object.
        ids: the output token IDs it carries.
        last_position: the highest output position it carries (or announces), -1 for none.
        finish: it carries the finish_reason.
    """

    step: int
    obj: dict[str, Any]
    ids: list[int] = attrs.field(factory=list)
    last_position: int = -1
    finish: bool = False


# --- shared pieces ----------------------------------------------------------------------------


def _top_entry(piece: str, value: float) -> dict[str, Any]:
    return {"token": piece, "logprob": value, "bytes": list(piece.encode())}


def _chat_logprob_entries(tokens: tuple[Token, ...], top: int) -> list[dict[str, Any]]:
    entries = []
    for token in tokens:
        value = _text.logprob(token.position, token.text)
        runners = _text.alternatives(token.position, token.text, top - 1) if top > 0 else []
        entry = _top_entry(token.text, value)
        entry["top_logprobs"] = (
            [_top_entry(token.text, value)] + [_top_entry(p, v) for p, v in runners]
            if top > 0
            else []
        )
        entries.append(entry)
    return entries


def _chat_logprobs(
    dialect: Dialect, tokens: tuple[Token, ...], top: int | None
) -> dict[str, Any] | None:
    if top is None:
        return None
    result: dict[str, Any] = {"content": _chat_logprob_entries(tokens, top)}
    if dialect == "openai":
        result["refusal"] = None
    return result


def _completion_logprobs(
    dialect: Dialect, tokens: tuple[Token, ...], top: int | None, offset: int
) -> dict[str, Any] | None:
    if top is None:
        return None
    offsets, values, pieces, tops = [], [], [], []
    for token in tokens:
        value = _text.logprob(token.position, token.text)
        offsets.append(offset)
        offset += len(token.text)
        values.append(value)
        pieces.append(token.text)
        runners = _text.alternatives(token.position, token.text, max(top, 1) - 1)
        tops.append({token.text: value, **dict(runners)})
    if dialect == "openai":
        return {
            "tokens": pieces,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": pieces,
        "top_logprobs": tops,
    }


def _usage(
    dialect: Dialect, answer: Answer, completion: int, form: str, reasoning: int | None = None
) -> dict[str, Any]:
    """Usage objects: ``final`` (the usage chunk; vLLM's completions continuous usage too),
    ``running`` (continuous), ``body``; ``reasoning`` is vLLM's reasoning-token count, given
    when a reasoning parser serves chat."""
    prompt = answer.prompt_tokens
    if dialect == "openai":
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": answer.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    details = None if reasoning is None else {"reasoning_tokens": reasoning}
    if dialect == "sglang":
        usage["prompt_tokens_details"] = None
        usage["reasoning_tokens"] = answer.reasoning_tokens
        usage["completion_tokens_details"] = None
    elif form == "running":
        usage["completion_tokens_details"] = details
    elif form == "body":
        usage["prompt_tokens_details"] = None
        usage["completion_tokens_details"] = details
    elif details is not None:  # the usage chunk drops its nulls
        usage["completion_tokens_details"] = details
    return usage


def _reasoning(answer: Answer, tokens: int | None = None) -> int | None:
    """vLLM's reasoning-token count (of the first ``tokens``), when a reasoning parser serves
    chat; None otherwise."""
    request = answer.request
    if not request.reasoning_parser or request.route != "chat":
        return None
    return sum(1 for token in answer.tokens[:tokens] if token.kind == "reasoning")


def _matched_stop(answer: Answer) -> str | int | None:
    if answer.finish_reason != "stop":
        return None
    return answer.stop_reason if answer.stop_reason is not None else _text.EOS_TOKEN_ID


def _head(answer: Answer, object_name: str) -> dict[str, Any]:
    return {
        "id": answer.response_id,
        "object": object_name,
        "created": answer.created,
        "model": answer.model,
    }


def _marked(answer: Answer) -> Iterator[tuple[int, Group | None, bool]]:
    """``(number, group, last)`` for each group, as it is made; one ``(0, None, True)`` for an
    answer with none."""
    groups = answer.iter_groups()
    current = next(groups, None)
    number = 0
    for following in groups:
        yield number, current, False
        current, number = following, number + 1
    yield number, current, True


def _role_time(answer: Answer, first: Group | None) -> int:
    """When the role chunk goes: with the first visible group (``first``), else the finish."""
    return first.step if first is not None else answer.end_step


# --- vLLM -------------------------------------------------------------------------------------


def _vllm_call_header(answer: Answer, group: Group) -> dict[str, Any]:
    call = answer.calls[group.call]
    return {"id": call.id, "type": "function", "index": call.index, "function": {"name": call.name}}


def _vllm_delta(answer: Answer, group: Group) -> dict[str, Any]:
    """The delta vLLM's parsers make of a group; empty when it shows nothing."""
    if group.kind in SILENT:
        return {}
    if group.kind == "reasoning":
        return {"reasoning": group.text}
    if group.kind == "refusal":
        return {"refusal": group.text}
    if group.kind == "tool_name":
        # A forced call (tool_choice required or named): the name alone, content null.
        return {"content": None, "tool_calls": [_vllm_call_header(answer, group)]}
    if group.kind == "tool":
        arguments = {"index": group.call, "function": {"arguments": group.text}}
        if answer.request.forced_tools is not None:
            return {"content": None, "tool_calls": [arguments]}
        if not group.opens_call:
            return {"tool_calls": [arguments]}
        # hermes: the name and the first argument fragment in one delta.
        return {"content": None, "tool_calls": [_vllm_call_header(answer, group), arguments]}
    return {"content": group.text}


def _vllm_prompt_entries(answer: Answer) -> list[tuple[str, float | None, dict[str, float] | None]]:
    """An echoed prompt's completions logprob entries: (token, logprob, top), the first null.

    The prompt's own token and the most likely ones, at most ``logprobs + 1`` of them.
    """
    request = answer.request
    pieces = request.prompt_pieces()
    scored = _text.prompt_logprobs(pieces, request.prompt_logprobs or 0)
    entries: list[tuple[str, float | None, dict[str, float] | None]] = []
    for (_, piece), scores in zip(pieces, scored, strict=True):
        if scores is None:
            entries.append((piece, None, None))
            continue
        values = list(scores.values())[: (request.logprobs or 0) + 1]
        top = {v["decoded_token"]: v["logprob"] for v in values}
        entries.append((piece, values[0]["logprob"], top))
    return entries


def _vllm_completion_logprobs(
    answer: Answer, tokens: tuple[Token, ...], offset: int, echoed: bool
) -> dict[str, Any] | None:
    """Completions logprobs; an echo (of the first chunk, or a body) scores the prompt too."""
    top = answer.request.logprobs
    if top is None:
        return None
    offsets: list[int] = []
    values: list[float | None] = []
    pieces: list[str] = []
    tops: list[dict[str, float] | None] = []
    entries: list[tuple[str, float | None, dict[str, float] | None]] = (
        _vllm_prompt_entries(answer) if echoed else []
    )
    for token in tokens:
        sampled = _text.logprob(token.position, token.text)
        runners = _text.alternatives(token.position, token.text, max(top, 1) - 1)
        entries.append((token.text, sampled, {token.text: sampled, **dict(runners)}))
    for piece, value, best in entries:
        offsets.append(offset)
        offset += len(piece)
        values.append(value)
        pieces.append(piece)
        tops.append(best)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": pieces,
        "top_logprobs": tops,
    }


def _vllm_chat(answer: Answer) -> Iterator[Chunk]:
    request = answer.request
    head = _head(answer, "chat.completion.chunk")
    role_choice = {
        "index": 0,
        "delta": {"role": request.role, "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    role = {**head, "choices": [role_choice]}
    if request.continuous_usage:
        role["usage"] = _usage("vllm", answer, 0, "running", _reasoning(answer, 0))
    if request.ids_keys:
        role["prompt_token_ids"] = request.prompt_ids() if request.want_ids else None
        role["prompt_text"] = None
    at = _role_time(answer, next(answer.iter_groups(), None))
    yield Chunk(at, role)
    if request.echo_text:
        # vLLM echoes the last message in a chunk of its own, without token_ids.
        echo_choice = {
            "index": 0,
            "delta": {"content": request.echo_text},
            "logprobs": None,
            "finish_reason": None,
        }
        echo: dict[str, Any] = {**head, "choices": [echo_choice]}
        if request.continuous_usage:
            echo["usage"] = _usage("vllm", answer, 0, "running", _reasoning(answer, 0))
        yield Chunk(at, echo)
    sent = 0
    for _, group, last in _marked(answer):  # nothing generated: one finish, no text, no IDs
        tokens = group.tokens if group else ()
        sent += len(tokens)
        delta = _vllm_delta(answer, group) if group else {"content": ""}
        logprobs = _chat_logprobs("vllm", tokens, request.logprobs)
        if not delta and not last and logprobs is None and not request.want_ids:
            continue  # tokens whose text is held back: vLLM sends nothing for them
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": answer.finish_reason if last else None,
        }
        if last:
            choice["stop_reason"] = answer.stop_reason
        ids = group.ids if group else []
        if request.ids_keys:
            choice["token_ids"] = ids if request.want_ids else None
        obj: dict[str, Any] = {**head, "choices": [choice]}
        if request.continuous_usage:
            obj["usage"] = _usage("vllm", answer, sent, "running", _reasoning(answer, sent))
        if last and not request.include_usage:
            obj["system_fingerprint"] = answer.fingerprint
        step = group.step if group else answer.end_step
        position = group.last if group else -1
        yield Chunk(step, obj, ids, position, finish=last)


def _vllm_completions(answer: Answer) -> Iterator[Chunk]:
    """Every group is a chunk, held-back tokens included (their text is empty)."""
    request = answer.request
    head = _head(answer, "text_completion")
    offset = 0
    sent = 0
    for number, group, last in _marked(answer):
        tokens = group.tokens if group else ()
        text = group.text if group else ""
        ids = group.ids if group else []
        echoed = request.echo and number == 0
        if echoed and not request.want_ids:
            text = request.echo_text + text  # vLLM drops the echo when IDs are returned
        logprobs = _vllm_completion_logprobs(answer, tokens, offset, echoed)
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": answer.finish_reason if last else None,
            "stop_reason": answer.stop_reason if last else None,
        }
        if request.ids_keys:
            # The first chunk returns the prompt's IDs when asked, and always with an echo.
            first = number == 0 and (request.want_ids or request.echo)
            choice["prompt_token_ids"] = request.prompt_ids() if first else None
            choice["token_ids"] = ids if request.want_ids else None
        if logprobs is not None and logprobs["tokens"]:
            offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        sent += len(tokens)
        obj: dict[str, Any] = {**head, "choices": [choice]}
        if request.continuous_usage:
            obj["usage"] = _usage("vllm", answer, sent, "final")
        if last and not request.include_usage:
            obj["system_fingerprint"] = answer.fingerprint
        step = group.step if group else answer.end_step
        yield Chunk(step, obj, ids, group.last if group else -1, finish=last)


def _vllm_usage_chunk(answer: Answer, object_name: str) -> dict[str, Any]:
    return {
        **_head(answer, object_name),
        "choices": [],
        "usage": _usage("vllm", answer, answer.output_tokens, "final", _reasoning(answer)),
        "system_fingerprint": answer.fingerprint,
    }


# --- SGLang -----------------------------------------------------------------------------------


def _sglang_delta(**fields: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": None, "content": None, "reasoning_content": None}
    delta.update(fields)
    return delta


def _sglang_call_header(answer: Answer, group: Group) -> dict[str, Any]:
    call = answer.calls[group.call]
    return {
        "id": call.id,
        "index": call.index,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }


def _sglang_chat(answer: Answer) -> Iterator[Chunk]:
    request = answer.request
    head = _head(answer, "chat.completion.chunk")
    visible = (g for g in answer.iter_groups() if g.kind != "tool_end")
    first = next((g for g in answer.iter_groups() if g.kind != "tool_end"), None)
    sent = 0

    def chunk(at: int, delta: dict[str, Any], group: Group | None, **finish: Any) -> Chunk:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": _chat_logprobs("sglang", group.tokens, request.logprobs) if group else None,
            "finish_reason": finish.get("finish_reason"),
            "matched_stop": finish.get("matched_stop"),
        }
        usage = _usage("sglang", answer, sent, "running") if request.continuous_usage else None
        obj = {**head, "choices": [choice], "usage": usage}
        return Chunk(at, obj, group.ids if group else [], group.last if group else -1)

    yield chunk(
        _role_time(answer, first),
        {"role": "assistant", "content": "", "reasoning_content": None},
        None,
    )
    for group in visible:
        sent = group.last + 1
        if group.kind == "reasoning":
            delta = _sglang_delta(reasoning_content=group.text)
        elif group.kind == "refusal":
            delta = _sglang_delta(refusal=group.text)
        elif group.kind == "tool_name":
            delta = _sglang_delta(tool_calls=[_sglang_call_header(answer, group)])
        elif group.kind == "tool":
            if group.opens_call:
                header = _sglang_call_header(answer, group)
                opening = chunk(group.step, _sglang_delta(tool_calls=[header]), None)
                opening.last_position = group.first
                yield opening
            fragment = {
                "id": None,
                "index": group.call,
                "type": "function",
                "function": {"name": None, "arguments": group.text},
            }
            delta = _sglang_delta(tool_calls=[fragment])
        else:
            delta = _sglang_delta(content=group.text)
        yield chunk(group.step, delta, group)
    sent = answer.output_tokens
    end = chunk(
        answer.end_step,
        _sglang_delta(),
        None,
        finish_reason=answer.finish_reason,
        matched_stop=_matched_stop(answer),
    )
    end.finish = True
    yield end


def _sglang_completions(answer: Answer) -> Iterator[Chunk]:
    request = answer.request
    head = _head(answer, "text_completion")
    offset = 0
    for number, group, last in _marked(answer):
        tokens = group.tokens if group else ()
        text = group.text if group else ""
        ids = group.ids if group else []
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": _completion_logprobs("sglang", tokens, request.logprobs, offset),
            "finish_reason": answer.finish_reason if last else None,
            "matched_stop": _matched_stop(answer) if last else None,
        }
        if request.want_ids:
            choice["token_ids"] = ids
            if number == 0:
                choice["prompt_token_ids"] = request.prompt_ids()
        offset += len(text)
        completion = group.last + 1 if group else 0
        usage = (
            _usage("sglang", answer, completion, "running") if request.continuous_usage else None
        )
        obj = {**head, "choices": [choice], "usage": usage}
        at = group.step if group else answer.end_step
        yield Chunk(at, obj, ids, group.last if group else -1, finish=last)


def _sglang_usage_chunk(answer: Answer, object_name: str) -> dict[str, Any]:
    return {
        **_head(answer, object_name),
        "choices": [],
        "usage": _usage("sglang", answer, answer.output_tokens, "final"),
    }


# --- OpenAI -----------------------------------------------------------------------------------


def _openai_call_header(answer: Answer, group: Group) -> dict[str, Any]:
    call = answer.calls[group.call]
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }


def _openai_chat(answer: Answer) -> Iterator[Chunk]:
    request = answer.request
    head = {
        **_head(answer, "chat.completion.chunk"),
        "service_tier": "default",
        "system_fingerprint": answer.fingerprint,
    }
    # OpenAI never streams reasoning: those tokens take time but show nothing.
    visible = (g for g in answer.iter_groups() if g.kind not in ("reasoning", "tool_end"))
    first = next((g for g in answer.iter_groups() if g.kind not in ("reasoning", "tool_end")), None)

    def chunk(at: int, delta: dict[str, Any], group: Group | None, finish: Any = None) -> Chunk:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": _chat_logprobs("openai", group.tokens, request.logprobs) if group else None,
            "finish_reason": finish,
        }
        obj: dict[str, Any] = {**head, "choices": [choice]}
        if request.include_usage:
            obj["usage"] = None
        return Chunk(at, obj, group.ids if group else [], group.last if group else -1)

    # What shows is of one kind (text, a refusal, or tool calls): the first group says which.
    refusing = first is not None and first.kind == "refusal"
    calling = first is not None and first.kind in ("tool_name", "tool")
    role_delta: dict[str, Any] = {
        "role": "assistant",
        "content": None if refusing or calling else "",
        "refusal": "" if refusing else None,
    }
    yield chunk(_role_time(answer, first), role_delta, None)
    for group in visible:
        if group.kind == "tool_name":
            delta: dict[str, Any] = {"tool_calls": [_openai_call_header(answer, group)]}
        elif group.kind == "tool":
            if group.opens_call:
                header = _openai_call_header(answer, group)
                opening = chunk(group.step, {"tool_calls": [header]}, None)
                opening.last_position = group.first
                yield opening
            fragment = {"index": group.call, "function": {"arguments": group.text}}
            delta = {"tool_calls": [fragment]}
        elif group.kind == "refusal":
            delta = {"refusal": group.text}
        else:
            delta = {"content": group.text}
        yield chunk(group.step, delta, group)
    end = chunk(answer.end_step, {}, None, answer.finish_reason)
    end.finish = True
    yield end


def _openai_completions(answer: Answer) -> Iterator[Chunk]:
    request = answer.request
    offset = 0

    def chunk(at: int, text: str, group: Group | None, finish: Any = None) -> Chunk:
        tokens = group.tokens if group else ()
        choice = {
            "text": text,
            "index": 0,
            "logprobs": _completion_logprobs("openai", tokens, request.logprobs, offset)
            if group
            else None,
            "finish_reason": finish,
        }
        obj: dict[str, Any] = {
            "id": answer.response_id,
            "object": "text_completion",
            "created": answer.created,
            "choices": [choice],
            "model": answer.model,
            "system_fingerprint": answer.fingerprint,
        }
        if request.include_usage:
            obj["usage"] = None
        return Chunk(at, obj, group.ids if group else [], group.last if group else -1)

    for group in answer.iter_groups():
        yield chunk(group.step, group.text, group)
        offset += len(group.text)
    end = chunk(answer.end_step, "", None, answer.finish_reason)
    end.finish = True
    yield end


def _openai_usage_chunk(answer: Answer, object_name: str) -> dict[str, Any]:
    usage = _usage("openai", answer, answer.output_tokens, "final")
    if object_name == "text_completion":
        obj: dict[str, Any] = {
            "id": answer.response_id,
            "object": object_name,
            "created": answer.created,
            "choices": [],
            "model": answer.model,
            "system_fingerprint": answer.fingerprint,
            "usage": usage,
        }
        return obj
    return {
        **_head(answer, object_name),
        "service_tier": "default",
        "system_fingerprint": answer.fingerprint,
        "choices": [],
        "usage": usage,
    }


# --- streams ----------------------------------------------------------------------------------

_STREAMS: dict[tuple[str, str], Callable[[Answer], Iterator[Chunk]]] = {
    ("vllm", "chat"): _vllm_chat,
    ("vllm", "completions"): _vllm_completions,
    ("sglang", "chat"): _sglang_chat,
    ("sglang", "completions"): _sglang_completions,
    ("openai", "chat"): _openai_chat,
    ("openai", "completions"): _openai_completions,
}
_USAGE_CHUNKS = {
    "vllm": _vllm_usage_chunk,
    "sglang": _sglang_usage_chunk,
    "openai": _openai_usage_chunk,
}


def iter_stream_chunks(dialect: Dialect, answer: Answer) -> Iterator[Chunk]:
    """The chunks of the streamed answer, each shaped when it is asked for (the usage-only
    chunk last, when asked)."""
    request = answer.request
    yield from _STREAMS[dialect, request.route](answer)
    if request.include_usage:
        object_name = "chat.completion.chunk" if request.route == "chat" else "text_completion"
        yield Chunk(answer.end_step, _USAGE_CHUNKS[dialect](answer, object_name))


def stream_chunks(dialect: Dialect, answer: Answer) -> list[Chunk]:
    """Every chunk of the streamed answer, the usage-only chunk included when asked."""
    return list(iter_stream_chunks(dialect, answer))


# --- non-streaming bodies ---------------------------------------------------------------------


def _all_tokens(answer: Answer) -> tuple[Token, ...]:
    return answer.tokens


def _message_text(answer: Answer) -> str | None:
    content = answer.text_of("content")
    if content:
        return content
    if answer.calls or answer.reasoning_tokens or answer.text_of("refusal"):
        return None
    return ""


def _tool_calls(answer: Answer, with_index: bool) -> list[dict[str, Any]]:
    calls = []
    for call in answer.calls:
        entry: dict[str, Any] = {"id": call.id}
        if with_index:
            entry["index"] = call.index
        entry["type"] = "function"
        entry["function"] = {"name": call.name, "arguments": answer.call_arguments(call.index)}
        calls.append(entry)
    return calls


def _vllm_prompt_logprobs(answer: Answer) -> list[dict[str, dict[str, Any]] | None] | None:
    count = answer.request.prompt_logprobs
    if count is None:
        return None
    return _text.prompt_logprobs(answer.request.prompt_pieces(), count)


def _vllm_body(answer: Answer) -> dict[str, Any]:
    request = answer.request
    tokens = _all_tokens(answer)
    ids = answer.ids if request.want_ids else None
    prompt_ids = request.prompt_ids() if request.want_ids else None
    if request.route == "chat":
        content = _message_text(answer)
        if content is None and request.forced_tools is not None:
            content = ""  # vLLM: null when a parser found the calls, "" when they were forced
        if request.echo:
            content = request.echo_text + (content or "")
        message: dict[str, Any] = {
            "role": request.role,
            "content": content,
            "refusal": answer.text_of("refusal") or None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if answer.calls:
            message["tool_calls"] = _tool_calls(answer, with_index=False)
        message["reasoning"] = answer.text_of("reasoning") or None
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": _chat_logprobs("vllm", tokens, request.logprobs),
            "finish_reason": answer.finish_reason,
            "stop_reason": answer.stop_reason,
        }
        if request.ids_keys:
            choice["token_ids"] = ids
        choice["routed_experts"] = None
        body: dict[str, Any] = {
            **_head(answer, "chat.completion"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": answer.fingerprint,
            "usage": _usage("vllm", answer, answer.output_tokens, "body", _reasoning(answer)),
            "prompt_logprobs": _vllm_prompt_logprobs(answer),
        }
        if request.ids_keys:
            body["prompt_token_ids"] = prompt_ids
            body["prompt_text"] = None
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return body
    echo = request.echo_text if request.echo and not request.want_ids else ""
    choice = {
        "index": 0,
        "text": echo + answer.text_of("content"),
        "logprobs": _vllm_completion_logprobs(answer, tokens, 0, request.echo),
        "finish_reason": answer.finish_reason,
        "stop_reason": answer.stop_reason,
    }
    if request.ids_keys:
        choice["token_ids"] = ids
    choice["prompt_logprobs"] = _vllm_prompt_logprobs(answer)
    if request.ids_keys:
        choice["prompt_token_ids"] = prompt_ids
    choice["routed_experts"] = None
    return {
        **_head(answer, "text_completion"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": answer.fingerprint,
        "usage": _usage("vllm", answer, answer.output_tokens, "body"),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _sglang_body(answer: Answer) -> dict[str, Any]:
    request = answer.request
    tokens = _all_tokens(answer)
    choice: dict[str, Any] = {"index": 0}
    if request.route == "chat":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": _message_text(answer),
            "reasoning_content": answer.text_of("reasoning") or None,
        }
        if answer.text_of("refusal"):
            message["refusal"] = answer.text_of("refusal")
        if answer.calls:
            message["tool_calls"] = _tool_calls(answer, with_index=True)
        choice["message"] = message
        choice["logprobs"] = _chat_logprobs("sglang", tokens, request.logprobs)
    else:
        choice["text"] = answer.text_of("content")
        choice["logprobs"] = _completion_logprobs("sglang", tokens, request.logprobs, 0)
    choice["finish_reason"] = answer.finish_reason
    choice["matched_stop"] = _matched_stop(answer)
    if request.want_ids:
        choice["prompt_token_ids"] = request.prompt_ids()
        choice["response_token_ids" if request.route == "chat" else "token_ids"] = answer.ids
    object_name = "chat.completion" if request.route == "chat" else "text_completion"
    return {
        **_head(answer, object_name),
        "choices": [choice],
        "usage": _usage("sglang", answer, answer.output_tokens, "final"),
        "metadata": None,
    }


def _openai_body(answer: Answer) -> dict[str, Any]:
    request = answer.request
    tokens = tuple(t for t in answer.tokens if t.kind != "reasoning")
    if request.route == "completions":
        return {
            **_head(answer, "text_completion"),
            "choices": [
                {
                    "text": answer.text_of("content"),
                    "index": 0,
                    "logprobs": _completion_logprobs("openai", tokens, request.logprobs, 0),
                    "finish_reason": answer.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": answer.prompt_tokens,
                "completion_tokens": answer.output_tokens,
                "total_tokens": answer.prompt_tokens + answer.output_tokens,
            },
            "system_fingerprint": answer.fingerprint,
        }
    message: dict[str, Any] = {
        "role": "assistant",
        "content": answer.text_of("content")
        or (None if answer.calls or answer.text_of("refusal") else ""),
        "refusal": answer.text_of("refusal") or None,
        "annotations": [],
    }
    if answer.calls:
        message["tool_calls"] = _tool_calls(answer, with_index=False)
    return {
        **_head(answer, "chat.completion"),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _chat_logprobs("openai", tokens, request.logprobs),
                "finish_reason": answer.finish_reason,
            }
        ],
        "usage": _usage("openai", answer, answer.output_tokens, "final"),
        "service_tier": "default",
        "system_fingerprint": answer.fingerprint,
    }


_BODIES = {"vllm": _vllm_body, "sglang": _sglang_body, "openai": _openai_body}


def response_body(dialect: Dialect, answer: Answer) -> dict[str, Any]:
    """The non-streaming response object."""
    return _BODIES[dialect](answer)


# --- errors -----------------------------------------------------------------------------------

_OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error"}
_OPENAI_CODES = {404: "model_not_found"}


def _error_object(dialect: Dialect, failure: SimFailure) -> dict[str, Any]:
    if dialect == "sglang":
        return {
            "object": "error",
            "message": failure.message,
            "type": failure.type,
            "param": failure.param,
            "code": failure.status,
        }
    if dialect == "openai":
        param = failure.param
        if param is not None and param.startswith("body."):
            param = param[len("body.") :]
        return {
            "error": {
                "message": failure.message,
                "type": _OPENAI_TYPES.get(failure.status, "server_error"),
                "param": param,
                "code": _OPENAI_CODES.get(failure.status),
            }
        }
    return {
        "error": {
            "message": failure.message,
            "type": failure.type,
            "param": failure.param,
            "code": failure.status,
        }
    }


def error_body(dialect: Dialect, failure: SimFailure) -> bytes:
    """The error response body (vLLM nested with an int code, SGLang flat, OpenAI's envelope)."""
    return orjson.dumps(_error_object(dialect, failure))


def error_frame(dialect: Dialect, failure: SimFailure) -> bytes:
    """The in-band error event. Both engines write it with ``json.dumps``, spaces included."""
    obj = _error_object(dialect, failure)
    inner = obj if dialect == "sglang" else obj["error"]
    return b"data: " + json.dumps({"error": inner}).encode() + b"\n\n"


def route_not_found(dialect: Dialect, method: str, path: str, *, status: int) -> bytes:
    """The body of a 404 (unknown route) or a 405 (known route, wrong method)."""
    if dialect == "openai":
        message = f"Invalid URL ({method} {path})"
        return orjson.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
        )
    return orjson.dumps({"detail": "Not Found" if status == 404 else "Method Not Allowed"})
