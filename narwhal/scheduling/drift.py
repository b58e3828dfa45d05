"""Drift: how far an engine runs from what its forecast predicts (pure, no I/O).

Two running ratios per engine, observed over predicted:

* **TTFT**, once per request: the time from placement to the first token, over the prediction
  made at placement (:attr:`~narwhal.scheduling.engines.Slot.predicted_first_token_at`);
* **TPOT**, once per request, at its end: its inter-token gaps per token, over the forecast's
  time per output token at each gap (:meth:`~narwhal.scheduling.forecast.PrefillForecast.tpot_s`).

The forecast learns online, so its predictions follow a slower engine within a few requests:
their error alone would hide a slowdown. Drift is measured against the engine as it was last
measured: each prediction is taken back to the speed of the last profiling by dividing it by
``learned``, the forecast's learned scale over the scale that profiling fitted, as it was
when the prediction was made (:meth:`Drift.observe_ttft`; what the forecast learns while a
request waits is not held against that request's prediction, or a slowdown being learned
would read twice over). The ratio thus says how far the engine is from its profiling,
which a re-profiling corrects; the **residual** (observed over the prediction as it was) says
how far the forecast still is from the engine, which the placement penalty corrects.

Each is an exponentially weighted moving average of the per-request ratio, each request
weighing 0.2. A few milliseconds are added to both sides of every ratio
(:data:`FLOOR_S`) so that the jitter of tiny predictions is not read as drift.

Both ratios act. TPOT can, because the decode probes time batches of several sizes, so the
profiling fits how the engine's decode step grows with the batch (an engine whose step grows
faster than its profile's reads 1.0 at a full batch as at one sequence), and because only the
gaps whose steps only decoded count (:meth:`~narwhal.scheduling.engines.Slot.observe_gap`):
a step that also prefills takes its prefill chunk longer than the decode step predicted.

The state, from whichever phase has left ``warming`` (the worse of the two):

* ``warming``: fewer than :attr:`Drift.warm_up` samples of each phase since the last reset;
* ``ok``: the ratios inside ``1 / 1.5 .. 1.5``;
* ``sustained``: a ratio beyond 1.5 for :attr:`Drift.sustain` samples in a row. The
  engine's placement is penalised (:attr:`Drift.penalty`, the TTFT residual) and it is
  re-profiled when it next holds no request;
* ``severe``: beyond 3 for :attr:`Drift.sustain` requests in a row: penalised, and
  taken out of placement (reason ``drift: ...``,
  :meth:`~narwhal.scheduling.engines.Engine.hold_for_drift`) unless it is its pool's last
  eligible engine or the forecast has not learned it slower itself; held, it drains, and its
  re-profiling when idle ends the hold.

An engine faster than its forecast (a ratio below ``1 / 1.5``) is reported ``fast``: it is not
penalised, and it is re-profiled when idle so that its speed is used.
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["FLOOR_S", "Drift", "DriftRatio", "DriftState", "DriftStatistics"]

DriftState = Literal["warming", "ok", "fast", "sustained", "severe"]

FLOOR_S = 0.005
"""Seconds added to the observed and the predicted time of every sample."""

_RATIO_BOUNDS = (0.1, 10.0)  # one sample moves the average by at most this much


@attrs.define
class DriftRatio:
    """One phase's running ratio of observed to predicted time.

    Attributes:
        weight: each sample's weight in the moving average.
        ratio: the moving average against the last profiling (1.0: the engine runs as it was
            measured).
        residual: the moving average against the predictions as they were made (1.0: the
            forecast, learning included, is right).
        samples: samples seen since the last reset.
        above: samples in a row with the average beyond the sustained threshold.
        far_above: samples in a row with the average beyond the severe threshold.
        below: samples in a row with the average below the inverse of the sustained threshold.
    """

    weight: float
    ratio: float = 1.0
    residual: float = 1.0
    samples: int = 0
    above: int = 0
    far_above: int = 0
    below: int = 0

    def observe(
        self,
        observed_s: float,
        predicted_s: float,
        *,
        learned: float = 1.0,
        sustained: float,
        severe: float,
    ) -> None:
        """One sample: ``observed_s`` where ``predicted_s`` was predicted by a forecast that
        has learned ``learned`` times the speed of the last profiling."""
        if not (observed_s >= 0 and predicted_s >= 0 and learned > 0):  # NaN, negative
            return
        residual = (observed_s + FLOOR_S) / (predicted_s + FLOOR_S)
        sample = (observed_s + FLOOR_S) / (predicted_s / learned + FLOOR_S)
        low, high = _RATIO_BOUNDS
        self.residual += self.weight * (min(max(residual, low), high) - self.residual)
        self.ratio += self.weight * (min(max(sample, low), high) - self.ratio)
        self.samples += 1
        self.above = self.above + 1 if self.ratio > sustained else 0
        self.far_above = self.far_above + 1 if self.ratio > severe else 0
        self.below = self.below + 1 if self.ratio < 1 / sustained else 0


@attrs.frozen
class DriftStatistics:
    """A snapshot of one engine's drift, as ``/ready`` and ``/metrics`` show it."""

    ttft: float
    tpot: float
    state: DriftState
    penalty: float

    def as_json(self) -> dict[str, object]:
        """The ``drift`` object of an engine in ``/ready``."""
        return {"ttft": round(self.ttft, 3), "tpot": round(self.tpot, 3), "state": self.state}


