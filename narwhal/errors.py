"""Narwhal's one exception tree.

Every error a client can see is a :class:`NarwhalError`. Each class knows its HTTP status, the
OpenAI envelope fields (``type``, ``code``, ``param``), the extra headers it carries
(``Retry-After``, ``x-should-retry``) and the terminal class it is counted under (docs:
Errors and refusals). The web layer translates them to responses in exactly one place.

::

    NarwhalError
    ├── InvalidRequest                 400 invalid_request            invalid_requests
    │   ├── InvalidSamplingWidth       400 invalid_sampling_width
    │   ├── UnsupportedOption          400 unsupported_option
    │   ├── ModelNotFound              404 model_not_found
    │   ├── RequestTooLarge            413 request_too_large
    │   ├── RequestTimeout             408 request_body_timeout (the client sent too slowly)
    │   └── EngineRejectedRequest      4xx (the engine's status and code)
    ├── RouteNotFound                  404 not_found                  (not offered)
    ├── MethodNotAllowed               405 method_not_allowed         (not offered)
    ├── AdminError                     the admin API's refusals        (not offered)
    │   ├── AdminUnauthorized          401 admin_unauthorized (missing or bad bearer token)
    │   ├── AdminDisabled              403 admin_disabled (no admin.token configured)
    │   ├── WaveNotFound               404 wave_not_found
    │   └── CapacityGuard              409 capacity_guard (a wave would leave too little)
    ├── FrameworkHTTPError             other statuses Quart raises    (not offered)
    ├── CapacityRejection              429 http_retention_full / admission_queue_full  rejected
    ├── PredictiveRefusal              429 ttft_budget_exceeded / prompt_exceeds_ttft_budget
    │                                                                   refused
    ├── Expired                        504 admission_wait_expired / request_deadline_expired
    │                                                                   expired
    ├── Unavailable                    503 backend_unavailable / router_*  unavailable
    └── UpstreamFailure                502                              failed
        ├── EngineError                502 engine_error
        │   ├── EngineUnreachable      502 engine_error (the engine leaves placement)
        │   └── EngineAttemptsFailed   502 engine_error (Narwhal's retry spent: x-should-retry)
        └── EngineResponseError        502 unsupported_engine_field / malformed_engine_response

Every 502 that a client's retry cannot cure says ``x-should-retry: false``: the attempts before
response headers are Narwhal's to retry (:class:`EngineAttemptsFailed`), and a malformed or
unsupported answer would come again (:class:`EngineResponseError`). The one 502 without it is a
non-streaming answer that broke after its output had begun, which Narwhal does not retry.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

__all__ = [
    "AdminDisabled",
    "AdminError",
    "AdminUnauthorized",
    "CapacityGuard",
    "CapacityRejection",
    "EngineAttemptsFailed",
    "EngineBusy",
    "EngineError",
    "EngineRejectedRequest",
    "EngineResponseError",
    "EngineUnreachable",
    "Expired",
    "FrameworkHTTPError",
    "InvalidRequest",
    "InvalidSamplingWidth",
    "MethodNotAllowed",
    "ModelNotFound",
    "NarwhalError",
    "PredictiveRefusal",
    "RequestTimeout",
    "RequestTooLarge",
    "RouteNotFound",
    "Unavailable",
    "UnsupportedOption",
    "UpstreamFailure",
    "WaveNotFound",
    "envelope",
]


def envelope(message: str, type_: str, code: str | None, param: str | None) -> dict[str, Any]:
    """The OpenAI error body: all four keys, always present."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class NarwhalError(Exception):
    """Base of every error a client can see.

    Attributes:
        status: HTTP status of the refusal.
        type: the envelope's ``type``.
        code: the envelope's ``code`` (a string).
        param: the envelope's ``param``: the field at fault, or ``None``.
        headers: extra response headers.
        counted_as: the terminal class (``invalid_requests``, ``failed``...) this outcome is
            counted under, or ``None`` for responses that are not offered requests (unknown
            routes).
    """

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str] = "internal_error"
    counted_as: ClassVar[str | None] = "failed"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers: dict[str, str] = dict(headers or {})

    @property
    def http_status(self) -> int:
        """The status this instance answers with (an engine's 4xx may differ per instance)."""
        return self.status

    def envelope(self) -> dict[str, Any]:
        """The error body for this instance."""
        return envelope(self.message, self.type, self.code, self.param)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}, param={self.param!r})"


