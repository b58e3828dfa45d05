"""The router's running forecast of each engine's prefill pipeline (pure, no I/O).

An engine runs its prefills first come, first served, in steps of chunked prefill beside its
decoding sequences (the physics of :mod:`narwhal.scheduling.profiles`). A request's time to
first token there has two parts:

* **compute**, which queues: its own prefill chunks plus the steps they need, after the compute
  of every prefill placed before it. Prompts share steps: a step carries up to
  ``max_num_batched_tokens`` prompt tokens (less one per decoding sequence), so a prompt that
  fits in the last step of the work ahead of it costs its chunk only, and a prompt that does
  not pays the steps it adds, ``ceil((ahead + n) / budget) - ceil(ahead / budget)``, each the
  cost of a decode step over the running batch (or the prefill step's fixed cost when nothing
  decodes). The :class:`Backlog` is that work ahead: when it is predicted done (``free_at``)
  and how many prompt tokens it holds;
* **latency**, which does not queue: the engine's front end, the network, the step boundary.

Both are learned from the truth as it arrives, from requests placed on an idle pipeline (whose
time is their own): ``scale`` multiplies the profile's compute (a slower or faster engine than
its profile; the engine's drift) and ``latency_s`` is added. The two are fitted together by
normalised least mean squares on ``observed = latency + scale * compute``, so prompts of
different sizes tell them apart; with one size only, the part that is larger explains more.
Requests placed behind others teach the scale too, at half the rate: their observed over
predicted time from placement to first token (the prediction with what the prompts that joined
its step later added, :meth:`PrefillForecast.joined_s`) is how much slower the whole pipeline
ran than predicted (:meth:`PrefillForecast._learn_busy`), so that a busy engine's speed is
learned while it is busy. When a first token arrives, the rest of the pipeline moves by as much as
that prompt was late; until it arrives, the pipeline is at least as late as the oldest prompt
waiting for it is overdue, beyond the step its token may wait for
(:meth:`PrefillForecast.overdue_s`), so that an engine that turned slower is seen so before its
first late token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import attrs

from narwhal.scheduling.profiles import EngineProfile

__all__ = ["Backlog", "Prefill", "PrefillForecast"]

_LEARNING_RATE = 0.2
_FILL_RATE = 0.05  # how far one placed prompt moves the learned fill of its last step
_BUSY_LEARNING_RATE = 0.1  # a prompt placed behind others: its time is partly theirs
_DECODE_MEMORY_S = 2.0  # the decode scale's memory: about this many seconds of the engine's gaps
_DECODE_RATE_MAX = 0.2  # the most one gap moves it (a lone stream's long gap)
_SCALE_BOUNDS = (0.05, 50.0)
_SLOPE_BOUNDS = (0.0, 1000.0)  # the profile's batch terms are small beside its fixed cost
_LATENCY_BOUNDS = (0.0, 10.0)
_LATENCY_UNIT_S = 0.01  # the latency term's regressor: makes both weights dimensionless


class Backlog(NamedTuple):
    """The prefill work placed on an engine and not done yet (a named tuple: a plan's walk
    makes two for every request it places, and a tuple is made in half an attrs class's time).

    Attributes:
        free_at: when it is predicted done (Trio clock seconds).
        tokens: the prompt tokens of its steps, counted from the first step a prompt placed
            behind it may still share.
        last_step_at: when its last step starts: a prompt placed before then (or in the same
            instant) may share that step, one placed later starts a step of its own.
        prompts: prompts in its last step. The engine holds at most ``prefill_limit`` prompts
            in prefill: when they share one step, the next prompt waits for the step after.
    """

    free_at: float = 0.0
    tokens: int = 0
    last_step_at: float = 0.0
    prompts: int = 0


@attrs.define
class Prefill:
    """One placed request waiting for its first token.

    Attributes:
        tokens: its prompt.
        compute_s: the compute it added to the pipeline (seconds, scaled).
        done: when that compute is predicted done, less the pipeline's shift at placement.
        teaches: ``(profiled compute, wait for the running step)`` while it may teach the
            model (placed on an idle pipeline, and no later prompt shared its step).
        joined_s: how much later than predicted at placement the prompts placed after it
            that joined its step make its first token (:meth:`PrefillForecast._revise`).
        room_s: the compute its last step still had room for when it was placed
            (:meth:`PrefillForecast.room_s`): the most that prompts placed after it could add
            to it by joining.
    """

    tokens: int
    compute_s: float
    done: float
    teaches: tuple[float, float] | None = None
    joined_s: float = 0.0
    room_s: float = 0.0


@attrs.define
class PrefillForecast:
    """One engine's prefill pipeline as the router predicts it.

    Attributes:
        profile: the engine's step costs.
        prefill_limit: the most prompts placed in prefill at once (``prefill_concurrency``).
        scale: observed over profiled compute, learned (1.0: the profile is right).
        latency_s: time to first token that does not queue, learned.
        pipeline: the placed prefill work not done yet.
        pending: each placed request still waiting for its first token, by placement key, in
            placement order.
        decode_scale: observed over profiled decode step, learned (1.0: the profile is right).
            The streams' gaps it is learned from include the prompt chunks their steps carried
            beside the batch.
        decode_own_scale: the same without the prompt chunks steps carry beside the batch:
            the decode step's own speed, which a plan times the seats with, the prefills ahead
            apart (:meth:`decode_tpot_s`). Measured by profiling, learned from the gaps whose
            steps only decoded, and never more than ``decode_scale`` (a step that also
            prefills is not faster).
        decode_slope: how much steeper the decode step grows with the batch than the profile
            says (its per-sequence and per-context-token terms; 1.0: as profiled), from the
            profiling's decode probes at several batch sizes (:meth:`decode_step_s`).
        decoding: requests past their first token.
        decode_context: context tokens (prompt and output so far) of the decoding requests.
        fill: the share of the room left in a placed prompt's last step that prompts placed
            after it took by joining it, learned (a moving average that each placed prompt
            moves 5 % of the way): what a projection expects of a prompt's neighbours in a
            tick (:meth:`joining_s`).
    """

    profile: EngineProfile
    prefill_limit: int = 1 << 30
    scale: float = 1.0
    latency_s: float = 0.0
    decode_scale: float = 1.0
    decode_own_scale: float = 1.0
    decode_slope: float = 1.0
    pipeline: Backlog = attrs.field(factory=Backlog)
    step_seen_at: float = -math.inf
    pending: dict[int, Prefill] = attrs.field(factory=dict)
    decoding: int = 0
    decode_context: int = 0
    fill: float = 0.0
    _keys: int = 0
    _rate: float = 0.0  # see _token_rate
    _rate_at: float = 0.0
    _shift: float = 0.0  # how late the pipeline runs on what was predicted at placement

    @property
    def in_prefill(self) -> int:
        """Requests placed and still waiting for their first token."""
        return len(self.pending)

    @property
    def free_at(self) -> float:
        """When the placed compute is predicted done (Trio clock seconds)."""
        return self.pipeline.free_at

    def _step(self, batch: tuple[int, int] | None = None) -> tuple[int, float]:
        """A step's prompt-token budget, and its cost (ms) beside the decoding batch (as it is
        now, or ``batch``: its sequences and their context tokens)."""
        profile = self.profile
        decoding, context = (self.decoding, self.decode_context) if batch is None else batch
        budget = self._token_budget(decoding)
        if decoding:  # the decode step as profiled (decode_slope); scale takes it to time
            return budget, self.decode_step_s(decoding, context, scaled=False) * 1000
        return budget, profile.prefill_base_ms

    def _token_budget(self, decoding: int) -> int:
        """The prompt tokens one step carries beside ``decoding`` sequences
        (``max_num_batched_tokens`` less one per sequence)."""
        return max(1, self.profile.max_num_batched_tokens - decoding)

    def tpot_with(self, tokens: int) -> float:
        """Predicted time per output token if one more sequence of ``tokens`` joined the batch.

        Every sequence placed here will decode: those in prefill count already.
        """
        batch = self.decoding + self.in_prefill + 1
        context = self.decode_context + sum(p.tokens for p in self.pending.values()) + tokens
        return self.decode_step_s(batch, context)

    def tpot_s(self) -> float:
        """Predicted time per output token of the decoding batch as it is now."""
        batch = max(1, self.decoding)
        context = self.decode_context + sum(p.tokens for p in self.pending.values())
        return self.decode_step_s(batch, context)

    def decode_tpot_s(self) -> float:
        """The time per output token of the decoding batch as it is now, without the prefill
        chunks beside it: :meth:`tpot_s` at ``decode_own_scale``."""
        return self.tpot_s() * self.decode_own_scale / self.decode_scale

    def compute_s(self, tokens: int) -> float:
        """A prompt's own prefill compute here, alone (no step beside it), at the learned
        speed."""
        return self.profile.prefill_chunk_ms(0, tokens) / 1000 * self.scale

    def pending_compute_s(self) -> float:
        """The own compute of the prompts placed and still waiting for their first token (all
        of it: how far a prompt has come is not seen)."""
        return sum(self.compute_s(placed.tokens) for placed in self.pending.values())

    def step_compute_s(self) -> float:
        """The most prompt compute one step beside the decoding batch carries: its token
        budget (``max_num_batched_tokens`` less one per decoding sequence)."""
        budget = self._token_budget(self.decoding)
        return budget * self.profile.prefill_per_token_ms / 1000 * self.scale

    def decode_step_s(self, batch: int, context_tokens: int, *, scaled: bool = True) -> float:
        """A decode step over ``batch`` sequences holding ``context_tokens``: the profile's,
        its batch terms ``decode_slope`` times steeper, at the learned speed (``decode_scale``;
        not ``scaled``: without it)."""
        profile = self.profile
        if batch <= 0:
            return 0.0
        grows = profile.decode_step_ms(batch, context_tokens) - profile.decode_base_ms
        step_s = (profile.decode_base_ms + self.decode_slope * grows) / 1000
        return step_s * self.decode_scale if scaled else step_s

    def observe_gap(self, gap_s: float, tokens: int, *, decode_only: bool = False) -> None:
        """An inter-token gap was observed (per token): learn the decode scale.

        Every decoding stream sees the same steps: ``B`` streams each tell of a gap of theirs
        about once per gap, so each gap weighs ``gap_s / (B x memory)``, and the scale
        remembers about :data:`_DECODE_MEMORY_S` of the engine's time whatever the batch.
        (A fixed weight per gap made the memory shrink with the batch: at 256 streams of 16
        tokens a chunk, a third of the way to each step's ratio, so the scale followed whether
        the last step carried a long prompt's chunk, and the seats' ends, which it times, went
        with it: the arrival projection's p90 error at 2x and 3x fell from 35 to 23 % with it.)
        """
        expected = self.decode_step_s(max(1, self.decoding), self.decode_context, scaled=False)
        if expected <= 0 or gap_s <= 0:
            return
        seen = gap_s / tokens / expected
        rate = min(_DECODE_RATE_MAX, gap_s / (max(1, self.decoding) * _DECODE_MEMORY_S))
        self.decode_scale = _toward(self.decode_scale, seen, rate)
        if decode_only:  # no prompt chunk in its steps: the decode step's own speed
            self.decode_own_scale = _toward(self.decode_own_scale, seen, rate)
        self.decode_own_scale = min(self.decode_own_scale, self.decode_scale)

    def standalone_s(self, tokens: int) -> float:
        """The prompt's time to first token on an idle engine: the least it can take here."""
        return self.profile.prefill_ms(tokens) / 1000 * self.scale + self.latency_s

    def predict(
        self,
        tokens: int,
        now: float,
        backlog: Backlog | None = None,
        batch: tuple[int, int] | None = None,
    ) -> float:
        """When a prompt placed now would get its first token (absolute time).

        Args:
            tokens: the prompt.
            now: when it is placed.
            backlog: the work ahead of it (default: :attr:`pipeline`).
            batch: the decoding batch its steps run beside, ``(sequences, context tokens)``
                (default: the batch as it is now).
        """
        return self.after(tokens, now, backlog, batch).free_at + self.latency_s

    def after(
        self,
        tokens: int,
        now: float,
        backlog: Backlog | None = None,
        batch: tuple[int, int] | None = None,
    ) -> Backlog:
        """The backlog once a prompt placed at ``now`` has joined ``backlog`` (or the pipeline),
        its steps beside ``batch`` (see :meth:`predict`)."""
        return self._cost(tokens, now, backlog, batch)[0]

    def _cost(
        self,
        tokens: int,
        now: float,
        backlog: Backlog | None,
        batch: tuple[int, int] | None = None,
    ) -> tuple[Backlog, float, float]:
        """The backlog after the prompt, its profiled compute and its wait for a running step.

        Returns ``(backlog, compute_s, wait_s)``: ``scale`` multiplies the compute; the wait is
        what is left of the decode step running now, from when output last arrived.
        """
        ahead = self.pipeline_at(now) if backlog is None else backlog
        budget, step_ms = self._step(batch)
        wait_s = 0.0
        if ahead.free_at <= now:
            ahead = Backlog(now, 0, now)
            if self.decoding:  # a decode step is running: the prompt waits for its end
                step_s = step_ms / 1000 * self.scale
                since = now - self.step_seen_at
                # A step that overran its prediction is taken to end now.
                wait_s = step_s - since if 0 <= since < step_s else 0.0
        joins = now <= ahead.last_step_at and ahead.prompts < self.prefill_limit
        shared = ahead.tokens if joins else 0
        total = shared + tokens
        steps = -(-total // budget) - -(-shared // budget)
        compute_ms = self.profile.prefill_chunk_ms(0, tokens) + steps * step_ms
        if wait_s:  # prompts placed while it waits join its step, after it
            joining = min(budget - tokens, self._token_rate(now) * wait_s) if budget > tokens else 0
            compute_ms += self.profile.prefill_per_token_ms * joining
        compute_s = compute_ms / 1000
        free_at = ahead.free_at + wait_s + compute_s * self.scale
        if steps == 0:
            return Backlog(free_at, total, ahead.last_step_at, ahead.prompts + 1), compute_s, wait_s
        own_in_last = min(tokens, total - budget * ((total - 1) // budget))
        last_ms = step_ms + self.profile.prefill_chunk_ms(0, own_in_last)
        last_step_at = free_at - last_ms / 1000 * self.scale
        # The steps it adds hold its own tokens only: what was ahead ends in the steps before.
        return Backlog(free_at, total, last_step_at, 1), compute_s, wait_s

    def room_s(self, backlog: Backlog, batch: tuple[int, int] | None = None) -> float:
        """The prompt compute the last step of ``backlog`` still has room for: its token budget
        beside ``batch`` (default: the decoding batch now) less the tokens it holds, at the
        learned speed; 0 when it holds ``prefill_limit`` prompts already."""
        if backlog.prompts >= self.prefill_limit:
            return 0.0
        room = self._room_tokens(backlog, self.decoding if batch is None else batch[0])
        return room * self.profile.prefill_per_token_ms / 1000 * self.scale

    def _room_tokens(self, backlog: Backlog, decoding: int) -> int:
        """The prompt tokens the last step of ``backlog`` still has room for beside
        ``decoding`` sequences."""
        budget = self._token_budget(decoding)
        return -(-backlog.tokens // budget) * budget - backlog.tokens

    def joining_s(
        self, backlog: Backlog, batch: tuple[int, int] | None = None, *, chance: float = 1.0
    ) -> float:
        """How much later a prompt whose placement left ``backlog`` is expected to get its
        first token for the prompts that will join its last step, with ``chance`` that any
        come: the learned :attr:`fill` of the room left (:meth:`room_s`)."""
        if chance <= 0 or self.fill <= 0:
            return 0.0
        return chance * self.fill * self.room_s(backlog, batch)

    def _token_rate(self, now: float) -> float:
        """Prompt tokens placed here per second, recently (a one-second moving average)."""
        return self._rate * math.exp(self._rate_at - now) if now > self._rate_at else self._rate

    def saw_step(self, now: float) -> None:
        """Output arrived from this engine: one of its steps ended ``now``."""
        self.step_seen_at = now

    def overdue_s(self, now: float) -> float:
        """How far past its predicted end, and the step it may end in, the compute of the
        oldest placed prompt still runs (0 when it is not late): its first token has not
        come, so that compute is not done yet, and the engine serves prefills first come,
        first served, so all the work placed after it is at least that late too.

        A first token comes out at the end of a step, which the prediction may not have
        counted (a decode step over the running batch, or a prefill step's fixed cost): within
        one step of its time it is not taken as late (without that margin the conversation
        trace's arrival p90 rose by about a point, the pipeline taken late for a step's
        rounding)."""
        head = next(iter(self.pending.values()), None)
        if head is None:
            return 0.0
        step_s = self._step()[1] / 1000 * self.scale
        return max(0.0, now - self.latency_s - (head.done + self._shift) - step_s)

    def pipeline_at(self, now: float) -> Backlog:
        """The placed prefill work as it stands at ``now``: :attr:`pipeline`, moved by how
        late it already runs (:meth:`overdue_s`)."""
        late = self.overdue_s(now)
        return self._pipeline_later(late) if late > 0 else self.pipeline

    def _pipeline_later(self, late: float, *, floor: float = -math.inf) -> Backlog:
        """:attr:`pipeline` moved ``late`` seconds later (earlier, if negative), its end no
        earlier than ``floor``."""
        pipeline = self.pipeline
        return pipeline._replace(
            free_at=max(floor, pipeline.free_at + late),
            last_step_at=pipeline.last_step_at + late,
        )

    def place(self, tokens: int, now: float) -> tuple[int, float]:
        """Record a placement; return its key and predicted first-token time."""
        late = self.overdue_s(now)
        if late > 0:  # the pipeline is that late already: as a first token now would tell
            self.pipeline = self._pipeline_later(late)
            self._shift += late
        idle = self.free_at <= now and late <= 0
        start = max(now, self.free_at)
        ahead = self.pipeline
        shares = not idle and now <= ahead.last_step_at
        if shares:
            # It shares the last step of the work ahead: whoever is in that step no longer has
            # its time to itself, and cannot teach.
            for placed in self.pending.values():
                placed.teaches = None
        # ``ahead`` already runs as late as the head is overdue (moved above): not asked again.
        self.pipeline, compute_s, wait_s = self._cost(tokens, now, ahead)
        if shares and ahead.prompts < self.prefill_limit:
            self._revise(ahead, tokens)
        self._rate, self._rate_at = self._token_rate(now) + tokens, now
        self._keys += 1
        key = self._keys
        # Placed on an idle pipeline, its time will be its own: it can teach the model.
        self.pending[key] = Prefill(
            tokens,
            self.free_at - start,
            self.free_at - self._shift,
            (compute_s, wait_s) if idle else None,
            room_s=self.room_s(self.pipeline),
        )
        return key, self.free_at + self.latency_s

    def _revise(self, ahead: Backlog, tokens: int) -> None:
        """A prompt joined the last step of ``ahead``: the prompts in that step end later.

        Their step now also carries the newcomer's tokens that fit in it (all of them when it
        added no step): they get their first tokens when the longer step ends.
        """
        delay = self.join_delay_s(ahead, self.pipeline, tokens, self.decoding)
        if delay <= 0:
            return
        for placed in self.pending.values():  # the newcomer is not among them yet
            if placed.done + self._shift > ahead.last_step_at:
                placed.done += delay
                placed.joined_s += delay

    def join_delay_s(self, ahead: Backlog, after: Backlog, tokens: int, decoding: int) -> float:
        """How much later the prompts in the last step of ``ahead`` end once a prompt of
        ``tokens`` joined that step and left ``after``, beside ``decoding`` sequences: all it
        added when it added no step, else the compute of its tokens that fit in the room."""
        if after.last_step_at == ahead.last_step_at:  # it added no step
            return after.free_at - ahead.free_at
        room = self._room_tokens(ahead, decoding)
        return self.profile.prefill_per_token_ms * min(tokens, room) / 1000 * self.scale

    def joined_s(self, key: int) -> float:
        """How much later than predicted at placement the placed request ``key`` gets its
        first token because prompts placed after it joined its step (0 once it has had it,
        or left): its placement's prediction plus this is what the engine's speed is judged
        by (:meth:`first_token`, drift), since the prompts that joined it are work the
        prediction could not know of."""
        placed = self.pending.get(key)
        return 0.0 if placed is None else placed.joined_s

    def expected_first_token(self, key: int) -> float | None:
        """When the placed request ``key`` is expected to get its first token now: its
        placement's prediction, revised by how late the pipeline runs and by prompts placed
        later that joined its step (``None`` once it has had it, or left)."""
        placed = self.pending.get(key)
        if placed is None:
            return None
        return placed.done + self._shift + self.latency_s

    def first_token(
        self,
        key: int,
        *,
        placed_at: float,
        predicted: float,
        now: float,
        tokens: int,
        learn: bool = True,
    ) -> None:
        """A placed request got its first token: replan the pipeline and learn (unless not
        ``learn``: its time was not the pipeline's, as on an engine that queues requests
        itself).

        The engine serves prefills first come, first served: when this prompt's compute is
        done, so is everything placed before it, and what was placed after it is as late (or
        as early) as it was. The rest of the pipeline moves by that much.

        ``predicted`` is the placement's prediction with what the prompts that joined its step
        since added (:meth:`joined_s`): a prompt of a burst shares its step with the rest of
        the burst, placed after it, and its placement's prediction alone would teach that
        work as the engine's slowness.
        """
        placed = self.pending.pop(key, None)
        if not self.pending:
            self.pipeline, self._shift = Backlog(now, 0, now), 0.0
        elif placed is not None:
            late = now - self.latency_s - (placed.done + self._shift)
            self._shift += late
            self.pipeline = self._pipeline_later(late, floor=now)
        self.decoding += 1
        self.decode_context += tokens
        if placed is not None and placed.room_s > 0:
            taken = min(1.0, placed.joined_s / placed.room_s)
            self.fill += _FILL_RATE * (taken - self.fill)
        if placed is None or not learn:
            return
        if placed.teaches is not None:
            compute_s, wait_s = placed.teaches  # the wait for the running step is measured
            self._learn(observed=now - placed_at - wait_s, compute=compute_s)
        else:
            self._learn_busy(observed=now - placed_at, predicted=predicted - placed_at)

    def assume_first_token(self, key: int, *, now: float, tokens: int) -> None:
        """A placed request whose first token cannot be seen (its engine answers it whole) is
        taken to have had it on time, ``now``: the pipeline is replanned as by
        :meth:`first_token`, and nothing is learned (a prediction cannot confirm itself)."""
        placed = self.pending.get(key)
        if placed is not None:
            placed.teaches = None
        self.first_token(key, placed_at=now, predicted=now, now=now, tokens=tokens)

    def _learn(self, *, observed: float, compute: float) -> None:
        x_latency, x_compute = 1.0, compute / _LATENCY_UNIT_S
        w_latency, w_compute = self.latency_s / _LATENCY_UNIT_S, self.scale
        predicted = w_latency * x_latency + w_compute * x_compute
        # Times to first token have a long tail (a prompt shares its step with whatever arrives
        # while the step before it runs): clipping each error to a quarter of the prediction
        # moves the model towards the typical case, the median, more than towards the mean.
        target = min(max(observed / _LATENCY_UNIT_S, predicted * 0.8), predicted * 1.25)
        error = target - predicted
        norm = x_latency * x_latency + x_compute * x_compute
        w_latency += _LEARNING_RATE * error * x_latency / norm
        w_compute += _LEARNING_RATE * error * x_compute / norm
        self.latency_s = min(
            _LATENCY_BOUNDS[1], max(_LATENCY_BOUNDS[0], w_latency * _LATENCY_UNIT_S)
        )
        self.scale = min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], w_compute))

    def _learn_busy(self, *, observed: float, predicted: float) -> None:
        """A prompt placed behind others got its first token ``observed`` after placement,
        where ``predicted`` (the work ahead of it and its own, at the scale of then, and what
        the prompts that joined its step since added) was predicted: the pipeline ran that
        much slower or faster than the scale says.

        Its time is not its own (the compute ahead, a neighbour sharing its step), so it
        moves the scale less than a prompt placed on an idle pipeline does, clipped alike
        towards the typical case. Without it a busy engine never teaches its speed: one that
        turns slower during a burst (or while idle, before one) is predicted at its old speed
        until the burst ends, and every wait on it runs late (the wrong-prior benchmark: a
        slowed engine's waits 2.3 times their prediction, median, through its first burst).
        """
        expected = predicted - self.latency_s
        if expected <= 0:
            return
        ratio = min(max((observed - self.latency_s) / expected, 0.8), 1.25)
        scaled = self.scale * (1.0 + _BUSY_LEARNING_RATE * (ratio - 1.0))
        self.scale = min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], scaled))

    def abandon_prefill(self, key: int, now: float) -> None:
        """A placed request left before its first token."""
        placed = self.pending.pop(key, None)
        if placed is None:
            return
        cost = placed.compute_s
        if not self.pending:
            self.pipeline, self._shift = Backlog(now, 0, now), 0.0
            return
        self._shift -= cost
        pipeline = self.pipeline
        self.pipeline = pipeline._replace(
            free_at=max(now, pipeline.free_at - cost),
            tokens=max(0, pipeline.tokens - placed.tokens),
            last_step_at=pipeline.last_step_at - cost,
        )

    def generated(self, tokens: int) -> None:
        """Output tokens arrived for a decoding request (its context grew)."""
        self.decode_context += tokens

    def finish_decode(self, context_tokens: int) -> None:
        """A decoding request ended, releasing its context."""
        self.decoding = max(0, self.decoding - 1)
        self.decode_context = max(0, self.decode_context - context_tokens)

    def calibrate(
        self, *, scale: float, latency_s: float, decode_scale: float, decode_slope: float = 1.0
    ) -> None:
        """Take the model a profiling measured (:mod:`narwhal.upstream.profiling`): observed
        prefill ``latency_s + scale * profiled compute``, decode ``decode_scale`` times the
        profile's step with its batch terms ``decode_slope`` times steeper."""
        self.decode_slope = min(_SLOPE_BOUNDS[1], max(_SLOPE_BOUNDS[0], decode_slope))
        self.scale = min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], scale))
        self.latency_s = min(_LATENCY_BOUNDS[1], max(_LATENCY_BOUNDS[0], latency_s))
        self.decode_scale = min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], decode_scale))
        self.decode_own_scale = self.decode_scale  # the probes' steps only decode


def _toward(scale: float, seen: float, rate: float) -> float:
    """``scale`` moved ``rate`` of the way to ``seen``, which counts as at most twice it and
    at least half, within the scale's bounds."""
    ratio = min(max(seen, scale / 2), scale * 2)
    return min(_SCALE_BOUNDS[1], max(_SCALE_BOUNDS[0], scale + rate * (ratio - scale)))
