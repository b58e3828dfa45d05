"""What the simulated engine reads from a request body, and the test directives (pure).

Validation follows the real engines where it matters to a router (vLLM 0.32's messages and
parameters, in vLLM's order; SGLang's refusal of ``return_token_ids`` on streaming chat) and is
otherwise lenient: unknown fields are ignored, as vLLM and SGLang ignore them.

vLLM checks a request in stages, and the stage decides how a stream hears of a failure: the
request model's validators (types, ``stream_options``, ``logprobs`` and ``prompt_logprobs``
rules, tools), then the model name (404), then the prompt's tokenization (``max_tokens`` and the
prompt against ``max_model_len``), then the sampling parameters (``temperature``, ``top_p``,
``max_tokens`` left after the prompt): all of these are an HTTP 400 (404). Last come the checks
the engine makes when the request is added (``logprobs`` and ``prompt_logprobs`` above 20): for a
stream, vLLM has already answered 200 and sends them in band (:attr:`SimFailure.in_band`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import attrs

from narwhal.sim import _text

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "FAULTS",
    "MAX_LOGPROBS",
    "VLLM_VERSION",
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

VLLM_VERSION = "0.32.0"
"""The vLLM release whose shapes the ``vllm`` dialect follows (``/version``, the fingerprint)."""
MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``."""
DEFAULT_MAX_MODEL_LEN = 131072
"""The context length a simulated engine reports and enforces unless told (Llama 3.1's)."""
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class SimFailure(Exception):
    """A request the simulated engine answers with an error instead of a completion.

    The fields are vLLM's (``type`` a Python-exception-style name, ``param`` possibly prefixed
    ``body.``); each dialect renders them in its own shape.
    """

    def __init__(
        self, status: int, message: str, type_: str, param: str | None, *, in_band: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.in_band = in_band
        """vLLM finds it while generating a stream: an HTTP 200 carrying an error frame."""


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


def parameter_error(
    param: str | None, message: str, value: Any = None, *, in_band: bool = False
) -> SimFailure:
    """A vLLM ``VLLMValidationError``: the message names the parameter (and the value)."""
    extras = [] if param is None else [f"parameter={param}"]
    if value is not None:
        extras.append(f"value={value}")
    if extras:
        message = f"{message} ({', '.join(extras)})"
    return SimFailure(400, message, "BadRequestError", param, in_band=in_band)


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
    hidden_tokens: int = 0


_INT_DIRECTIVES = {
    "hidden_tokens": 0,
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
        forced_tools: see above.
        echo: ``echo`` is true.
        echo_text: what an echo puts before the answer: the prompt (completions; nothing for
            a prompt of IDs, which the simulator cannot decode), the last message's content
            when its role is the answer's (chat).
        prompt_logprobs: how many alternatives each prompt token's logprob entry lists
            (vLLM's ``prompt_logprobs``, or its ``echo`` default), None for no entries.
        request_id: the body's ``request_id`` (vLLM's ``id`` when no header gives one).
        role: the answer's role (vLLM: the last message's when ``add_generation_prompt`` is
            false).
        reasoning_parser: the engine runs a reasoning parser (vLLM: chat usage then reports
            ``completion_tokens_details.reasoning_tokens``).
        ignore_eos: vLLM's and SGLang's ``ignore_eos``: a plain answer runs on to its output
            cap (finish ``length``) instead of ending at its natural length.
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
    echo: bool = False
    echo_text: str = ""
    prompt_logprobs: int | None = None
    request_id: str | None = None
    role: str = "assistant"
    reasoning_parser: bool = False
    ignore_eos: bool = False

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

    def prompt_pieces(self) -> list[tuple[int, str]]:
        """The prompt's tokens as ``(id, text)`` (an ID prompt's texts are unknown: empty)."""
        if self.prompt_token_ids is not None and self.directives.prompt_tokens is None:
            return [(token, "") for token in self.prompt_token_ids]
        return _text.prompt_pieces(self.prompt_text, self.prompt_tokens)


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


def _count(body: Mapping[str, Any], key: str) -> int | None:
    """A logprob count as vLLM's request validator first reads it (any number, else a 400)."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)):
        raise parameter_error(key, f"`{key}` must be an integer.", value)
    if isinstance(value, float) and not value.is_integer():
        raise validation_error(
            "int_from_float",
            f"body.{key}",
            "Input should be a valid integer, got a number with a fractional part",
            value,
        )
    return int(value)


def _positive_or_all(key: str, value: int | None) -> None:
    if value is not None and value < 0 and value != -1:
        raise parameter_error(key, f"`{key}` must be a positive value or -1.", value)


def _logprob_fields(
    body: Mapping[str, Any], route: Route, stream: bool, vllm: bool
) -> tuple[int | None, int | None]:
    """The request validator's ``logprobs`` rules: (sampled count, ``prompt_logprobs``, which
    only vLLM reads)."""
    other = "top_logprobs" if route == "chat" else "logprobs"
    prompt = _count(body, "prompt_logprobs") if vllm else None
    count = _count(body, other)
    if prompt is not None:
        if stream and (prompt > 0 or prompt == -1):
            raise parameter_error(
                "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."
            )
        _positive_or_all("prompt_logprobs", prompt)
    _positive_or_all(other, count)
    if route == "completions":
        return count, prompt
    wanted = _optional_bool(body, "logprobs")
    if count is not None and (count == -1 or count > 0) and not wanted:
        raise parameter_error(
            "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."
        )
    return (count or 0) if wanted else None, prompt


def _engine_logprobs(count: int | None, param: str, stream: bool) -> int | None:
    """vLLM's engine-side limit (``--max-logprobs`` 20; -1 asks for the whole vocabulary)."""
    if count is None:
        return None
    wanted = _text.VOCAB_SIZE if count == -1 else count
    if wanted > MAX_LOGPROBS:
        what = "sample" if param == "logprobs" else "prompt"
        raise parameter_error(
            param,
            f"Requested {what} logprobs of {wanted}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            wanted,
            in_band=stream,
        )
    return wanted