@attrs.define
class Drift:
    """One engine's drift (see the module doc).

    Attributes:
        sustained_at: the ratio beyond which drift is sustained (after ``sustain`` samples).
        severe_at: the ratio beyond which drift is severe (after ``sustain`` samples).
        sustain: samples in a row a ratio must stay beyond a threshold.
        warm_up: samples of a phase before it can leave ``warming``.
    """

    sustained_at: float = 1.5
    severe_at: float = 3.0
    sustain: int = 8
    warm_up: int = 10
    ttft: DriftRatio = attrs.field(factory=lambda: DriftRatio(0.2))
    tpot: DriftRatio = attrs.field(factory=lambda: DriftRatio(0.2))

    def observe_ttft(
        self, observed_s: float, predicted_s: float, *, learned: float = 1.0
    ) -> DriftState:
        """A first token arrived ``observed_s`` after placement, where ``predicted_s`` was
        predicted by a forecast whose prefill scale is ``learned`` times the last profiling's;
        return the new state."""
        self.ttft.observe(
            observed_s,
            predicted_s,
            learned=learned,
            sustained=self.sustained_at,
            severe=self.severe_at,
        )
        return self.state

    def observe_tpot(
        self, observed_s: float, predicted_s: float, *, learned: float = 1.0
    ) -> DriftState:
        """A request's inter-token gaps came ``observed_s`` per token, where ``predicted_s``
        was predicted with a decode scale ``learned`` times the last profiling's; return the
        new state."""
        self.tpot.observe(
            observed_s,
            predicted_s,
            learned=learned,
            sustained=self.sustained_at,
            severe=self.severe_at,
        )
        return self.state

    @property
    def state(self) -> DriftState:
        """The drift state now (see the module doc)."""
        phases = [p for p in (self.ttft, self.tpot) if p.samples >= self.warm_up]
        if not phases:
            return "warming"
        if any(p.far_above >= self.sustain for p in phases):
            return "severe"
        if any(p.above >= self.sustain for p in phases):
            return "sustained"
        if any(p.below >= self.sustain for p in phases):
            return "fast"
        return "ok"

    @property
    def wants_profile(self) -> bool:
        """Whether the engine should be re-profiled (sustained, severe or fast drift)."""
        return self.state in ("sustained", "severe", "fast")

    @property
    def penalty(self) -> float:
        """What placement multiplies the engine's predicted wait by: 1.0 unless drift is
        sustained or severe, then the TTFT residual (at least 1): what the forecast has not
        learned yet."""
        if self.state not in ("sustained", "severe"):
            return 1.0
        return max(1.0, self.ttft.residual)

    def reset(self) -> None:
        """Start again (the engine was just profiled: its forecast is new)."""
        self.ttft = DriftRatio(self.ttft.weight)
        self.tpot = DriftRatio(self.tpot.weight)

    def statistics(self) -> DriftStatistics:
        """A frozen snapshot."""
        return DriftStatistics(self.ttft.ratio, self.tpot.ratio, self.state, self.penalty)
