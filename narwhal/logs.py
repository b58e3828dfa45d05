"""Log records that say which request they are about.

Every completion request runs in :func:`request_context` (set once, at the top of
:func:`~narwhal.web.completions.serve_completion`): a context variable holds its id for as long
as it runs, in its own task and in every task it starts (Trio copies the context into them).
:class:`RequestIdFilter`, on a handler, gives each record a ``request_id`` attribute from it
(``-`` for a line about no request: an engine poll, the server starting), so that a format with
``%(request_id)s`` shows the id on every line that the exchange, the upstream client or the
engine's health logs on the request's behalf, without handing the id to each of them.

``narwhal serve`` and ``narwhal demo`` log this way (:func:`configure_logging`). A program
embedding Narwhal adds the filter to its own handler to get the same.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = [
    "FORMAT",
    "NO_REQUEST",
    "RequestIdFilter",
    "configure_logging",
    "current_request_id",
    "request_context",
]

NO_REQUEST = "-"
"""The ``request_id`` of a record logged outside any request."""

FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
"""The command line's log format: the request id in brackets after the logger's name."""

_REQUEST_ID: ContextVar[str] = ContextVar("narwhal_request_id", default=NO_REQUEST)


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Attribute every record logged in the block (and in the tasks it starts) to
    ``request_id``."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def current_request_id() -> str:
    """The id of the request the caller is serving, or :data:`NO_REQUEST`."""
    return _REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` to the current request's id (a record that already has one,
    from ``extra=``, keeps it); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _REQUEST_ID.get()
        return True


def configure_logging(level: int) -> None:
    """The command line's logging: standard error at ``level``, in :data:`FORMAT`.

    Like :func:`logging.basicConfig`, it adds a handler only where the root logger has none;
    every root handler gets a :class:`RequestIdFilter`.
    """
    logging.basicConfig(level=level, format=FORMAT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(existing, RequestIdFilter) for existing in handler.filters):
            handler.addFilter(RequestIdFilter())
