"""The HTTP retention limit: how many requests the router holds at once, in every phase."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import attrs

from narwhal.errors import CapacityRejection

__all__ = ["RetentionLimit", "RetentionStatistics"]


@attrs.frozen
class RetentionStatistics:
    """A snapshot of the retention limit."""

    in_use: int
    limit: int
    rejected: int


class RetentionLimit:
    """Slots taken without waiting when a request arrives and held until it ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._rejected = 0

    def acquire(self) -> None:
        """Take a slot now.

        Raises:
            CapacityRejection: none is free (429 ``http_retention_full``).
        """
        if self.in_use >= self.limit:
            self._rejected += 1
            raise CapacityRejection(
                "The router holds as many requests as it may; retry shortly.",
                code="http_retention_full",
            )
        self.in_use += 1

    def release(self) -> None:
        """Give a slot back."""
        self.in_use -= 1

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Take a slot now and give it back when the block ends, however it ends.

        Raises:
            CapacityRejection: none is free (429 ``http_retention_full``).
        """
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def statistics(self) -> RetentionStatistics:
        """A frozen snapshot."""
        return RetentionStatistics(self.in_use, self.limit, self._rejected)
