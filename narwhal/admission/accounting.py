"""Request accounting: every offered request ends in exactly one terminal class.

The conservation law ``offered = sum(terminal classes) + in_flight`` holds at every instant by
construction: ``in_flight`` is derived, and a :class:`Ticket` can be finished only once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Literal

import attrs

__all__ = ["TERMINAL_CLASSES", "Accounting", "AccountingStatistics", "TerminalClass", "Ticket"]

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
        in_flight: offered and not yet ended.
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
    """One offered request's place in the books; finish it exactly once."""

    __slots__ = ("_books", "finished", "sized")

    def __init__(self, books: Accounting) -> None:
        self._books = books
        self.sized = False
        self.finished: TerminalClass | None = None

    def finish(self, terminal: TerminalClass, reason: str | None = None) -> None:
        """Record the outcome. A second call is a bug and raises ``RuntimeError``."""
        if self.finished is not None:
            raise RuntimeError(f"request already counted as {self.finished}, not {terminal}")
        self.finished = terminal
        self._books._record(terminal, reason or "", sized=self.sized)


class Accounting:
    """The router's request counters."""

    def __init__(self) -> None:
        self._offered = 0
        self._unsized = 0
        self._terminal: Counter[str] = Counter()
        self._by_reason: Counter[tuple[str, str]] = Counter()
        self._ended = 0

    def offer(self) -> Ticket:
        """Count one arrival and return its ticket."""
        self._offered += 1
        return Ticket(self)

    def _record(self, terminal: TerminalClass, reason: str, *, sized: bool) -> None:
        self._terminal[terminal] += 1
        self._by_reason[terminal, reason] += 1
        self._ended += 1
        if not sized:
            self._unsized += 1

    @property
    def in_flight(self) -> int:
        """Offered and not yet ended."""
        return self._offered - self._ended

    def statistics(self) -> AccountingStatistics:
        """A frozen snapshot."""
        return AccountingStatistics(
            offered=self._offered,
            unsized_offered=self._unsized,
            terminal={name: self._terminal[name] for name in TERMINAL_CLASSES},
            by_reason=dict(self._by_reason),
            in_flight=self.in_flight,
        )
