"""Assemble one non-streaming response from an engine's stream (pure, no I/O).

Narwhal streams upstream, even for a client that did not ask for a stream (but for the requests
it sends as they are, :mod:`narwhal.upstream.whole`); for such a client the router feeds every
decoded chunk to an :class:`Assembler` and answers with :meth:`Assembler.result`. The rules
are the documented "Non-streaming assembly" (the seed's table, made exact):

* ``content``, ``reasoning``, ``reasoning_content`` and ``refusal`` deltas concatenate, each under
  its own key; completions ``text`` concatenates.
* Tool calls are grouped by stream index and returned in index order; ``id``, ``function.name``
  and ``function.arguments`` concatenate independently (null never does), ``type`` stays
  ``"function"``. Every assembled call must have an ID and a function name. Arguments stay the
  engine's strings.
* The legacy ``function_call`` concatenates its name and argument fragments into one field.
* Logprob arrays (chat ``content`` / ``refusal``; completions ``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``) concatenate in stream order.
* Every top-level key but ``choices`` and ``usage`` is response metadata; the last non-null value
  wins. ``finish_reason`` is the first non-null one, with ``stop_reason`` / ``matched_stop`` from
  the same chunk, so later usage-only frames cannot disturb them.
* ``usage`` is the engine's when it sent one, else computed from the prompt's length and the
  measured output.

The assembled body has a generic shape unless the engine's dialect says how its own
non-streaming answer looks (a :class:`ResponseShape`, from :mod:`narwhal.upstream.dialects`):
then every key of that answer is present, in its order, with the dialect's value for "unset"
where the stream did not carry it.

Anything else that carries a value is refused, so that what a client receives is never silently
missing a part of the answer: :class:`~narwhal.errors.EngineResponseError` with code
``unsupported_engine_field`` for an unknown choice, delta or tool-call field (``audio``,
``annotations``, a custom tool...), ``malformed_engine_response`` for a supported field of the
wrong shape. ``param`` is the field's path, e.g. ``choices[0].delta.audio``; choices are named by
their ``index``.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import attrs

from narwhal.errors import EngineResponseError

__all__ = ["OPTIONAL", "Assembler", "ResponseShape"]

_UNSUPPORTED: Final = "unsupported_engine_field"
_MALFORMED: Final = "malformed_engine_response"

_CHAT_LOGPROB_KEYS: Final = ("content", "refusal")
_COMPLETION_LOGPROB_KEYS: Final = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
_STOP_KEYS: Final = ("stop_reason", "matched_stop")

# Sentinel for "this chunk did not carry the key" (None is a value engines do send).
_ABSENT: Final[Any] = object()

OPTIONAL: Final[Any] = _ABSENT
"""In a :class:`ResponseShape` table: the key takes its place in the order when the assembled
body has it, and is left out otherwise."""

Keys = tuple[tuple[str, Any], ...]


@attrs.frozen
class ResponseShape:
    """How a dialect's own non-streaming answer looks, where its stream does not say.

    Each table lists one level's keys in the engine's order, each with the value it has when
    unset (or :data:`OPTIONAL`); the assembled keys a table does not list follow in their own
    order. An empty table leaves that level as assembled.

    Attributes:
        top: the response object's keys.
        choice: a choice's keys.
        message: a chat message's keys.
        usage: the usage object's keys.
        logprobs: the keys of a choice's ``logprobs`` object, in order (default: every key
            assembly understands for the route); arrays the engine sent under other understood
            keys still appear.
        empty_content: ``message.content`` when no content arrived, nor tool calls nor
            reasoning.
        empty_content_beside: ``message.content`` when no content arrived but tool calls, a
            function call or reasoning did.
    """

    top: Keys = ()
    choice: Keys = ()
    message: Keys = ()
    usage: Keys = ()
    logprobs: tuple[str, ...] | None = None
    empty_content: str | None = None
    empty_content_beside: str | None = None


_GENERIC: Final = ResponseShape()


def _shaped(built: dict[str, Any], keys: Keys) -> dict[str, Any]:
    """``built`` in the table's order, unset keys filled in; ``built`` itself when no table."""
    if not keys:
        return built
    shaped: dict[str, Any] = {}
    for key, unset in keys:
        if key in built:
            shaped[key] = built.pop(key)
        elif unset is not _ABSENT:
            shaped[key] = unset
    shaped.update(built)
    return shaped


