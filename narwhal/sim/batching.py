"""The continuous-batching scheduler of the simulated engine (pure, no I/O, no clock).

A :class:`Batcher` holds what a vLLM-like engine holds: a running batch of at most
``max_num_seqs`` sequences, a FCFS waiting queue, and a KV cache of ``kv_capacity_tokens``. The
Trio shell (:class:`narwhal.sim.SimEngine`) asks it for the next step, sleeps the step's cost,
then reports the step complete; everything else is plain arithmetic tested without an event loop.

The rules of one step (:meth:`Batcher.next_step`):

1. Every running sequence whose prompt is prefilled decodes one token; each takes one token of
   the step's ``max_num_batched_tokens`` budget.
2. The rest of the budget goes to prefill chunks, FCFS: first to running sequences whose prompt is
   partly prefilled, in admission order, then to waiting requests, admitted in arrival order
   while the budget is not spent, the batch has fewer than ``max_num_seqs`` sequences, and the
   request's prompt plus its whole output fits in the free KV (its KV is reserved in full at
   admission, so nothing is ever preempted). The queue is strict FCFS: a head that does not fit
   blocks the others. A request too large for the whole cache is admitted alone into an empty
   engine rather than wait forever.
3. The step costs ``decode_step_ms(B, K)`` (``B`` decoding sequences holding ``K`` context
   tokens: prompt plus tokens generated so far) plus ``prefill_chunk_ms(start, end)`` for each
   chunk, plus ``prefill_base_ms`` when the step prefills and nothing decodes. A lone prompt of
   ``n <= max_num_batched_tokens`` tokens therefore costs exactly ``prefill_ms(n)``.

When a step completes (:meth:`Batcher.complete`), each decoding sequence has produced its next
token, and each sequence whose last prompt chunk was in the step has produced its first token. A
sequence's output *steps* count these emissions: step 1 is the first token (the end of prefill),
step ``k`` the ``k``-th token. A request with no output still takes step 1 (its prefill). A
sequence that has produced all its tokens leaves the batch and frees its KV at once.
"""

from __future__ import annotations

from collections import deque
from typing import Literal, Protocol

import attrs

__all__ = [
    "BatchSeq",
    "BatchStep",
    "Batcher",
    "BatcherStatistics",
    "PrefillChunk",
    "SeqState",
    "StepCosts",
]

SeqState = Literal["waiting", "running", "finished", "aborted"]


class StepCosts(Protocol):
    """What the batcher asks of an engine's physics (milliseconds of engine time).

    The simulator's own :class:`~narwhal.sim.calibration.EngineType` answers it; so does any
    object of the same shape (a test can run the engines on the router's prior exactly).
    """

    @property
    def prefill_base_ms(self) -> float:
        """Fixed cost of a step that prefills and does not decode."""
        ...

    @property
    def max_num_seqs(self) -> int:
        """The most sequences in the running batch."""
        ...

    @property
    def max_num_batched_tokens(self) -> int:
        """The most tokens in a step."""
        ...

    @property
    def kv_capacity_tokens(self) -> int:
        """KV cache capacity, in tokens."""
        ...

    def prefill_chunk_ms(self, start: int, end: int) -> float:
        """The variable cost of prefilling positions ``start .. end`` inside a step."""
        ...

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """The cost of a decode step over ``batch`` sequences holding ``context_tokens``."""
        ...


@attrs.define(eq=False)
class BatchSeq:
    """One request inside the batcher.

    Attributes:
        id: a number unique within its batcher.
        prompt_tokens: the prompt's size.
        output_tokens: how many tokens it generates.
        state: ``waiting`` (queued), ``running`` (in the batch), ``finished``, ``aborted``.
        prefilled: prompt tokens prefilled so far.
        emitted: output steps completed (1 once the prompt is prefilled, then one per decode).
    """

    id: int
    prompt_tokens: int
    output_tokens: int
    state: SeqState = "waiting"
    prefilled: int = 0
    emitted: int = 0

    @property
    def steps(self) -> int:
        """Output steps it takes: one per output token, at least one (the prefill)."""
        return max(1, self.output_tokens)

    @property
    def kv_tokens(self) -> int:
        """KV it reserves while running: its prompt and its whole output."""
        return self.prompt_tokens + self.output_tokens

    @property
    def done(self) -> bool:
        """It has left the batcher (finished or aborted)."""
        return self.state in ("finished", "aborted")


