"""What the simulated engine reads from a request body, and the test directives (pure).

Validation follows the real engines where it matters to a router (vLLM's messages and
parameters; SGLang's refusal of ``return_token_ids`` on streaming chat) and is otherwise lenient:
unknown fields are ignored, as vLLM and SGLang ignore them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

import attrs

from narwhal.sim import _text

__all__ = [
    "FAULTS",
    "Dialect",
    "Directives",
    "Fault",
    "ForcedTools",
    "Route",
    "SimFailure",
    "SimRequest",
    "parse_directives",
    "parse_request",
]

Dialect = Literal["vllm", "sglang", "openai"]
ForcedTools = Literal["required", "named"]
Route = Literal["chat", "completions"]
Fault = Literal[
    "http_500",
    "http_503",
    "http_400",
    "error_frame",
    "malformed_token_ids",
    "missing_token_ids",
    "negative_token_id",
    "non_json",
    "truncate",
    "no_done",
    "stall",
    "drop",
    "unsupported_field",
    "annotations",
]
FAULTS: frozenset[str] = frozenset(get_args(Fault))

_MAX_LOGPROBS = 20
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class SimFailure(Exception):
    """A request the simulated engine answers with an error instead of a completion.

    The fields are vLLM's (``type`` a Python-exception-style name, ``param`` possibly prefixed
    ``body.``); each dialect renders them in its own shape.
    """

    def __init__(self, status: int, message: str, type_: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param


def _summary(value: Any) -> str:
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def validation_error(
    kind: str, loc: str, msg: str, value: Any, ctx: Mapping[str, Any] | None = None
) -> SimFailure:
    """A FastAPI/pydantic validation failure, worded as vLLM's handler words it."""
    entry: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": _summary(value)}
    if ctx is not None:
        entry["ctx"] = dict(ctx)
    return SimFailure(400, f"1 validation error:\n  {entry!r}", "Bad Request", loc)


def parameter_error(param: str, message: str, value: Any = None) -> SimFailure:
    """A vLLM ``VLLMValidationError``: the message names the parameter (and the value)."""
    suffix = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
    return SimFailure(400, f"{message} ({suffix})", "BadRequestError", param)


# --- directives -------------------------------------------------------------------------------


@attrs.frozen
class Directives:
    """The ``narwhal_sim`` object of a request (merged over the engine's defaults).

    See :mod:`narwhal.sim.engine` for what each directive does.
    """

    output_tokens: int | None = None
    reasoning_tokens: int = 0
    tool_calls: int = 0
    refusal: str | None = None
    tokens_per_chunk: int | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    prompt_tokens: int | None = None
    fault: Fault | None = None
    fault_at: int = 0
    stall_s: float = math.inf
    ignore_token_ids: bool = False


_INT_DIRECTIVES = {
    "output_tokens": 0,
    "reasoning_tokens": 0,
    "tool_calls": 0,
    "tokens_per_chunk": 1,
    "prompt_tokens": 1,
    "fault_at": 0,
}
_FLOAT_DIRECTIVES = ("ttft_s", "itl_s", "stall_s")
_DIRECTIVE_KEYS = frozenset(attrs.fields_dict(Directives))