def _malformed(param: str, expected: str) -> EngineResponseError:
    return EngineResponseError(
        f"The engine sent a malformed response: `{param}` must be {expected}.",
        param=param,
        code=_MALFORMED,
    )


def _unsupported(param: str) -> EngineResponseError:
    return EngineResponseError(
        f"The engine's response carries `{param}`, which Narwhal cannot assemble into a "
        "non-streaming response; request a stream to receive it.",
        param=param,
        code=_UNSUPPORTED,
    )


def _string(value: Any, param: str) -> str | None:
    """``value`` if it is a string or null; a malformed-response error otherwise."""
    if value is None or type(value) is str:
        return value
    raise _malformed(param, "a string or null")


def _join(parts: list[str]) -> str | None:
    """The concatenation, or ``None`` when nothing (or only empty strings) arrived."""
    return "".join(parts) or None


@attrs.define
class _ToolCall:
    """The fragments of one tool call (or of the legacy ``function_call``) seen so far."""

    id: list[str] = attrs.Factory(list)
    name: list[str] = attrs.Factory(list)
    arguments: list[str] = attrs.Factory(list)


@attrs.define
class _Choice:
    """Everything assembled so far for one choice index."""

    index: int
    content: list[str] = attrs.Factory(list)
    reasoning: list[str] = attrs.Factory(list)
    reasoning_content: list[str] = attrs.Factory(list)
    refusal: list[str] = attrs.Factory(list)
    text: list[str] = attrs.Factory(list)
    tool_calls: dict[int, _ToolCall] = attrs.Factory(dict)
    function_call: _ToolCall | None = None
    # Logprob arrays by key, None until the engine sends a non-null logprobs object; within it,
    # an array stays None until the engine sends one (OpenAI's `content` / `refusal` are nullable).
    logprobs: dict[str, list[Any] | None] | None = None
    finish_reason: str | None = None
    # stop_reason / matched_stop: key present once the engine sent it, value from the finish chunk.
    stops: dict[str, Any] = attrs.Factory(dict)
    token_ids: list[int] = attrs.Factory(list)
    token_ids_key: bool = False
    token_ids_seen: bool = False
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_key: bool = False


