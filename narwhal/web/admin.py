"""The admin API: the engines as the router sees them, and maintenance waves.

Every admin route is guarded (:func:`authorize`): the caller sends
``Authorization: Bearer <admin.token>``, compared in constant time. With no token configured
the admin API is off (403 ``admin_disabled``), except for loopback callers where
``admin.allow_loopback_without_token`` says so. A missing or wrong token is a 401
``admin_unauthorized``. Neither the token nor what was sent is ever logged or echoed.

Routes (docs: Operations, "Admin API and maintenance runbook"):

- ``GET /admin/engines``: every engine: state, eligibility and reason, models, learned speed,
  drift, occupancy, wave and maintenance.
- ``GET /admin/maintenance``: every wave and where it stands.
- ``POST /admin/maintenance/{wave}`` (``?force=true``, ``?wait_s=N``): start a wave.
- ``GET /admin/maintenance/{wave}`` (``?wait_s=N``): its progress; with ``wait_s``, answers
  once it is drained or ``wait_s`` has passed.
- ``DELETE /admin/maintenance/{wave}``: end it.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from narwhal.config import AdminConfig
from narwhal.control.maintenance import capacity_rps
from narwhal.errors import AdminDisabled, AdminUnauthorized, InvalidRequest, NarwhalError
from narwhal.router import Router
from narwhal.scheduling.engines import Engine
from narwhal.web.client import request_id
from narwhal.web.responses import error_response, json_response

__all__ = ["MAX_WAIT_S", "authorize", "is_loopback", "register_admin"]

log = logging.getLogger(__name__)

MAX_WAIT_S = 600.0
"""The longest ``?wait_s=`` a maintenance route waits for its wave to drain."""

Handler = Callable[..., Awaitable[Response]]


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (the ASGI scope's client address) is a loopback address.

    A Unix socket or an unknown peer (``None``) is not.
    """
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _bearer(authorization: str | None) -> bytes | None:
    """The credentials of a ``Bearer`` authorization header, as the bytes that were sent."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not credentials:
        return None
    try:
        # ASGI servers hand header values over as latin-1: this gives back the bytes sent.
        return credentials.encode("latin-1")
    except UnicodeEncodeError:
        return None


def authorize(admin: AdminConfig, authorization: str | None, client_host: str | None) -> None:
    """Let the admin request through, or refuse it.

    Args:
        admin: ``[admin]``.
        authorization: the request's ``Authorization`` header, if any.
        client_host: the peer's address from the ASGI scope (never a forwarded header).

    Raises:
        AdminDisabled: no token is configured, and loopback callers are not let in without
            one (or this caller is not loopback).
        AdminUnauthorized: the bearer token is missing or is not the configured one.
    """
    if not admin.token:
        if admin.allow_loopback_without_token and is_loopback(client_host):
            return
        raise AdminDisabled(
            "The admin API is off: no admin.token is configured"
            + (
                " and this caller is not on loopback."
                if admin.allow_loopback_without_token
                else "."
            )
        )
    given = _bearer(authorization)
    if given is None:
        raise AdminUnauthorized("The admin API needs an `Authorization: Bearer <token>` header.")
    if not hmac.compare_digest(given, admin.token.encode("utf-8")):
        raise AdminUnauthorized("The admin token is not valid.")


def _flag(name: str) -> bool:
    value = request.args.get(name, "false").strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no", ""):
        return False
    raise InvalidRequest(f"`{name}` must be true or false.", param=name)


def _wait_s() -> float | None:
    raw = request.args.get("wait_s")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_WAIT_S:  # also refuses nan
        raise InvalidRequest(
            f"`wait_s` must be a number of seconds from 0 to {MAX_WAIT_S:g}.", param="wait_s"
        )
    return value


def _engine_json(engine: Engine) -> dict[str, Any]:
    stats = engine.statistics()
    return {
        "name": stats.name,
        "url": stats.url,
        "dialect": stats.dialect,
        "wave": stats.wave,
        "maintenance": stats.maintenance is not None,
        "state": stats.state,
        "eligible": stats.eligible,
        "reason": stats.reason,
        "models": [] if engine.model_card is None else [dict(engine.model_card)],
        "token_accounting": stats.token_accounting,
        "profiled": stats.profiled,
        "speed": {
            "prefill_scale": round(stats.prefill_scale, 4),
            "latency_s": round(stats.latency_s, 6),
            "decode_scale": round(stats.decode_scale, 4),
            "decode_slope": round(engine.forecast.decode_slope, 4),
            "step_fill": round(engine.forecast.fill, 4),
            "profiled_prefill_scale": round(engine.profiled_scale, 4),
            "profiled_decode_scale": round(engine.profiled_decode_scale, 4),
            "capacity_rps": round(capacity_rps(engine), 3),
            "profile": engine.forecast.profile.name,
        },
        "drift": stats.drift.as_json(),
        "occupancy": {
            "prefill": stats.prefill,
            "decode": stats.decode,
            "prefill_limit": stats.prefill_limit,
            "decode_limit": stats.decode_limit,
        },
        "completed": stats.completed,
        "failed": stats.failed,
    }


def refusal(
    admin: AdminConfig, authorization: str | None, client_host: str | None, what: str, rid: str
) -> Response | None:
    """:func:`authorize`, as the answer that refuses the request (logged, ``what`` naming the
    request and never what it sent), or ``None`` when it may in."""
    try:
        authorize(admin, authorization, client_host)
    except (AdminDisabled, AdminUnauthorized) as error:
        log.warning(
            "admin request %s from %s refused: %s [request %s]",
            what,
            client_host or "an unknown peer",
            error.code,
            rid,
        )
        return error_response(error)
    return None


def register_admin(app: QuartTrio, router: Router) -> None:
    """Add the admin routes to ``app``."""
    admin = router.config.admin
    maintenance = router.maintenance

    def guarded(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def guard(*args: Any, **kwargs: Any) -> Response:
            rid = request_id({"x-request-id": request.headers.get("x-request-id", "")})
            client = request.scope.get("client")
            host = client[0] if client else None
            what = f"{request.method} {request.path}"
            refused = refusal(admin, request.headers.get("authorization"), host, what, rid)
            if refused is not None:
                response = refused
            else:
                try:
                    response = await handler(*args, **kwargs)
                except NarwhalError as error:
                    response = error_response(error)
            response.headers["x-request-id"] = rid
            return response

        return guard

    @app.get("/admin/engines")
    @guarded
    async def engines() -> Response:
        capacity = maintenance.capacity()
        return json_response(
            {
                "state": router.state,
                "reason": router.state_reason,
                "capacity": {
                    "total_rps": round(capacity.total, 3),
                    "serving_rps": round(capacity.left, 3),
                },
                "engines": [_engine_json(engine) for engine in router.pool],
            }
        )

    @app.get("/admin/maintenance")
    @guarded
    async def waves() -> Response:
        return json_response(
            {
                "state": router.state,
                "reason": router.state_reason,
                "min_capacity_share": maintenance.min_share,
                "waves": [status.as_json() for status in maintenance.statistics()],
            }
        )

    @app.post("/admin/maintenance/<wave>")
    @guarded
    async def start_wave(wave: str) -> Response:
        force, wait_s = _flag("force"), _wait_s()
        status = maintenance.start(wave, force=force)
        if wait_s is not None:
            status = await maintenance.wait_drained(wave, wait_s)
        return json_response(status.as_json())

    @app.get("/admin/maintenance/<wave>")
    @guarded
    async def wave_status(wave: str) -> Response:
        wait_s = _wait_s()
        if wait_s is None:
            return json_response(maintenance.status(wave).as_json())
        return json_response((await maintenance.wait_drained(wave, wait_s)).as_json())

    @app.delete("/admin/maintenance/<wave>")
    @guarded
    async def end_wave(wave: str) -> Response:
        return json_response(maintenance.end(wave).as_json())
