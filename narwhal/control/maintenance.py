"""Maintenance waves: taking the engines of one wave label out of placement, and back.

Every engine has a wave label (``[[engines]] wave``). Starting a wave takes its engines out of
placement (:meth:`~narwhal.scheduling.engines.Engine.enter_maintenance`): nothing new is placed
there, what runs there finishes, and the wave is *drained* once no request holds a slot on any
of its engines. Ending it makes them placeable again and wakes the dispatcher, so that work
waiting in the queue may go there at once.

A **capacity guard** refuses to start a wave that would leave less than
``maintenance.min_capacity_share`` of the pool's capacity serving, unless forced. Capacity is
counted by each engine's learned speed, not by engine count (:func:`capacity_rps`): an engine
its forecast has learned to be twice as slow as its profile counts half. What is left is the
engines that would still be eligible: healthy, and in no wave.

When every engine is in a wave the router is in whole-wave maintenance
(``router.control.set_maintenance``): the completion routes answer 503 ``router_maintenance``.

The arithmetic (:func:`capacity_rps`, :meth:`Maintenance.capacity`) is pure; the one task,
:meth:`Maintenance.run`, only notes the instant each wave drains.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import attrs
import trio

from narwhal.config import MaintenanceConfig
from narwhal.control.state import ControlState
from narwhal.errors import CapacityGuard, WaveNotFound
from narwhal.scheduling.engines import Engine, EnginePool

__all__ = [
    "REFERENCE_OUTPUT_TOKENS",
    "REFERENCE_PROMPT_TOKENS",
    "Capacity",
    "Maintenance",
    "WaveStatistics",
    "capacity_rps",
]

log = logging.getLogger(__name__)

# The request shape capacity is counted in (a typical chat turn): any fixed shape ranks engines
# the same way, and the guard compares shares of one pool, never absolute figures.
REFERENCE_PROMPT_TOKENS = 1024
REFERENCE_OUTPUT_TOKENS = 256

REASON = "router_maintenance"


def capacity_rps(engine: Engine) -> float:
    """Reference requests per second the engine serves with a full batch, at its learned speed.

    A reference request (:data:`REFERENCE_PROMPT_TOKENS` in, :data:`REFERENCE_OUTPUT_TOKENS`
    out) costs the engine its prefill, at the forecast's learned prefill ``scale``, plus its
    share of the decode steps of a full batch (the smaller of ``decode_concurrency`` and the
    profile's ``max_num_seqs``), as the forecast has learned them (``decode_slope``,
    ``decode_scale``). The latency the forecast
    learns (front end, network) does not queue, so it costs no capacity.
    """
    forecast = engine.forecast
    profile = forecast.profile
    batch = max(1, min(engine.decode_limit, profile.max_num_seqs))
    context = batch * (REFERENCE_PROMPT_TOKENS + REFERENCE_OUTPUT_TOKENS // 2)
    prefill_s = profile.prefill_ms(REFERENCE_PROMPT_TOKENS) / 1000 * forecast.scale
    step_s = forecast.decode_step_s(batch, context)
    per_request_s = prefill_s + REFERENCE_OUTPUT_TOKENS * step_s / batch
    return 1.0 / per_request_s if per_request_s > 0 else math.inf


@attrs.frozen
class Capacity:
    """The pool's capacity, and what would be left serving (reference requests per second).

    Attributes:
        total: every configured engine's.
        left: the engines that would still serve: eligible by health, in no wave.
        min_share: ``maintenance.min_capacity_share``.
    """

    total: float
    left: float
    min_share: float

    @property
    def share(self) -> float:
        """``left`` over ``total`` (1.0 for a pool of no capacity at all)."""
        return self.left / self.total if self.total > 0 else 1.0

    @property
    def enough(self) -> bool:
        """Whether what is left meets the guard."""
        return self.share >= self.min_share

    def as_json(self) -> dict[str, float]:
        """The figures, rounded for people."""
        return {
            "total_rps": round(self.total, 3),
            "left_rps": round(self.left, 3),
            "left_share": round(self.share, 4),
            "min_share": self.min_share,
        }


@attrs.define
class _Wave:
    started_at: float
    forced: bool
    drained_at: float | None = None


@attrs.frozen
class WaveStatistics:
    """One wave as ``/admin/maintenance`` shows it.

    Attributes:
        wave: the label.
        engines: its engines' names.
        in_maintenance: whether the wave is started.
        forced: started with ``?force=true``.
        running: requests holding a slot on each of its engines (prefill and decode).
        started_s: seconds since it started (``None`` when not in maintenance).
        drained_after_s: seconds from its start until its engines held no request
            (``None`` until then, or when not in maintenance).
        capacity: the pool's capacity now, with what would be left were this wave (and every
            wave already started) out.
    """

    wave: str
    engines: tuple[str, ...]
    in_maintenance: bool
    forced: bool
    running: tuple[tuple[str, int], ...]
    started_s: float | None
    drained_after_s: float | None
    capacity: Capacity

    @property
    def running_total(self) -> int:
        """Requests still running on the wave's engines."""
        return sum(count for _, count in self.running)

    @property
    def drained(self) -> bool:
        """In maintenance, with nothing running on its engines any more."""
        return self.in_maintenance and self.running_total == 0

    def as_json(self) -> dict[str, object]:
        """The JSON body of the maintenance routes."""
        return {
            "wave": self.wave,
            "engines": list(self.engines),
            "in_maintenance": self.in_maintenance,
            "forced": self.forced,
            "running": self.running_total,
            "running_by_engine": dict(self.running),
            "drained": self.drained,
            "started_s": self.started_s,
            "drained_after_s": self.drained_after_s,
            "capacity": self.capacity.as_json(),
        }