def parse_directives(*layers: Any) -> Directives:
    """Merge directive objects (later layers win) and validate them.

    Raises:
        SimFailure: 400 with ``param`` naming the offending key, e.g. ``narwhal_sim.fault``.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer is None:
            continue
        if not isinstance(layer, Mapping):
            raise SimFailure(400, "narwhal_sim must be an object", "BadRequestError", "narwhal_sim")
        merged.update(layer)
    values: dict[str, Any] = {}
    for key, value in merged.items():
        param = f"narwhal_sim.{key}"
        if key not in _DIRECTIVE_KEYS:
            raise SimFailure(400, f"unknown directive {key!r}", "BadRequestError", param)
        if key in _INT_DIRECTIVES:
            minimum = _INT_DIRECTIVES[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise SimFailure(
                    400, f"{key} must be an integer >= {minimum}", "BadRequestError", param
                )
        elif key in _FLOAT_DIRECTIVES:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise SimFailure(400, f"{key} must be a number >= 0", "BadRequestError", param)
            value = float(value)
        elif key == "fault":
            if value not in FAULTS:
                known = ", ".join(sorted(FAULTS))
                raise SimFailure(
                    400, f"unknown fault {value!r} (known: {known})", "BadRequestError", param
                )
        elif key == "refusal":
            if not isinstance(value, str):
                raise SimFailure(400, "refusal must be a string", "BadRequestError", param)
        elif key == "ignore_token_ids" and not isinstance(value, bool):
            raise SimFailure(400, f"{key} must be a Boolean", "BadRequestError", param)
        values[key] = value
    return Directives(**values)


# --- the request ------------------------------------------------------------------------------


@attrs.frozen
class SimRequest:
    """The parts of a completion request that shape the simulated answer.

    Attributes:
        route: which completion route.
        stream: ``stream`` is true.
        include_usage: a final usage-only chunk is wanted.
        continuous_usage: every chunk carries running usage.
        want_ids: token IDs are returned (the dialect honours ``return_token_ids``).
        ids_keys: the vLLM ``token_ids`` / ``prompt_token_ids`` keys exist at all (False to
            mimic vLLM before 0.10.2).
        max_tokens: the output cap, None for none.
        logprobs: chat ``top_logprobs`` (0 when only ``logprobs: true``) or completions
            ``logprobs``; None when not asked.
        stop: the stop string reported when the answer ends naturally.
        stream_interval: vLLM's per-request ``stream_interval`` (1 by default).
        tool_names: function names of the request's tools, in order (a named ``tool_choice``:
            that one name).
        forced_tools: ``tool_choice`` forces a tool call: ``"required"``, or ``"named"`` for
            ``{"type": "function", "function": {"name": ...}}``; None for ``auto``, ``none`` or
            absent (the simulated model then answers in text unless a directive asks).
        prompt_text: the text the prompt is sized from.
        prompt_token_ids: the prompt as the client sent it in IDs, else None.
        directives: the test directives.
    """

    route: Route
    stream: bool
    include_usage: bool
    continuous_usage: bool
    want_ids: bool
    ids_keys: bool
    max_tokens: int | None
    logprobs: int | None
    stop: str | None
    stream_interval: int
    tool_names: tuple[str, ...]
    prompt_text: str
    prompt_token_ids: tuple[int, ...] | None
    directives: Directives
    forced_tools: ForcedTools | None = None

    @property
    def prompt_tokens(self) -> int:
        """The prompt's size: exact for ID prompts, else estimated (or forced by a directive)."""
        if self.directives.prompt_tokens is not None:
            return self.directives.prompt_tokens
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return _text.estimate_tokens(len(self.prompt_text))

    def prompt_ids(self) -> list[int]:
        """The prompt's token IDs (computed on demand: long prompts cost CPU)."""
        if self.prompt_token_ids is not None and self.directives.prompt_tokens is None:
            return list(self.prompt_token_ids)
        return _text.prompt_ids(self.prompt_text, self.prompt_tokens)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise validation_error(
            "int_parsing",
            f"body.{key}",
            "Input should be a valid integer, unable to parse string as an integer",
            value,
        )
    return int(value)


def _optional_bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise validation_error(
            "bool_parsing", f"body.{key}", "Input should be a valid boolean", value
        )
    return value


