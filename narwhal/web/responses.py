"""Responses in one place: errors become the OpenAI envelope with their headers."""

from __future__ import annotations

from typing import Any

import orjson
from quart import Response

from narwhal.errors import NarwhalError

__all__ = ["error_response", "json_response"]

JSON = "application/json"


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response serialised with orjson."""
    return Response(orjson.dumps(body), status=status, content_type=JSON, headers=headers)


def error_response(error: NarwhalError) -> Response:
    """The envelope, status and headers of ``error``."""
    return json_response(error.envelope(), status=error.http_status, headers=error.headers)
