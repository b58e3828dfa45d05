"""Request accounting: every offered request ends in exactly one terminal class.

The conservation law ``offered = sum(terminal classes) + in_flight`` must hold at every instant.
So that a check of it can fail, its two sides are counted apart: the counters count arrivals
and endings, and ``in_flight`` is the number of tickets still open (a set, not a difference). A
:class:`Ticket` is finished exactly once: a second finish raises, and a ticket left unfinished
when its request ends (:meth:`Ticket.__exit__`) is counted ``cancelled`` or
``failed/internal_error``, so no path can lose a request.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from types import TracebackType
from typing import Literal

import attrs
import trio

__all__ = ["TERMINAL_CLASSES", "Accounting", "AccountingStatistics", "TerminalClass", "Ticket"]

log = logging.getLogger(__name__)

TerminalClass = Literal[
    "completed",
    "rejected",
    "refused",
    "invalid_requests",
    "expired",
    "unavailable",
    "failed",
    "cancelled",
]
TERMINAL_CLASSES: tuple[TerminalClass, ...] = (
    "completed",
    "rejected",
    "refused",
    "invalid_requests",
    "expired",
    "unavailable",
    "failed",
    "cancelled",
)


@attrs.frozen
class AccountingStatistics:
    """A snapshot of the counters.

    Attributes:
        offered: requests that arrived on a completion route.
        unsized_offered: offered requests that ended before their workload was sized.
        terminal: total per terminal class (every class present).
        by_reason: per ``(class, reason)``; reason is the error code, or ``""``.
        in_flight: tickets still open, counted apart from ``offered`` and the terminals.
    """

    offered: int
    unsized_offered: int
    terminal: Mapping[str, int]
    by_reason: Mapping[tuple[str, str], int]
    in_flight: int

    def as_json(self) -> dict[str, int]:
        """The counters as ``/ready`` shows them."""
        return {
            "offered": self.offered,
            "unsized_offered": self.unsized_offered,
            **self.terminal,
            "in_flight": self.in_flight,
        }


class Ticket:
    """One offered request's place in the books; finish it exactly once.

    Use it as a context manager around the whole request: leaving the block with the ticket
    unfinished counts the request ``cancelled`` when it left by cancellation (the client went
    away), else ``failed`` with reason ``internal_error`` (a bug: it is logged).
    """

    __slots__ = ("_books", "finished", "request_id", "sized")

    def __init__(self, books: Accounting, request_id: str = "") -> None:
        self._books = books
        self.request_id = request_id  # the request's id (its x-request-id), for what it is asked
        self.sized = False
        self.finished: TerminalClass | None = None

    def finish(self, terminal: TerminalClass, reason: str | None = None) -> None:
        """Record the outcome. A second call is a bug and raises ``RuntimeError``."""
        if self.finished is not None:
            raise RuntimeError(f"request already counted as {self.finished}, not {terminal}")
        self.finished = terminal
        self._books._record(self, terminal, reason or "")

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.finished is not None:
            return
        if value is not None and _is_cancellation(value):
            self.finish("cancelled")
        else:
            log.error("request ended without an outcome", exc_info=value)
            self.finish("failed", "internal_error")


def _is_cancellation(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return all(_is_cancellation(inner) for inner in error.exceptions)
    return isinstance(error, trio.Cancelled | KeyboardInterrupt)


class Accounting:
    """The router's request counters."""

    def __init__(self) -> None:
        self._offered = 0
        self._unsized = 0
        self._terminal: Counter[str] = Counter()
        self._by_reason: Counter[tuple[str, str]] = Counter()
        self._open: set[Ticket] = set()

    def offer(self, request_id: str = "") -> Ticket:
        """Count one arrival and return its ticket."""
        self._offered += 1
        ticket = Ticket(self, request_id)
        self._open.add(ticket)
        return ticket

    def _record(self, ticket: Ticket, terminal: TerminalClass, reason: str) -> None:
        self._open.remove(ticket)
        self._terminal[terminal] += 1
        self._by_reason[terminal, reason] += 1
        if not ticket.sized:
            self._unsized += 1

    @property
    def in_flight(self) -> int:
        """Tickets still open (counted apart from the counters, so the law can fail)."""
        return len(self._open)

    def statistics(self) -> AccountingStatistics:
        """A frozen snapshot."""
        return AccountingStatistics(
            offered=self._offered,
            unsized_offered=self._unsized,
            terminal={name: self._terminal[name] for name in TERMINAL_CLASSES},
            by_reason=dict(self._by_reason),
            in_flight=self.in_flight,
        )

    def check(self) -> None:
        """Assert the conservation law (tests and the chaos suite call it).

        Raises:
            AssertionError: ``offered != sum(terminal classes) + in_flight``.
        """
        ended = sum(self._terminal.values())
        if self._offered != ended + len(self._open):
            raise AssertionError(
                f"conservation law broken: offered {self._offered} != ended {ended} + "
                f"in flight {len(self._open)}"
            )
