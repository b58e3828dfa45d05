"""What Narwhal adds to a client's body before it goes upstream (pure).

Upstream, Narwhal always streams, always asks for the usage chunk (so output length and prompt
size are measured even where IDs are unavailable), and asks engines that provide token IDs for
them one token per event (``return_token_ids``, ``stream_interval: 1``). The returned
:class:`~narwhal.protocol.chunks.Exposure` says what must be hidden again from the client.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.errors import InvalidRequest
from narwhal.protocol.chunks import Exposure
from narwhal.protocol.requests import CompletionRequest

__all__ = ["upstream_body"]


def upstream_body(request: CompletionRequest, *, token_ids: bool) -> tuple[bytes, Exposure]:
    """The engine's request body for ``request``, and what to hide from the client.

    Args:
        request: the validated client request (its body is not modified).
        token_ids: ask the engine for token IDs.

    Raises:
        InvalidRequest: the body cannot be serialised again (nested too deeply).
    """
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
    try:
        encoded = orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise _too_deep(body) from None
    return encoded, exposure


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
