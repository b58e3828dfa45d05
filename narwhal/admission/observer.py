"""What admission decided and why, and how it turned out: the router's observer seam (pure).

Every sized request gets one :class:`Decision` (its projection at arrival, if its mode projects,
and the verdict), told to every :class:`AdmissionObserver` on the router before the verdict is
applied; an admitted request that completes is told again with what was measured
(:class:`Served`), so that the projection's error can be scored. The metrics
(:mod:`narwhal.web.metrics`), shadow mode's records and the admission benchmark all listen here;
nothing else needs to reach inside admission to see it.

Observers are called in the request's own task, synchronously, and must not block or raise:
they are told, they do not decide. With none listening, telling them costs a loop over an empty
tuple.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, Protocol

import attrs

from narwhal.admission.predictor import Projection
from narwhal.errors import PredictiveRefusal

__all__ = ["AdmissionMode", "AdmissionObserver", "Decision", "Observers", "Served", "Verdict"]

AdmissionMode = Literal["open", "predictive", "shadow"]
Verdict = Literal["admitted", "refused", "unavailable"]


@attrs.frozen
class Decision:
    """What admission decided for one sized request, and why.

    Attributes:
        mode: ``admission.mode`` when it was decided.
        budget_s: ``admission.ttft_budget_s`` it was judged against.
        verdict: ``admitted`` (it goes to the queue), ``refused`` (429, predictive mode) or
            ``unavailable`` (503: no eligible engine could serve it).
        projection: the projection at arrival; ``None`` in open mode, and when no engine could
            serve the request.
        code: the code of the refusal predictive admission makes of this projection
            (``ttft_budget_exceeded`` or ``prompt_exceeds_ttft_budget``), or ``None``. When
            the verdict is ``admitted`` it was recorded and not applied: a shadow-mode
            would-be refusal.
        headers: the refusal's headers (``Retry-After`` among them), as it would send them.
        request_id: the request's id (its ``x-request-id``), whichever process served it.
    """

    mode: AdmissionMode
    budget_s: float
    verdict: Verdict
    projection: Projection | None = None
    code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    request_id: str = ""

    @classmethod
    def of(
        cls,
        mode: AdmissionMode,
        budget_s: float,
        verdict: Verdict,
        projection: Projection | None = None,
        refusal: PredictiveRefusal | None = None,
        *,
        request_id: str = "",
    ) -> Decision:
        """A decision, with ``refusal``'s code and headers (the object itself is not kept)."""
        if refusal is None:
            return cls(mode, budget_s, verdict, projection, request_id=request_id)
        headers = tuple(refusal.headers.items())
        return cls(mode, budget_s, verdict, projection, refusal.code, headers, request_id)

    @property
    def retry_after(self) -> str | None:
        """The ``Retry-After`` the refusal carries (``None``: none, or no refusal)."""
        return next((value for name, value in self.headers if name == "Retry-After"), None)

    @property
    def would_refuse(self) -> bool:
        """Predictive admission refuses this projection (applied or not)."""
        return self.code is not None

    @property
    def shadow_refusal(self) -> bool:
        """A refusal recorded and not applied: the request was admitted all the same."""
        return self.code is not None and self.verdict == "admitted"


@attrs.frozen
class Served:
    """What an admitted request that completed measured.

    Attributes:
        engine: the engine that answered.
        ttft_s: arrival to its first output event (``None``: none seen, a whole answer).
        placement_ttft_s: the first token predicted at placement, from arrival.
    """

    engine: str
    ttft_s: float | None
    placement_ttft_s: float | None

    def projection_error(self, decision: Decision) -> float | None:
        """Observed TTFT over the typical projection at arrival (``None``: nothing to score)."""
        projection = decision.projection
        if self.ttft_s is None or projection is None or projection.typical_s <= 0:
            return None
        return self.ttft_s / projection.typical_s

    @property
    def placement_error(self) -> float | None:
        """Observed TTFT over the prediction at placement (``None``: nothing to score)."""
        if self.ttft_s is None or not self.placement_ttft_s:
            return None
        return self.ttft_s / self.placement_ttft_s


class AdmissionObserver(Protocol):
    """Told what admission decided, and how an admitted request turned out."""

    def decided(self, decision: Decision) -> None:
        """``decision`` was made, and is about to be applied."""

    def served(self, decision: Decision, served: Served) -> None:
        """A request admitted by ``decision`` completed, measuring ``served``."""


@attrs.define(eq=False)
class Observers:
    """The router's observers, told in the order they were added."""

    _observers: tuple[AdmissionObserver, ...] = ()

    def add(self, observer: AdmissionObserver) -> None:
        """Tell ``observer`` from now on."""
        self._observers = (*self._observers, observer)

    def remove(self, observer: AdmissionObserver) -> None:
        """Stop telling ``observer``."""
        self._observers = tuple(o for o in self._observers if o is not observer)

    @contextmanager
    def watching(self, observer: AdmissionObserver) -> Iterator[AdmissionObserver]:
        """Tell ``observer`` while the block runs."""
        self.add(observer)
        try:
            yield observer
        finally:
            self.remove(observer)

    def decided(self, decision: Decision) -> None:
        """Tell every observer of ``decision``."""
        for observer in self._observers:
            observer.decided(decision)

    def served(self, decision: Decision, served: Served) -> None:
        """Tell every observer how the request ``decision`` admitted turned out."""
        for observer in self._observers:
            observer.served(decision, served)

    def __len__(self) -> int:
        return len(self._observers)
