"""Dialect knowledge: what Narwhal sends an engine for a client's request, and the shape of the
engine's own answer (pure).

Upstream, Narwhal streams, asks for the usage chunk (so output length and prompt size are
measured even where IDs are unavailable), and asks engines that provide token IDs for them one
token per event (``return_token_ids``, ``stream_interval: 1``). :class:`UpstreamPlan` carries
the body and the :class:`~narwhal.protocol.chunks.Exposure` that says what must be hidden again
from the client.

Where streaming upstream or asking for IDs would change the answer the client gets, Narwhal does
neither: the request goes *as sent* (:func:`as_sent`), streamed only if the client asked for a
stream, with none of the fields above added. The cases, from vLLM 0.32's serving code:

* ``prompt_logprobs`` on a non-streaming request: vLLM refuses it on streams, and no stream
  carries prompt logprobs;
* ``echo`` (either route): with ``return_token_ids`` vLLM drops the echoed prompt from
  completions (and its streamed first chunk's ``prompt_token_ids`` would be hidden again); a
  non-streaming echo carries prompt logprobs (completions ``choices[i].prompt_logprobs``, chat's
  top-level ``prompt_logprobs``) that no stream carries;
* ``include_reasoning: false`` (chat): behind a reasoning or tool parser vLLM then sends no
  token IDs at all, so asking for them would fail every output event;
* ``kv_transfer_params`` or ``ec_transfer_params`` on a non-streaming request (disaggregated
  serving): the engine's transfer parameters come back in the non-streaming answer only;
* ``tools`` on a non-streaming chat request (unless ``tool_choice`` is ``"none"``): vLLM parses
  a whole answer and a stream apart, and they differ where a call is cut short (by
  ``max_tokens``): whole, the call comes back as text in ``content``; streamed, as the tool-call
  deltas so far, which no assembly can turn back into that text.

The non-streaming answer the router assembles from a stream takes its engine's own shape
(:func:`response_shape`): vLLM writes every field of its response models, null when unset, where
its stream leaves most of them out (:data:`VLLM_CHAT`, :data:`VLLM_COMPLETIONS`).
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import orjson

from narwhal.errors import InvalidRequest
from narwhal.protocol.assembly import OPTIONAL, ResponseShape
from narwhal.protocol.chunks import Exposure
from narwhal.protocol.requests import CompletionRequest

__all__ = [
    "VLLM_CHAT",
    "VLLM_CHAT_FORCED_TOOL",
    "VLLM_COMPLETIONS",
    "UpstreamPlan",
    "as_sent",
    "plan_upstream",
    "response_shape",
    "streams_upstream",
]

_NOTHING_HIDDEN: Final = Exposure(hide_token_ids=False, drop_usage_chunk=False)

# Fields whose answer only vLLM's non-streaming response carries.
_WHOLE_ONLY: Final = ("prompt_logprobs", "kv_transfer_params", "ec_transfer_params")


@attrs.frozen
class UpstreamPlan:
    """What goes to the engine for one request.

    Attributes:
        body: the engine's request body.
        stream: the engine is asked for a stream (false only for a request sent as is).
        token_ids: the engine is asked for token IDs: every output event must carry them.
        exposure: what the router asked for on its own account, to hide from the client.
        as_sent: why the client's body goes unchanged (:func:`as_sent`), or ``None``.
    """

    body: bytes
    stream: bool
    token_ids: bool
    exposure: Exposure
    as_sent: str | None = None


def as_sent(request: CompletionRequest) -> str | None:
    """The field that makes ``request`` go to the engine exactly as the client sent it, if any.

    Returns the field's name (see the module's docstring), else ``None``. A value of the wrong
    type counts too: the engine answers it with its own 400, which reaches the client as it
    would have without Narwhal.
    """
    body = request.body
    if not request.stream:
        for key in _WHOLE_ONLY:
            if body.get(key) is not None:
                return key
    if body.get("echo") not in (None, False):
        return "echo"
    if request.route == "chat" and body.get("include_reasoning") not in (None, True):
        return "include_reasoning"
    if (
        not request.stream
        and request.route == "chat"
        and body.get("tools")
        and body.get("tool_choice") != "none"
    ):
        return "tools"
    return None


def streams_upstream(request: CompletionRequest) -> bool:
    """Whether ``request`` is streamed from its engine: always, but for a non-streaming request
    that goes as sent (:mod:`narwhal.upstream.whole` serves those)."""
    return request.stream or as_sent(request) is None


def plan_upstream(request: CompletionRequest, *, token_ids: bool) -> UpstreamPlan:
    """The engine's request for ``request``, and what to hide from the client.

    Args:
        request: the validated client request (its body is not modified).
        token_ids: the engine provides token IDs (asked for unless the request goes as sent).

    Raises:
        InvalidRequest: the body cannot be serialised again (nested too deeply).
    """
    reason = as_sent(request)
    if reason is not None:
        return UpstreamPlan(_encode(request.body), request.stream, False, _NOTHING_HIDDEN, reason)
    body = dict(request.body)
    body["stream"] = True
    options = dict(request.body.get("stream_options") or {})
    if not request.include_usage:
        # Without include_usage the engine sends no continuous usage either (vLLM >= 0.18);
        # forcing include_usage must not turn it on.
        options.pop("continuous_usage_stats", None)
    options["include_usage"] = True
    body["stream_options"] = options
    if token_ids:
        body["return_token_ids"] = True
        body["stream_interval"] = 1
    exposure = Exposure(
        hide_token_ids=token_ids and not request.wants_token_ids,
        drop_usage_chunk=not (request.stream and request.include_usage),
    )
    return UpstreamPlan(_encode(body), True, token_ids, exposure)


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise _too_deep(body) from None


def _too_deep(body: dict[str, Any]) -> InvalidRequest:
    # orjson serialises at most 254 levels of nesting; name the field that holds more.
    param = None
    for key, value in body.items():
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            param = key
            break
    return InvalidRequest(
        "The request body nests JSON too deeply to be forwarded (at most 254 levels).",
        param=param,
    )


# -- the engines' own non-streaming answers -----------------------------------------------------

# vLLM 0.32's response models (ChatCompletionResponse, CompletionResponse and their choices,
# ChatMessage, UsageInfo), field by field in their order, with the value each has when unset.
# Its non-streaming answers write every field; its streams leave most of them out.
_VLLM_USAGE: Final = (
    ("prompt_tokens", 0),
    ("total_tokens", 0),
    ("completion_tokens", 0),
    ("prompt_tokens_details", None),
    ("completion_tokens_details", None),
)

# The top-level fields both responses open and close with.
_VLLM_TOP_HEAD: Final = (
    ("id", OPTIONAL),
    ("object", OPTIONAL),
    ("created", OPTIONAL),
    ("model", OPTIONAL),
    ("choices", OPTIONAL),
    ("service_tier", None),
    ("system_fingerprint", None),
    ("usage", OPTIONAL),
)
_VLLM_TOP_TAIL: Final = (
    ("kv_transfer_params", None),
    ("ec_transfer_params", None),
    ("metrics", None),
)

VLLM_CHAT: Final = ResponseShape(
    top=(
        *_VLLM_TOP_HEAD,
        ("prompt_logprobs", None),
        ("prompt_token_ids", None),
        ("prompt_text", None),
        *_VLLM_TOP_TAIL,
    ),
    choice=(
        ("index", OPTIONAL),
        ("message", OPTIONAL),
        ("logprobs", None),
        ("finish_reason", None),
        ("stop_reason", None),
        ("token_ids", None),
        ("routed_experts", None),
    ),
    message=(
        ("role", OPTIONAL),
        ("content", OPTIONAL),
        ("refusal", None),
        ("annotations", None),
        ("audio", None),
        ("function_call", None),
        ("tool_calls", OPTIONAL),  # left out when empty
        ("reasoning", None),
    ),
    usage=_VLLM_USAGE,
    logprobs=("content",),
    # ChatMessage.content is the parsers' output: the generated text, "" when there is none;
    # None beside tool calls (the hermes parser's `content or None`) or reasoning (the
    # reasoning parsers' `content or None`).
    empty_content="",
    empty_content_beside=None,
)
"""A vLLM chat answer (``tool_choice`` auto or none)."""

VLLM_CHAT_FORCED_TOOL: Final = attrs.evolve(VLLM_CHAT, empty_content_beside="")
"""A vLLM chat answer to ``tool_choice`` ``"required"`` or a named function: its message is built
with ``content or ""``, so the content is ``""`` beside the tool calls."""

VLLM_COMPLETIONS: Final = ResponseShape(
    top=(*_VLLM_TOP_HEAD, *_VLLM_TOP_TAIL),
    choice=(
        ("index", OPTIONAL),
        ("text", OPTIONAL),
        ("logprobs", None),
        ("finish_reason", None),
        ("stop_reason", None),
        ("token_ids", None),
        ("prompt_logprobs", None),
        ("prompt_token_ids", None),
        ("routed_experts", None),
    ),
    usage=_VLLM_USAGE,
    logprobs=("text_offset", "token_logprobs", "tokens", "top_logprobs"),
)
"""A vLLM completions answer."""


def response_shape(dialect: str, request: CompletionRequest) -> ResponseShape | None:
    """The shape of ``dialect``'s own non-streaming answer to ``request``; ``None`` keeps the
    assembler's generic shape (the ``sglang`` and ``openai`` dialects)."""
    if dialect != "vllm":
        return None
    if request.route == "completions":
        return VLLM_COMPLETIONS
    choice = request.body.get("tool_choice")
    if choice == "required" or type(choice) is dict:
        return VLLM_CHAT_FORCED_TOOL
    return VLLM_CHAT