class Maintenance:
    """The maintenance waves of one router's engine pool.

    Args:
        pool: the engines; each one's ``config.wave`` is its label.
        control: the router's state; whole-wave maintenance is set and cleared here only.
        config: ``[maintenance]``.
    """

    def __init__(self, pool: EnginePool, control: ControlState, config: MaintenanceConfig) -> None:
        self.pool = pool
        self.control = control
        self.min_share = config.min_capacity_share
        self._labels: dict[str, tuple[Engine, ...]] = {}
        for engine in pool:
            self._labels[engine.config.wave] = (*self._labels.get(engine.config.wave, ()), engine)
        self._started: dict[str, _Wave] = {}

    @property
    def labels(self) -> tuple[str, ...]:
        """Every configured wave label, in configuration order."""
        return tuple(self._labels)

    def engines_of(self, wave: str) -> tuple[Engine, ...]:
        """The engines labelled ``wave``.

        Raises:
            WaveNotFound: no engine has that label.
        """
        try:
            return self._labels[wave]
        except KeyError:
            known = ", ".join(self._labels)
            raise WaveNotFound(
                f"No engine is in maintenance wave `{wave}`; the waves are: {known}."
            ) from None

    # -- reading --------------------------------------------------------------------------------

    def capacity(self, without: Iterable[str] = ()) -> Capacity:
        """The pool's capacity, and what is left serving were the waves ``without`` out too."""
        out = set(without)
        total = left = 0.0
        for engine in self.pool:
            rps = capacity_rps(engine)
            total += rps
            if engine.eligible and engine.config.wave not in out:
                left += rps
        return Capacity(total=total, left=left, min_share=self.min_share)

    def status(self, wave: str) -> WaveStatistics:
        """Where ``wave`` stands now.

        Raises:
            WaveNotFound: no engine has that label.
        """
        engines = self.engines_of(wave)
        self._note_drained()
        now = trio.current_time()
        started = self._started.get(wave)
        return WaveStatistics(
            wave=wave,
            engines=tuple(engine.name for engine in engines),
            in_maintenance=started is not None,
            forced=started is not None and started.forced,
            running=tuple((engine.name, len(engine.slots)) for engine in engines),
            started_s=None if started is None else now - started.started_at,
            drained_after_s=(
                None
                if started is None or started.drained_at is None
                else started.drained_at - started.started_at
            ),
            capacity=self.capacity([*self._started, wave]),
        )

    def statistics(self) -> tuple[WaveStatistics, ...]:
        """Every wave, in configuration order."""
        return tuple(self.status(wave) for wave in self._labels)

    # -- changing -------------------------------------------------------------------------------

    def start(self, wave: str, *, force: bool = False) -> WaveStatistics:
        """Start ``wave``: its engines take no new placements; what runs there finishes.

        Starting a wave already started changes nothing (and checks nothing).

        Raises:
            WaveNotFound: no engine has that label.
            CapacityGuard: what would be left is under ``min_capacity_share`` of the pool's
                capacity, and ``force`` is false.
        """
        engines = self.engines_of(wave)
        if wave in self._started:
            return self.status(wave)
        capacity = self.capacity([*self._started, wave])
        if not capacity.enough and not force:
            raise CapacityGuard(
                f"Starting maintenance wave `{wave}` would leave {capacity.share:.1%} of the "
                f"pool's capacity serving ({capacity.left:.2f} of {capacity.total:.2f} "
                f"reference requests/s), under maintenance.min_capacity_share "
                f"{capacity.min_share:.1%}; add ?force=true to start it anyway."
            )
        self._started[wave] = _Wave(started_at=trio.current_time(), forced=force)
        names = ", ".join(engine.name for engine in engines)
        log.warning(
            "maintenance wave %s started%s: engines %s take no new requests "
            "(%.1f%% of capacity left serving)",
            wave,
            " (forced past the capacity guard)" if not capacity.enough else "",
            names,
            capacity.share * 100,
        )
        for engine in engines:
            engine.enter_maintenance(wave)
        self._whole_wave()
        return self.status(wave)

    def end(self, wave: str) -> WaveStatistics:
        """End ``wave``: its engines are placeable again (once healthy) and the dispatcher is
        woken. Ending a wave that is not started changes nothing.

        Raises:
            WaveNotFound: no engine has that label.
        """
        engines = self.engines_of(wave)
        if self._started.pop(wave, None) is not None:
            for engine in engines:
                engine.leave_maintenance()
            self._whole_wave()
            log.warning("maintenance wave %s ended: its engines take requests again", wave)
        return self.status(wave)

    def _whole_wave(self) -> None:
        every = all(engine.maintenance is not None for engine in self.pool)
        self.control.set_maintenance(REASON if every else None)

    def _note_drained(self) -> None:
        now = trio.current_time()
        for wave, started in self._started.items():
            if started.drained_at is None and not any(e.slots for e in self._labels[wave]):
                started.drained_at = now
                log.info("maintenance wave %s drained after %.3f s", wave, now - started.started_at)

    # -- waiting --------------------------------------------------------------------------------

    async def wait_drained(self, wave: str, wait_s: float) -> WaveStatistics:
        """Where ``wave`` stands once it is drained, no longer in maintenance, or ``wait_s``
        has passed, whichever comes first.

        Raises:
            WaveNotFound: no engine has that label.
        """
        self.engines_of(wave)
        with trio.move_on_after(wait_s):
            while True:
                # Taken before looking: a slot freed in between still wakes us.
                changed = self.pool.next_change()
                status = self.status(wave)
                if status.drained or not status.in_maintenance:
                    return status
                await changed.wait()
        return self.status(wave)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Note the instant each started wave drains (run it in the app's nursery).

        Every slot released wakes the pool (:meth:`EnginePool.notify`), so the time is exact.
        """
        task_status.started()
        while True:
            changed = self.pool.next_change()
            self._note_drained()
            await changed.wait()
