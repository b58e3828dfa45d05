"""The simulated engine's own account of its engine time: who each step worked for.

:func:`charge_step` is the engine's accounting of one step: each request in it is charged at
what it costs in a full batch on that engine, in the step's real time, and never more than the
step lasted (the admission benchmark's headline is built on it; :mod:`narwhal.bench.goodput`
re-exports it).

:class:`SimLedger` keeps that account inside a ``narwhal sim`` process started with
``--ledger``, for a benchmark on real sockets (``narwhal bench admission --real-time``), which
cannot watch the engine's step loop from another process. It is a
:class:`~narwhal.sim._steps.StepLedger` on the engine's step loop: each request is tagged by
the ``X-Request-Id`` header the engine received (Narwhal forwards the client's), and each step
is charged with :func:`charge_step` on the engine's own cost model. Times are on
:func:`time.monotonic`, a clock the benchmark's process shares, so it can cut the ledger to its
own measurement window. It aggregates by time bucket (1 s by default): the engine's busy
seconds per bucket, and each tag's charged seconds per bucket, a step across a bucket edge split
by its time on each side. Steps of untagged requests count in the busy time only. ``GET
/sim/ledger`` answers :meth:`SimLedger.as_json`.

Its figures are wall seconds of the engine as it runs: with ``--time-scale 4`` a step lasts four
times its calibrated cost, and is charged that. One engine runs one step at a time, so in any
bucket the charges add up to at most the busy time, which is at most the bucket's length.

The ledger keeps every tag's figures for the life of the process: it is a benchmark facility,
not for a long-running engine.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

if TYPE_CHECKING:
    from narwhal.sim.batching import BatchSeq, BatchStep

__all__ = ["CLOCK", "CostModel", "SimLedger", "charge_step"]

CLOCK = "time.monotonic"
"""The clock the ledger's buckets are on (:meth:`SimLedger.as_json` names it)."""


class CostModel(Protocol):
    """What :func:`charge_step` asks of an engine's physics (milliseconds of engine time); the
    admission benchmark weighs a request's cost by the same (``narwhal.bench.goodput``).

    The simulated engines' own :class:`~narwhal.sim.calibration.EngineType` answers it, and so
    does the router's :class:`~narwhal.scheduling.profiles.EngineProfile` (tests that count by
    hand).
    """

    @property
    def max_num_seqs(self) -> int:
        """The most sequences in the running batch."""
        ...

    @property
    def decode_base_ms(self) -> float:
        """Fixed cost of a decode step."""
        ...

    @property
    def decode_per_seq_ms(self) -> float:
        """Cost per decoding sequence."""
        ...

    @property
    def decode_per_kv_token_ms(self) -> float:
        """Cost per context token held by the decoding sequences."""
        ...

    def prefill_chunk_ms(self, start: int, end: int) -> float:
        """The variable cost of prefilling positions ``start .. end`` inside a step."""
        ...


def charge_step(
    costs: CostModel, step: BatchStep, duration_s: float
) -> list[tuple[BatchSeq, float]]:
    """What one engine step charges each request in it, in seconds of its engine time.

    Each decoding sequence is charged its share of a full batch: ``a_d / max_num_seqs + s_d +
    k_d`` times its context (its prompt and the tokens it has generated, as the step counted
    them); each prefill chunk its ``prefill_chunk_ms``. The charges are in the step's real time
    (``duration_s`` over its cost: the engine's scale, jitter and slowdown) and, should the
    cost model charge more than the step cost, cut down to it: a step never charges more than
    it lasted. What is left (empty seats, a prefill-only step's fixed cost) is overhead, charged
    to nobody. Call it before the step's sequences advance (as the step loop's ledger is).
    """
    charges: list[tuple[BatchSeq, float]] = []
    seat = costs.decode_base_ms / max(1, costs.max_num_seqs) + costs.decode_per_seq_ms
    per_kv = costs.decode_per_kv_token_ms
    for seq in step.decodes:
        charges.append((seq, seat + per_kv * (seq.prompt_tokens + seq.emitted)))
    for chunk in step.chunks:
        charges.append((chunk.seq, costs.prefill_chunk_ms(chunk.start, chunk.end)))
    charged = sum(ms for _, ms in charges)
    if charged <= 0 or step.cost_ms <= 0 or duration_s <= 0:
        return [(seq, 0.0) for seq, _ in charges]
    per_ms = duration_s / max(step.cost_ms, charged)
    return [(seq, ms * per_ms) for seq, ms in charges]