def _messages(body: Mapping[str, Any]) -> list[Any]:
    if "messages" not in body:
        raise validation_error("missing", "body.messages", "Field required", dict(body))
    messages = body["messages"]
    if not isinstance(messages, list):
        raise validation_error(
            "list_type", "body.messages", "Input should be a valid list", messages
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise validation_error(
                "model_attributes_type",
                f"body.messages.{index}",
                "Input should be a valid dictionary or object to extract fields from",
                message,
            )
    return messages


def _prompt(body: Mapping[str, Any]) -> tuple[str, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(i) and i >= 0 for i in prompt):
        return "", tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise SimFailure(
            400,
            "The simulator answers one prompt per request. (parameter=prompt)",
            "BadRequestError",
            "prompt",
        )
    raise parameter_error(
        "prompt", "Either prompt or prompt_embeds must be provided and non-empty."
    )


def _stop(body: Mapping[str, Any]) -> str | None:
    stop = body.get("stop")
    if stop is None or stop == []:
        return None
    if isinstance(stop, str):
        return stop
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return str(stop[0])
    raise validation_error("string_type", "body.stop", "Input should be a valid string", stop)


def _tool_names(body: Mapping[str, Any], dialect: Dialect) -> tuple[str, ...]:
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") not in (None, "none") and dialect == "vllm":
            raise parameter_error("tool_choice", "When using `tool_choice`, `tools` must be set.")
        return ()
    if not isinstance(tools, list):
        raise validation_error("list_type", "body.tools", "Input should be a valid list", tools)
    if not tools and dialect == "vllm":
        raise parameter_error(
            "tools",
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
        )
    names = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name:
            names.append(name)
    return tuple(names)


def _tool_choice(
    body: Mapping[str, Any], names: tuple[str, ...]
) -> tuple[ForcedTools | None, tuple[str, ...]]:
    """Whether ``tool_choice`` forces a call, and the names the calls may use."""
    choice = body.get("tool_choice")
    if body.get("tools") is None:
        return None, names
    if choice == "required":
        return "required", names
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise parameter_error(
                "tool_choice",
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
            )
        return "named", (name,)
    return None, names


def _logprobs(body: Mapping[str, Any], route: Route) -> int | None:
    if route == "chat":
        wanted = _optional_bool(body, "logprobs")
        top = _optional_int(body, "top_logprobs")
        if top is not None and not wanted:
            raise parameter_error(
                "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."
            )
        if not wanted:
            return None
        count = 0 if top is None else top
        param = "top_logprobs"
    else:
        value = _optional_int(body, "logprobs")
        if value is None:
            return None
        count = value
        param = "logprobs"
    if count < 0 and count != -1:
        raise parameter_error(param, f"`{param}` must be a positive value or -1.", count)
    if count == -1:
        count = 5  # "the whole vocabulary": five is plenty for a simulator
    if count > _MAX_LOGPROBS:
        raise parameter_error(
            param,
            f"Requested sample logprobs of {count}, which is greater than max allowed: "
            f"{_MAX_LOGPROBS}",
        )
    return count


def _max_tokens(body: Mapping[str, Any], route: Route) -> int | None:
    chosen: int | None = None
    for key in ("max_tokens", "max_completion_tokens"):
        value = _optional_int(body, key)
        if value is not None and value < 1:
            raise parameter_error(key, f"{key} must be at least 1, got {value}.", value)
        if value is not None:
            chosen = value  # max_completion_tokens, checked last, wins
    if chosen is None and route == "completions":
        return _COMPLETIONS_DEFAULT_MAX_TOKENS
    return chosen


def parse_request(
    route: Route,
    body: Mapping[str, Any],
    *,
    dialect: Dialect,
    model: str,
    default_directives: Mapping[str, Any] | None = None,
) -> SimRequest:
    """Read a completion request the way the chosen engine would.

    Raises:
        SimFailure: the engine's error answer (400 for bad fields, 404 for another model).
    """
    directives = parse_directives(default_directives, body.get("narwhal_sim"))
    if route == "chat":
        messages = _messages(body)
        prompt_text, prompt_ids = _text.chat_prompt_text(messages), None
    else:
        prompt_text, prompt_ids = _prompt(body)

    requested_model = body.get("model")
    if requested_model is not None and requested_model != model:
        message = f"The model `{requested_model}` does not exist. Valid aliases: {model}."
        raise SimFailure(404, message, "NotFoundError", "model")

    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise validation_error(
            "model_type", "body.stream_options", "Input should be an object", options
        )
    if options and not stream and dialect != "sglang":
        raise parameter_error(
            "stream_options", "Stream options can only be defined when `stream=True`."
        )
    include_usage = bool(options and options.get("include_usage"))
    continuous = bool(options and options.get("continuous_usage_stats"))
    if dialect == "vllm":
        continuous = continuous and include_usage
    elif dialect == "openai":
        continuous = False

    n = _optional_int(body, "n")
    if n is not None and n != 1:
        if n < 1:
            raise parameter_error("n", f"n must be at least 1, got {n}.", n)
        raise parameter_error("n", "The simulator serves n=1 only.", n)

    interval = 1
    if dialect == "vllm":
        value = _optional_int(body, "stream_interval")
        if value is not None and value < 1:
            raise validation_error(
                "greater_than_equal",
                "body.stream_interval",
                "Input should be greater than or equal to 1",
                value,
                {"ge": 1},
            )
        interval = value or 1

    asked_ids = _optional_bool(body, "return_token_ids")
    ids_keys = dialect == "vllm" and not directives.ignore_token_ids
    if dialect == "vllm":
        want_ids = asked_ids and ids_keys
    elif dialect == "sglang":
        if asked_ids and stream and route == "chat":
            raise SimFailure(
                400,
                "return_token_ids is not supported with streaming on /v1/chat/completions; "
                "use return_input_ids_in_sglext / return_output_ids_in_sglext instead.",
                "BadRequestError",
                None,
            )
        want_ids = asked_ids
    else:
        want_ids = False

    names = _tool_names(body, dialect) if route == "chat" else ()
    forced, names = _tool_choice(body, names) if route == "chat" else (None, names)
    return SimRequest(
        route=route,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        want_ids=want_ids,
        ids_keys=ids_keys,
        max_tokens=_max_tokens(body, route),
        logprobs=_logprobs(body, route),
        stop=_stop(body),
        stream_interval=interval,
        tool_names=names,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_ids,
        directives=directives,
        forced_tools=forced,
    )
