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
from quart import Response, has_websocket_context, request, websocket
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
from narwhal.router import Router, RouterBase
from narwhal.web.admin import register_admin
from narwhal.web.client import request_id
from narwhal.web.completions import serve_completion
from narwhal.web.events import register_events
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
        router = get_router(self)
        if scope["type"] == "http" and scope["method"] == "POST":
            route = COMPLETION_ROUTES.get(scope["path"])
            if route is not None:
                await serve_completion(router, route, scope, receive, send)
                return
        if router.forwards(scope):  # a relay worker's other routes are its controller's
            await router.forward(scope, receive, send)
            return
        await super().asgi_app(scope, receive, send)


def get_router(app: QuartTrio) -> Router:
    """The :class:`~narwhal.router.Router` behind an app made by :func:`create_app`."""
    router: Router = app.extensions["narwhal"]
    return router


def get_router_base(app: QuartTrio) -> RouterBase:
    """The router behind an app made by :func:`create_app`, a relay worker's included."""
    router: RouterBase = app.extensions["narwhal"]
    return router


def create_app(
    config: Config,
    *,
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    router: RouterBase | None = None,
) -> QuartTrio:
    """Build the router's ASGI application.

    Args:
        config: the configuration.
        transports: optional httpx transports by engine name, in place of the network (the
            in-process simulator for tests and the demo).
        router: the router to serve, in place of a :class:`~narwhal.router.Router` built
            here (a relay worker's, :mod:`narwhal.workers.worker`).
    """
    app = NarwhalApp("narwhal")
    app.config.update(
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=config.serving.request_deadline_s,
        MAX_CONTENT_LENGTH=config.serving.max_request_bytes,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    served: RouterBase = Router(config, transports=transports) if router is None else router
    app.extensions["narwhal"] = served

    @app.before_serving
    async def start() -> None:
        await served.start(app.nursery)

    @app.after_serving
    async def stop() -> None:
        await served.aclose()

    async def served_as_asgi() -> Response:  # pragma: no cover - NarwhalApp.asgi_app serves
        raise RuntimeError("completion routes are served by NarwhalApp.asgi_app")

    for path in COMPLETION_ROUTES:
        # Registered so that other methods get the 405 envelope (with Allow).
        app.add_url_rule(path, path, served_as_asgi, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [served.model_object()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        # vLLM has no such route; this is OpenAI's: the model object itself.
        name = config.serving.model
        if model_id != name:
            return error_response(
                ModelNotFound(
                    f"The model `{model_id}` does not exist here; this router serves `{name}`.",
                    param="model",
                )
            )
        return json_response(served.model_object())

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

    if isinstance(served, Router):  # a relay worker's are its controller's (forwarded)
        _router_routes(app, served)
    # /admin/events (a WebSocket) and /dashboard (narwhal.web.events); a relay worker refuses
    # the feed and forwards the dashboard.
    register_events(app, served)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        error: NarwhalError
        asked = websocket if has_websocket_context() else request  # an upgrade has no request
        if exc.code == 404:
            error = RouteNotFound(f"No route {asked.method} {asked.path}.")
        elif exc.code == 405:
            error = MethodNotAllowed(f"Method {asked.method} is not allowed on {asked.path}.")
        elif exc.code == 413:
            error = RequestTooLarge.over(config.serving.max_request_bytes)
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


def _router_routes(app: QuartTrio, router: Router) -> None:
    """The routes that read the pool's state: ``/ready``, ``/metrics`` and ``/admin``."""

    @app.get("/ready")
    async def ready() -> Response:
        stats = router.statistics()
        return json_response(stats.as_json(), status=200 if stats.ready else 503)

    register_admin(app, router)  # /admin/engines, /admin/maintenance (narwhal.web.admin)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), content_type=CONTENT_TYPE)