# -- 4xx: the request is at fault -------------------------------------------------------------


class InvalidRequest(NarwhalError):
    """Invalid JSON, body shape or field type (400); ``param`` names the field."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"
    counted_as = "invalid_requests"


class InvalidSamplingWidth(InvalidRequest):
    """``n > 1`` or ``best_of > 1``: Narwhal serves one sequence per request."""

    default_code = "invalid_sampling_width"


class UnsupportedOption(InvalidRequest):
    """An option Narwhal cannot honour (non-streaming audio, non-text modality, custom tools)."""

    default_code = "unsupported_option"


class ModelNotFound(InvalidRequest):
    """The request names a model other than the one configured."""

    status = 404
    default_code = "model_not_found"


class RequestTooLarge(InvalidRequest):
    """The body is larger than ``serving.max_request_bytes``."""

    status = 413
    default_code = "request_too_large"

    @classmethod
    def over(cls, limit: int) -> RequestTooLarge:
        """The error for a body over ``limit`` bytes, worded alike wherever it is found."""
        return cls(f"The request body is larger than the limit of {limit} bytes.")


class RequestTimeout(InvalidRequest):
    """The client did not send its request in time (``serving.body_timeout_s``)."""

    status = 408
    default_code = "request_body_timeout"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"connection": "close"})


class EngineRejectedRequest(InvalidRequest):
    """The engine answered a 4xx, or sent an in-band error frame with a 4xx ``code``.

    The envelope is normalised, the status kept; it is the client's error, never retried on
    another engine and never counted against the engine.
    """

    def __init__(
        self, message: str, *, status: int, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self._status = status

    @property
    def http_status(self) -> int:
        return self._status


class RouteNotFound(NarwhalError):
    """No such route."""

    status = 404
    type = "invalid_request_error"
    default_code = "not_found"
    counted_as = None


class FrameworkHTTPError(NarwhalError):
    """Any other HTTP-level error (a body timeout, a malformed request line) in the envelope."""

    type = "invalid_request_error"
    default_code = "invalid_request"
    counted_as = None

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self._status = status
        if status >= 500:
            self.code = "internal_error"

    @property
    def http_status(self) -> int:
        return self._status


class MethodNotAllowed(NarwhalError):
    """The route exists but not with this method."""

    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"
    counted_as = None


# -- the admin API (narwhal.web.admin): operators' requests, never offered completions -------


class AdminError(NarwhalError):
    """Base of the admin API's refusals; they are not offered requests."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"
    counted_as = None


class AdminUnauthorized(AdminError):
    """The admin request has no bearer token, or not the configured one (the message never
    repeats what was sent)."""

    status = 401
    type = "authentication_error"
    default_code = "admin_unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="narwhal-admin"'})


class AdminDisabled(AdminError):
    """No ``admin.token`` is configured, and the caller is not a loopback one that
    ``admin.allow_loopback_without_token`` lets in: no credential could help."""

    status = 403
    type = "permission_error"
    default_code = "admin_disabled"


class WaveNotFound(AdminError):
    """No configured engine has this maintenance wave label."""

    status = 404
    default_code = "wave_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="wave")


class CapacityGuard(AdminError):
    """Starting the wave would leave less than ``maintenance.min_capacity_share`` of the
    pool's capacity (``?force=true`` overrides)."""

    status = 409
    default_code = "capacity_guard"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="force")


# -- 429, 503, 504: the router refuses or gives up ---------------------------------------------