def _output_limit(body: Mapping[str, Any], route: Route) -> tuple[str, int | None]:
    """The output cap asked for, and the name vLLM's messages give it."""
    if route == "chat":
        completion = _optional_int(body, "max_completion_tokens")
        if completion is not None:
            return "max_completion_tokens", completion
        return "max_tokens", _optional_int(body, "max_tokens")
    value = _optional_int(body, "max_tokens")
    return "max_tokens", _COMPLETIONS_DEFAULT_MAX_TOKENS if value is None else value


def _context_checks(
    name: str, asked: int | None, prompt_tokens: int, ids_prompt: bool, max_model_len: int
) -> None:
    """vLLM's tokenization limits: the output cap, then the prompt, against the context."""
    if asked is not None and asked > max_model_len:
        raise parameter_error(
            name,
            f"{name}={asked} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            asked,
        )
    if prompt_tokens > max_model_len:
        # A text prompt is tokenized with truncation one token past the limit.
        count = prompt_tokens if ids_prompt else max_model_len + 1
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise parameter_error(
            "input_tokens",
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            count,
        )


def _optional_float(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise validation_error(
            "float_parsing",
            f"body.{key}",
            "Input should be a valid number, unable to parse string as a number",
            value,
        )
    return float(value)


def _sampling_checks(body: Mapping[str, Any], n: int | None, max_tokens: int | None) -> None:
    """vLLM's ``SamplingParams`` checks, in its order (those a router meets)."""
    if n is not None and n < 1:
        raise parameter_error(None, f"n must be at least 1, got {n}.")
    for key in ("presence_penalty", "frequency_penalty"):
        penalty = _optional_float(body, key)
        if penalty is not None and not -2.0 <= penalty <= 2.0:
            raise parameter_error(None, f"{key} must be in [-2, 2], got {penalty}.")
    temperature = _optional_float(body, "temperature")
    if temperature is not None:
        if not math.isfinite(temperature):
            message = f"temperature must be a finite number, got {temperature}."
            raise parameter_error("temperature", message, temperature)
        if temperature < 0.0:
            message = f"temperature must be non-negative, got {temperature}."
            raise parameter_error("temperature", message, temperature)
        if temperature > 2.0:
            message = f"temperature must be in [0, 2], got {temperature}."
            raise parameter_error("temperature", message, temperature)
    top_p = _optional_float(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise parameter_error("top_p", f"top_p must be in (0, 1], got {top_p}.", top_p)
    if max_tokens is not None and max_tokens < 1:
        message = f"max_tokens must be at least 1, got {max_tokens}."
        raise parameter_error("max_tokens", message, max_tokens)
    if n is not None and n > 1:
        raise parameter_error("n", "The simulator serves n=1 only.", n)


def _echo_text(body: Mapping[str, Any], route: Route, prompt_text: str, role: str) -> str:
    """What ``echo`` puts before the answer (vLLM's rules)."""
    if route == "completions":
        return prompt_text
    last = body["messages"][-1] if body["messages"] else {}
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return content if isinstance(content, str) else ""


def parse_request(
    route: Route,
    body: Mapping[str, Any],
    *,
    dialect: Dialect,
    model: str,
    default_directives: Mapping[str, Any] | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    reasoning_parser: bool = False,
    admit: Callable[[], None] | None = None,
) -> SimRequest:
    """Read a completion request the way the chosen engine would, in vLLM's stages.

    ``admit`` is called once the model is known and before tokenization, where vLLM's API
    server checks its queue limits (``_preflight``); it raises the refusal as a
    :class:`SimFailure`.

    Raises:
        SimFailure: the engine's error answer (400 for bad fields, 404 for another model; see
            the module doc for the failures a vLLM stream hears of in band).
    """
    directives = parse_directives(default_directives, body.get("narwhal_sim"))
    vllm, chat = dialect == "vllm", route == "chat"
    # 1. The request model's validators.
    if chat:
        messages = _messages(body)
        prompt_text, prompt_ids = _text.chat_prompt_text(messages), None
    else:
        prompt_text, prompt_ids = _prompt(body)

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

    logprobs, prompt_logprobs = _logprob_fields(body, route, stream, vllm)
    echo = vllm and _optional_bool(body, "echo")
    ignore_eos = dialect != "openai" and _optional_bool(body, "ignore_eos")
    request_id = body.get("request_id") if vllm else None
    if request_id is not None and not isinstance(request_id, str):
        raise validation_error(
            "string_type", "body.request_id", "Input should be a valid string", request_id
        )

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
    stop = _stop(body)

    # 2. The model, then the queue limits (vLLM: `_check_model`, then `_preflight`).
    requested_model = body.get("model")
    if requested_model is not None and requested_model != model:
        message = f"The model `{requested_model}` does not exist. Valid aliases: {model}."
        raise SimFailure(404, message, "NotFoundError", "model")
    if admit is not None:
        admit()

    # 3. Tokenization: the output cap and the prompt against the context.
    request = SimRequest(
        route=route,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        want_ids=want_ids,
        ids_keys=ids_keys,
        max_tokens=None,
        logprobs=logprobs,
        stop=stop,
        stream_interval=interval,
        tool_names=names,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_ids,
        directives=directives,
        forced_tools=forced,
        request_id=request_id,
    )
    name, asked = _output_limit(body, route)
    max_tokens = asked
    if vllm:
        prompt_tokens = request.prompt_tokens
        _context_checks(name, asked, prompt_tokens, prompt_ids is not None, max_model_len)
        room = max_model_len - prompt_tokens  # vLLM caps the output at what the context leaves
        max_tokens = room if asked is None else min(room, asked)

    # 4. The sampling parameters.
    _sampling_checks(body, n, max_tokens)

    # 5. What the engine checks when the request is added (in band for a vLLM stream).
    in_band = stream and vllm
    logprobs = _engine_logprobs(logprobs, "logprobs", in_band)
    if prompt_logprobs is None and echo:  # vLLM scores an echoed prompt
        prompt_logprobs = (_count(body, "top_logprobs") or 0) if chat else _count(body, "logprobs")
    prompt_logprobs = _engine_logprobs(prompt_logprobs, "prompt_logprobs", in_band)

    role = "assistant"
    if vllm and chat and body.get("add_generation_prompt") is False:
        role = str(body["messages"][-1].get("role")) if body["messages"] else "assistant"
    return attrs.evolve(
        request,
        max_tokens=max_tokens,
        logprobs=logprobs,
        echo=echo,
        echo_text=_echo_text(body, route, prompt_text, role) if echo else "",
        prompt_logprobs=prompt_logprobs,
        role=role,
        reasoning_parser=reasoning_parser and vllm,
        ignore_eos=ignore_eos,
    )