class SimLedger:
    """One engine's account of its steps, by request tag and time bucket (see the module doc).

    Args:
        costs: the engine's own cost model (its timing's ``profile``), which :func:`charge_step`
            charges by.
        bucket_s: the buckets' length in seconds; bucket ``k`` is ``[k * bucket_s, (k + 1) *
            bucket_s)`` on :data:`CLOCK`.
        clock: reads :data:`CLOCK` (tests pass their own).
    """

    def __init__(
        self,
        costs: CostModel,
        *,
        bucket_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (bucket_s > 0 and math.isfinite(bucket_s)):
            raise ValueError(f"the bucket length must be a number > 0, got {bucket_s!r}")
        self.costs = costs
        self.bucket_s = float(bucket_s)
        self._clock = clock
        self.steps = 0
        self.busy: dict[int, float] = {}
        self.charges: dict[str, dict[int, float]] = {}
        self._tags: weakref.WeakKeyDictionary[BatchSeq, str] = weakref.WeakKeyDictionary()
        self._last_end = -math.inf

    def submitted(self, seq: BatchSeq, request_id: str | None) -> None:
        """Tag ``seq`` with its request's ``X-Request-Id`` (untagged: busy time only)."""
        if request_id is not None:
            self._tags[seq] = request_id
            self.charges.setdefault(request_id, {})

    def stepped(self, step: BatchStep, start: float, duration_s: float) -> None:
        """Charge ``step``, which ran from Trio time ``start`` for ``duration_s`` seconds."""
        if duration_s <= 0:
            return
        self.steps += 1
        # On the shared clock: the Trio clock's distance to it, read now. The two are read at
        # slightly different instants, so a step is never put before the previous one's end
        # (one engine runs one step at a time).
        begin = max(start + (self._clock() - trio.current_time()), self._last_end)
        end = begin + duration_s
        self._last_end = end
        pieces = self._pieces(begin, end)
        busy = self.busy
        for bucket, seconds in pieces:
            busy[bucket] = busy.get(bucket, 0.0) + seconds
        tags = self._tags
        charges = self.charges
        for seq, charge in charge_step(self.costs, step, duration_s):
            tag = tags.get(seq)
            if tag is None or charge <= 0:
                continue
            account = charges[tag]
            for bucket, seconds in pieces:
                account[bucket] = account.get(bucket, 0.0) + charge * (seconds / duration_s)

    def _pieces(self, begin: float, end: float) -> list[tuple[int, float]]:
        """``[begin, end]`` cut at the bucket edges: each bucket with its seconds in it."""
        size = self.bucket_s
        first, last = math.floor(begin / size), math.floor(end / size)
        if first >= last:
            return [(first, end - begin)]
        pieces = [(first, (first + 1) * size - begin)]
        pieces += [(bucket, size) for bucket in range(first + 1, last)]
        if end > last * size:
            pieces.append((last, end - last * size))
        return pieces

    def as_json(self) -> dict[str, Any]:
        """The ledger as plain values (``GET /sim/ledger``): the clock, the bucket length, the
        steps charged, the busy seconds per bucket and each tag's charged seconds per bucket
        (buckets by number, as strings: bucket ``k`` starts at ``k * bucket_s``)."""
        return {
            "clock": CLOCK,
            "bucket_s": self.bucket_s,
            "steps": self.steps,
            "busy_s": {str(bucket): seconds for bucket, seconds in self.busy.items()},
            "charged_s": {
                tag: {str(bucket): seconds for bucket, seconds in account.items()}
                for tag, account in self.charges.items()
            },
        }
