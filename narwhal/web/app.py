"""The Quart-Trio application factory.

Quart's own limits and error pages are switched off or translated: every error a client can
see is the OpenAI envelope. ``RESPONSE_TIMEOUT`` is disabled so long streams are never cut;
Narwhal's own deadlines (cancel scopes) govern instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from narwhal.config import Config
from narwhal.errors import (
    FrameworkHTTPError,
    MethodNotAllowed,
    ModelNotFound,
    NarwhalError,
    RequestTooLarge,
    RouteNotFound,
)
from narwhal.protocol.requests import Route
from narwhal.router import Router
from narwhal.web.admin import register_admin
from narwhal.web.client import request_id
from narwhal.web.completions import serve_completion
from narwhal.web.metrics import CONTENT_TYPE
from narwhal.web.responses import error_response, json_response

__all__ = ["create_app", "get_router"]

log = logging.getLogger(__name__)


COMPLETION_ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


class NarwhalApp(QuartTrio):
    """The Quart-Trio app, with the completion routes served as plain ASGI.

    ``POST`` to a completion route goes straight to
    :func:`~narwhal.web.completions.serve_completion`, which holds the request in one coroutine
    from its first byte to its last; every other request goes through Quart (which also answers
    a completion route's other methods with the 405 envelope).
    """

    async def asgi_app(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = COMPLETION_ROUTES.get(scope["path"])
            if route is not None:
                await serve_completion(get_router(self), route, scope, receive, send)
                return
        await super().asgi_app(scope, receive, send)


def get_router(app: QuartTrio) -> Router:
    """The :class:`~narwhal.router.Router` behind an app made by :func:`create_app`."""
    router: Router = app.extensions["narwhal"]
    return router


def create_app(
    config: Config,
    *,
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
) -> QuartTrio:
    """Build the router's ASGI application.

    Args:
        config: the configuration.
        transports: optional httpx transports by engine name, in place of the network (the
            in-process simulator for tests and the demo).
    """
    app = NarwhalApp("narwhal")
    app.config.update(
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=config.serving.request_deadline_s,
        MAX_CONTENT_LENGTH=config.serving.max_request_bytes,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    router = Router(config, transports=transports)
    app.extensions["narwhal"] = router

    @app.before_serving
    async def start() -> None:
        await router.start(app.nursery)

    @app.after_serving
    async def stop() -> None:
        await router.aclose()

    async def served_as_asgi() -> Response:  # pragma: no cover - NarwhalApp.asgi_app serves
        raise RuntimeError("completion routes are served by NarwhalApp.asgi_app")

    for path in COMPLETION_ROUTES:
        # Registered so that other methods get the 405 envelope (with Allow).
        app.add_url_rule(path, path, served_as_asgi, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [router.model_object()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        # vLLM has no such route; this is OpenAI's: the model object itself.
        served = config.serving.model
        if model_id != served:
            return error_response(
                ModelNotFound(
                    f"The model `{model_id}` does not exist here; this router serves `{served}`.",
                    param="model",
                )
            )
        return json_response(router.model_object())

    @app.after_request
    async def identify(response: Response) -> Response:
        # Every answer carries a request id (the completion routes set their own), as vLLM's
        # do when started with --enable-request-id-headers.
        if "x-request-id" not in response.headers:
            given = {"x-request-id": request.headers.get("x-request-id", "")}
            response.headers["x-request-id"] = request_id(given)
        return response

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        stats = router.statistics()
        return json_response(stats.as_json(), status=200 if stats.ready else 503)

    register_admin(app, router)  # /admin/engines, /admin/maintenance (narwhal.web.admin)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), content_type=CONTENT_TYPE)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        error: NarwhalError
        if exc.code == 404:
            error = RouteNotFound(f"No route {request.method} {request.path}.")
        elif exc.code == 405:
            error = MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
        elif exc.code == 413:
            error = RequestTooLarge(
                f"The request body is larger than {config.serving.max_request_bytes} bytes."
            )
        else:
            error = FrameworkHTTPError(exc.description or "HTTP error", status=exc.code or 500)
        response = error_response(error)
        allowed = getattr(exc, "valid_methods", None)  # werkzeug's MethodNotAllowed has them
        if exc.code == 405 and allowed:
            response.headers["Allow"] = ", ".join(sorted(allowed))  # RFC 9110: a 405 says which
        return response

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(NarwhalError("Internal router error."))

    return app