@attrs.frozen
class PrefillChunk:
    """Prompt positions ``start .. end`` of one sequence, prefilled in one step."""

    seq: BatchSeq
    start: int
    end: int


@attrs.frozen
class BatchStep:
    """One planned engine step.

    Attributes:
        index: the step's number in its batcher (0, 1, ...; seeds the jitter).
        decodes: the sequences that decode one token.
        chunks: the prefill chunks.
        context_tokens: ``K``, the context tokens the decoding sequences hold.
        cost_ms: the step's engine time from the costs, before any scale.
    """

    index: int
    decodes: tuple[BatchSeq, ...]
    chunks: tuple[PrefillChunk, ...]
    context_tokens: int
    cost_ms: float

    @property
    def tokens(self) -> int:
        """Tokens the step processes (one per decode plus the chunks)."""
        return len(self.decodes) + sum(chunk.end - chunk.start for chunk in self.chunks)


@attrs.frozen
class BatcherStatistics:
    """A snapshot of a :class:`Batcher`.

    Attributes:
        running: sequences in the batch (prefilling or decoding).
        prefilling: of those, still prefilling.
        waiting: requests queued for admission.
        kv_tokens: KV reserved by the running sequences.
        kv_capacity_tokens: the KV capacity.
        steps: steps completed.
        prefill_tokens: the whole prompts of the requests whose first token has not come yet
            (waiting, or running and still prefilling, however far): what vLLM's
            ``--max-num-queued-tokens`` counts.
    """

    running: int
    prefilling: int
    waiting: int
    kv_tokens: int
    kv_capacity_tokens: int
    steps: int
    prefill_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """``kv_tokens`` over the capacity, at most 1."""
        return min(1.0, self.kv_tokens / self.kv_capacity_tokens)


def _profile_capacity(batcher: Batcher) -> int:
    return batcher.profile.kv_capacity_tokens