class CapacityRejection(NarwhalError):
    """HTTP retention or admission queue full: ``code`` says which."""

    status = 429
    type = "rate_limit_error"
    default_code = "admission_queue_full"
    counted_as = "rejected"

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message, code=code, headers={"Retry-After": "1"})


class PredictiveRefusal(NarwhalError):
    """Predictive admission refuses: over the TTFT budget, or the prompt alone is."""

    status = 429
    type = "rate_limit_error"
    default_code = "ttft_budget_exceeded"
    counted_as = "refused"

    @classmethod
    def over_budget(cls, overrun_s: float) -> PredictiveRefusal:
        """The projection is strictly over budget by ``overrun_s`` seconds."""
        seconds = min(120, max(1, math.floor(overrun_s + 0.5)))
        millis = min(120_000, max(1000, math.ceil(overrun_s * 1000)))
        return cls(
            f"Projected time to first token exceeds the budget by {overrun_s:.3f} s; "
            f"retry after {seconds} s.",
            code="ttft_budget_exceeded",
            headers={"Retry-After": str(seconds), "retry-after-ms": str(millis)},
        )

    @classmethod
    def prompt_too_long(cls, predicted_s: float, budget_s: float) -> PredictiveRefusal:
        """The prompt's own prefill is over budget: waiting cannot help."""
        return cls(
            f"The prompt alone needs about {predicted_s:.3f} s before its first token, over the "
            f"time-to-first-token budget of {budget_s:.3f} s: shorten the prompt or raise the "
            "target.",
            code="prompt_exceeds_ttft_budget",
            headers={"x-should-retry": "false"},
        )


class Expired(NarwhalError):
    """The admission wait or the request deadline ran out before response headers."""

    status = 504
    type = "timeout_error"
    default_code = "request_deadline_expired"
    counted_as = "expired"

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message, code=code, headers={"x-should-retry": "false"})


class Unavailable(NarwhalError):
    """No engine can take the request, or the router is not active (``router_*`` codes)."""

    status = 503
    type = "service_unavailable_error"
    default_code = "backend_unavailable"
    counted_as = "unavailable"

    def __init__(self, message: str, *, code: str = "backend_unavailable") -> None:
        super().__init__(message, code=code, headers={"Retry-After": "1"})


# -- 502: the engine failed us ------------------------------------------------------------------


class UpstreamFailure(NarwhalError):
    """Base of the engine-side failures (502)."""

    status = 502
    type = "upstream_error"
    default_code = "engine_error"
    counted_as = "failed"


class EngineError(UpstreamFailure):
    """The engine was unreachable, answered 5xx, sent an error frame or broke its stream."""

    default_code = "engine_error"


class EngineBusy(EngineError):
    """The engine answered 503: it refuses new work for now (vLLM's ``--max-num-queued-tokens``
    or ``--max-num-queued-reqs``), which says nothing against it: retried elsewhere like any
    5xx, but not counted as the engine failing."""


class EngineUnreachable(EngineError):
    """No connection to the engine could be made: it leaves placement until it rejoins."""


class EngineAttemptsFailed(EngineError):
    """Every attempt before response headers failed (the retry too, or no engine could take it).

    Narwhal's own retry is spent, so the client is told not to add its own
    (``x-should-retry: false``): the openai client would otherwise send the request twice more,
    each time tried on two engines.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class EngineResponseError(UpstreamFailure):
    """The engine's answer has a field assembly cannot honour, or a malformed one.

    ``code`` is ``unsupported_engine_field`` or ``malformed_engine_response``; ``param`` the path
    of the field (``choices[0].delta.audio``, ``choices[0].token_ids``). Retrying the same
    request would meet the same answer, hence ``x-should-retry: false``.
    """

    default_code = "malformed_engine_response"

    def __init__(self, message: str, *, param: str | None, code: str) -> None:
        super().__init__(message, param=param, code=code, headers={"x-should-retry": "false"})