class Assembler:
    """Folds the chunks of one engine stream into one non-streaming response body.

    Feed every decoded data event (not ``[DONE]``, not an error frame) in stream order, after the
    router's token-ID check; then take :meth:`result`. Nothing here awaits or performs I/O.

    Args:
        route: ``"chat"`` for ``/v1/chat/completions``, ``"completions"`` for ``/v1/completions``.
        expose_token_ids: the client asked for ``return_token_ids``: the body carries the output
            ``token_ids`` and the ``prompt_token_ids`` where the engine sent them. Otherwise the
            IDs the router asked for itself are hidden: their keys are kept with a null value
            (how vLLM answers a request without ``return_token_ids``).
        prompt_tokens_estimate: the sizing estimate of the prompt's length in tokens, used for
            ``usage.prompt_tokens`` when the engine sends neither usage nor prompt token IDs.
        shape: the engine's own answer shape (``None``: the generic one).
    """

    def __init__(
        self,
        route: Literal["chat", "completions"],
        *,
        expose_token_ids: bool,
        prompt_tokens_estimate: int,
        shape: ResponseShape | None = None,
    ) -> None:
        self._chat = route == "chat"
        self._shape = _GENERIC if shape is None else shape
        self._expose = expose_token_ids
        self._prompt_estimate = prompt_tokens_estimate
        self._metadata: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._prompt_token_ids: list[int] | None = None
        self._prompt_token_ids_key = False
        self._output_tokens = 0
        self._token_ids_seen = False
        self._output_events = 0

    @property
    def output_tokens(self) -> int:
        """Output token IDs received so far, over all choices (0 while the engine sends none)."""
        return self._output_tokens

    @property
    def token_ids_seen(self) -> bool:
        """Whether any choice carried a ``token_ids`` list (``[]`` included)."""
        return self._token_ids_seen

    def feed(self, chunk: dict[str, Any]) -> None:
        """Fold one decoded chunk into the response.

        Args:
            chunk: the JSON object of one data event.

        Raises:
            EngineResponseError: ``unsupported_engine_field`` for a choice, delta or tool-call
                field that carries a value assembly does not understand;
                ``malformed_engine_response`` for a supported field of the wrong shape.
        """
        if type(chunk) is not dict:
            raise _malformed("", "a JSON object")
        choices: Any = _ABSENT
        metadata = self._metadata
        for key, value in chunk.items():
            if key == "choices":
                choices = value
            elif key == "usage":
                if value is not None:
                    if type(value) is not dict:
                        raise _malformed("usage", "an object or null")
                    self._usage = value
            elif key == "prompt_token_ids":
                self._prompt_token_ids_key = True
                if value is not None and self._prompt_token_ids is None:
                    if type(value) is not list:
                        raise _malformed("prompt_token_ids", "a list of token IDs or null")
                    self._prompt_token_ids = value
            elif value is not None:
                metadata[key] = value
            elif key not in metadata:
                metadata[key] = None
        if type(choices) is not list:
            raise _malformed("choices", "a list")
        for position, choice in enumerate(choices):
            self._feed_choice(position, choice)

    def _feed_choice(self, position: int, choice: Any) -> None:
        if type(choice) is not dict:
            raise _malformed(f"choices[{position}]", "an object")
        index = choice.get("index", position)
        if type(index) is not int or index < 0:
            raise _malformed(f"choices[{position}].index", "an integer >= 0")
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice(index)
        output = False
        finish: Any = None
        stop_reason: Any = _ABSENT
        matched_stop: Any = _ABSENT
        for key, value in choice.items():
            if key == "index":
                continue
            if key == "delta" and self._chat:
                if value is not None:
                    if type(value) is not dict:
                        raise _malformed(f"choices[{index}].delta", "an object or null")
                    output = self._feed_delta(state, value)
            elif key == "text" and not self._chat:
                text = _string(value, f"choices[{index}].text")
                if text:
                    state.text.append(text)
                    output = True
            elif key == "logprobs":
                if value is not None:
                    self._feed_logprobs(state, value)
            elif key == "finish_reason":
                finish = _string(value, f"choices[{index}].finish_reason")
            elif key == "stop_reason" or key == "matched_stop":
                if value is not None and (type(value) is not str and type(value) is not int):
                    raise _malformed(f"choices[{index}].{key}", "a string, an integer or null")
                if key not in state.stops:
                    state.stops[key] = None
                if key == "stop_reason":
                    stop_reason = value
                else:
                    matched_stop = value
            elif key == "token_ids":
                state.token_ids_key = True
                if value is not None:
                    if type(value) is not list:
                        raise _malformed(f"choices[{index}].token_ids", "a list of token IDs")
                    state.token_ids.extend(value)
                    state.token_ids_seen = self._token_ids_seen = True
                    self._output_tokens += len(value)
            elif key == "prompt_token_ids":
                state.prompt_token_ids_key = True
                if value is not None and state.prompt_token_ids is None:
                    if type(value) is not list:
                        raise _malformed(
                            f"choices[{index}].prompt_token_ids", "a list of token IDs or null"
                        )
                    state.prompt_token_ids = value
            elif value is not None:
                raise _unsupported(f"choices[{index}].{key}")
        if output:
            self._output_events += 1
        if finish is not None and state.finish_reason is None:
            # stop_reason / matched_stop belong to the chunk that finished the choice.
            state.finish_reason = finish
            if stop_reason is not _ABSENT:
                state.stops["stop_reason"] = stop_reason
            if matched_stop is not _ABSENT:
                state.stops["matched_stop"] = matched_stop

    def _feed_delta(self, state: _Choice, delta: dict[str, Any]) -> bool:
        """Fold one chat delta; return whether it was an output event."""
        output = False
        index = state.index
        for key, value in delta.items():
            if value is None:
                continue
            if key == "content" or key == "reasoning" or key == "reasoning_content":
                text = _string(value, f"choices[{index}].delta.{key}")
                if text:
                    getattr(state, key).append(text)
                    output = True
            elif key == "refusal":
                text = _string(value, f"choices[{index}].delta.refusal")
                if text:
                    state.refusal.append(text)
                    output = True
            elif key == "role":
                _string(value, f"choices[{index}].delta.role")
            elif key == "tool_calls":
                if type(value) is not list:
                    raise _malformed(f"choices[{index}].delta.tool_calls", "a list or null")
                for position, fragment in enumerate(value):
                    self._feed_tool_call(state, position, fragment)
                    output = True
            elif key == "function_call":
                path = f"choices[{index}].delta.function_call"
                if type(value) is not dict:
                    raise _malformed(path, "an object or null")
                if state.function_call is None:
                    state.function_call = _ToolCall()
                _feed_function(state.function_call, value, path)
                output = True
            else:
                raise _unsupported(f"choices[{index}].delta.{key}")
        return output

    def _feed_tool_call(self, state: _Choice, position: int, fragment: Any) -> None:
        path = f"choices[{state.index}].delta.tool_calls[{position}]"
        if type(fragment) is not dict:
            raise _malformed(path, "an object")
        index = fragment.get("index")
        if type(index) is not int or index < 0:
            raise _malformed(f"{path}.index", "an integer >= 0")
        call = state.tool_calls.get(index)
        if call is None:
            call = state.tool_calls[index] = _ToolCall()
        for key, value in fragment.items():
            if value is None or key == "index":
                continue
            if key == "id":
                call_id = _string(value, f"{path}.id")
                if call_id:
                    call.id.append(call_id)
            elif key == "type":
                if type(value) is not str:
                    raise _malformed(f"{path}.type", "a string or null")
                if value != "function":
                    raise _unsupported(f"{path}.type")
            elif key == "function":
                if type(value) is not dict:
                    raise _malformed(f"{path}.function", "an object or null")
                _feed_function(call, value, f"{path}.function")
            else:
                raise _unsupported(f"{path}.{key}")

    def _feed_logprobs(self, state: _Choice, logprobs: Any) -> None:
        path = f"choices[{state.index}].logprobs"
        if type(logprobs) is not dict:
            raise _malformed(path, "an object or null")
        keys = _CHAT_LOGPROB_KEYS if self._chat else _COMPLETION_LOGPROB_KEYS
        arrays = state.logprobs
        if arrays is None:
            arrays = state.logprobs = dict.fromkeys(keys)
        for key, value in logprobs.items():
            if value is None:
                continue
            if key not in arrays:
                raise _unsupported(f"{path}.{key}")
            if type(value) is not list:
                raise _malformed(f"{path}.{key}", "a list or null")
            array = arrays[key]
            if array is None:
                arrays[key] = array = []
            array.extend(value)

    def result(self) -> dict[str, Any]:
        """The assembled response body (``chat.completion`` or ``text_completion``).

        ``usage`` is always present: the engine's last non-null usage object if it sent one;
        otherwise ``prompt_tokens`` is the length of the prompt token IDs the engine sent (else
        the sizing estimate) and ``completion_tokens`` the number of output token IDs received.
        When the engine sent no token IDs at all, ``completion_tokens`` falls back to the number
        of output events (chunks carrying generated text or a tool-call fragment): a lower bound,
        since one event may hold several tokens, but the only measure left.

        The body shares the assembler's lists (token IDs, logprob arrays) instead of copying
        them: take the result once the stream has ended.

        Raises:
            EngineResponseError: ``malformed_engine_response`` when an assembled tool call lacks
                an ID or a function name, or a legacy ``function_call`` lacks a name.
        """
        shape = self._shape
        body = dict(self._metadata)
        body["object"] = "chat.completion" if self._chat else "text_completion"
        body["choices"] = [
            _shaped(self._assemble_choice(self._choices[index]), shape.choice)
            for index in sorted(self._choices)
        ]
        usage = self._usage if self._usage is not None else self._computed_usage()
        body["usage"] = _shaped(dict(usage), shape.usage) if shape.usage else usage
        if self._prompt_token_ids_key:
            body["prompt_token_ids"] = self._prompt_token_ids if self._expose else None
        return _shaped(body, shape.top)

    def _assemble_choice(self, state: _Choice) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": state.index}
        if self._chat:
            choice["message"] = self._assemble_message(state)
        else:
            choice["text"] = "".join(state.text)
        choice["logprobs"] = self._assemble_logprobs(state)
        choice["finish_reason"] = state.finish_reason
        choice.update(state.stops)
        if state.token_ids_key:
            exposed = self._expose and state.token_ids_seen
            choice["token_ids"] = state.token_ids if exposed else None
        if state.prompt_token_ids_key:
            choice["prompt_token_ids"] = state.prompt_token_ids if self._expose else None
        return choice

    def _assemble_logprobs(self, state: _Choice) -> dict[str, list[Any] | None] | None:
        arrays = state.logprobs
        keys = self._shape.logprobs
        if arrays is None or keys is None:
            return arrays
        logprobs = {key: arrays.get(key) for key in keys}
        for key, array in arrays.items():
            if array is not None:
                logprobs.setdefault(key, array)
        return logprobs

    def _assemble_message(self, state: _Choice) -> dict[str, Any]:
        shape = self._shape
        reasoning = _join(state.reasoning)
        reasoning_content = _join(state.reasoning_content)
        content = _join(state.content)
        if content is None:
            beside = bool(state.tool_calls) or state.function_call is not None
            beside = beside or reasoning is not None or reasoning_content is not None
            content = shape.empty_content_beside if beside else shape.empty_content
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": _join(state.refusal),
        }
        if reasoning is not None:
            message["reasoning"] = reasoning
        if reasoning_content is not None:
            message["reasoning_content"] = reasoning_content
        if state.function_call is not None:
            name = _join(state.function_call.name)
            if name is None:
                raise _malformed(
                    f"choices[{state.index}].message.function_call.name", "a non-empty string"
                )
            message["function_call"] = {
                "name": name,
                "arguments": "".join(state.function_call.arguments),
            }
        if state.tool_calls:
            calls = []
            for position, stream_index in enumerate(sorted(state.tool_calls)):
                call = state.tool_calls[stream_index]
                path = f"choices[{state.index}].message.tool_calls[{position}]"
                call_id = _join(call.id)
                if call_id is None:
                    raise _malformed(f"{path}.id", "a non-empty string")
                name = _join(call.name)
                if name is None:
                    raise _malformed(f"{path}.function.name", "a non-empty string")
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": "".join(call.arguments)},
                    }
                )
            message["tool_calls"] = calls
        return _shaped(message, shape.message)

    def _computed_usage(self) -> dict[str, int]:
        if self._prompt_token_ids is not None:
            prompt_tokens = len(self._prompt_token_ids)
        else:
            # Completions send prompt IDs per choice (one prompt each); chat sends them once.
            lengths = [
                len(state.prompt_token_ids)
                for state in self._choices.values()
                if state.prompt_token_ids is not None
            ]
            prompt_tokens = sum(lengths) if lengths else self._prompt_estimate
        completion_tokens = self._output_tokens if self._token_ids_seen else self._output_events
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }


def _feed_function(call: _ToolCall, function: dict[str, Any], path: str) -> None:
    """Fold a ``function`` object (of a tool-call fragment or a legacy ``function_call``)."""
    for key, value in function.items():
        if value is None:
            continue
        if key == "name":
            name = _string(value, f"{path}.name")
            if name:
                call.name.append(name)
        elif key == "arguments":
            arguments = _string(value, f"{path}.arguments")
            if arguments:
                call.arguments.append(arguments)
        else:
            raise _unsupported(f"{path}.{key}")