@attrs.define
class Batcher:
    """A continuous-batching scheduler over one engine's :class:`StepCosts` (see the module doc).

    Attributes:
        profile: step costs and the limits ``max_num_seqs`` and ``max_num_batched_tokens``.
        kv_capacity_tokens: KV capacity; default the profile's.
    """

    profile: StepCosts
    kv_capacity_tokens: int = attrs.field(
        default=attrs.Factory(_profile_capacity, takes_self=True), validator=attrs.validators.gt(0)
    )
    _waiting: deque[BatchSeq] = attrs.field(init=False, factory=deque)
    _running: list[BatchSeq] = attrs.field(init=False, factory=list)
    _kv_tokens: int = attrs.field(init=False, default=0)
    _prefill_tokens: int = attrs.field(init=False, default=0)
    _steps: int = attrs.field(init=False, default=0)
    _next_id: int = attrs.field(init=False, default=0)

    def submit(self, prompt_tokens: int, output_tokens: int) -> BatchSeq:
        """Queue a request; it joins the batch at a coming step."""
        seq = BatchSeq(self._next_id, max(0, prompt_tokens), max(0, output_tokens))
        self._next_id += 1
        self._waiting.append(seq)
        self._prefill_tokens += seq.prompt_tokens
        return seq

    @property
    def prefill_tokens(self) -> int:
        """The whole prompts of the requests still before their first token (waiting or
        prefilling), as :attr:`BatcherStatistics.prefill_tokens`."""
        return self._prefill_tokens

    def abort(self, seq: BatchSeq) -> None:
        """Take ``seq`` out (its reader went away); its KV is free at once. Idempotent."""
        if seq.state == "waiting":
            self._waiting.remove(seq)
        elif seq.state == "running":
            self._running.remove(seq)
            self._kv_tokens -= seq.kv_tokens
        else:
            return
        if seq.emitted == 0:
            self._prefill_tokens -= seq.prompt_tokens
        seq.state = "aborted"

    def clear(self) -> None:
        """Abort everything (the engine moved to another Trio run)."""
        for seq in [*self._waiting, *self._running]:
            seq.state = "aborted"
        self._waiting.clear()
        self._running.clear()
        self._kv_tokens = 0
        self._prefill_tokens = 0

    def next_step(self) -> BatchStep | None:
        """Plan the next step, admitting waiting requests; None when there is nothing to do."""
        profile = self.profile
        budget = profile.max_num_batched_tokens
        decodes: list[BatchSeq] = []
        prefilling: list[BatchSeq] = []
        context = 0
        for seq in self._running:
            if seq.emitted == 0:
                prefilling.append(seq)
            elif len(decodes) < budget:
                decodes.append(seq)
                context += seq.prompt_tokens + seq.emitted
        budget -= len(decodes)
        chunks: list[PrefillChunk] = []
        for seq in prefilling:
            chunk = self._chunk(seq, budget)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
        while self._waiting and len(self._running) < profile.max_num_seqs:
            seq = self._waiting[0]
            if (budget == 0 and seq.prompt_tokens > 0) or not self._fits(seq):
                break
            self._admit(self._waiting.popleft())
            chunk = self._chunk(seq, budget)
            assert chunk is not None  # the budget covers at least one token of it
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
        if not decodes and not chunks:
            return None
        cost = profile.decode_step_ms(len(decodes), context)
        for chunk in chunks:
            cost += profile.prefill_chunk_ms(chunk.start, chunk.end)
        if chunks and not decodes:
            cost += profile.prefill_base_ms
        return BatchStep(self._steps, tuple(decodes), tuple(chunks), context, cost)

    def complete(self, step: BatchStep) -> list[BatchSeq]:
        """Apply a finished step; returns the sequences that produced an output step.

        Sequences aborted while the step ran are skipped; those done leave the batch.
        """
        self._steps += 1
        advanced: list[BatchSeq] = []
        for seq in step.decodes:
            if seq.state == "running":
                seq.emitted += 1
                advanced.append(seq)
        for chunk in step.chunks:
            seq = chunk.seq
            if seq.state == "running":
                seq.prefilled = chunk.end
                if seq.prefilled == seq.prompt_tokens:
                    seq.emitted = 1
                    self._prefill_tokens -= seq.prompt_tokens
                    advanced.append(seq)
        finished = False
        for seq in advanced:
            if seq.emitted >= seq.steps:
                seq.state = "finished"
                self._kv_tokens -= seq.kv_tokens
                finished = True
        if finished:
            self._running = [seq for seq in self._running if seq.state == "running"]
        return advanced

    def statistics(self) -> BatcherStatistics:
        """A snapshot of the batcher."""
        return BatcherStatistics(
            running=len(self._running),
            prefilling=sum(1 for seq in self._running if seq.emitted == 0),
            waiting=len(self._waiting),
            kv_tokens=self._kv_tokens,
            kv_capacity_tokens=self.kv_capacity_tokens,
            steps=self._steps,
            prefill_tokens=self._prefill_tokens,
        )

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing waits."""
        return not self._running and not self._waiting

    def _fits(self, seq: BatchSeq) -> bool:
        if self._kv_tokens + seq.kv_tokens <= self.kv_capacity_tokens:
            return True
        return not self._running  # too big for the cache: it runs alone rather than never

    def _admit(self, seq: BatchSeq) -> None:
        seq.state = "running"
        self._running.append(seq)
        self._kv_tokens += seq.kv_tokens

    @staticmethod
    def _chunk(seq: BatchSeq, budget: int) -> PrefillChunk | None:
        left = seq.prompt_tokens - seq.prefilled
        take = min(left, budget)
        if take == 0 and left > 0:
            return None
        return PrefillChunk(seq, seq.prefilled, seq.prefilled + take)
