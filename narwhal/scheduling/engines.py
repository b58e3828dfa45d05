"""The engine pool: each engine's state, occupancy and token accounting, and placement.

An engine becomes eligible once it has *joined*: it answers ``/health``, lists the served model
in ``/v1/models`` and, where token IDs are wanted, a probe request has shown whether it really
returns them (vLLM before 0.10.2 ignores ``return_token_ids``: such an engine is reported
``token_accounting: unavailable`` instead of failing every request).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

import attrs
import orjson
import trio

from narwhal.config import EngineConfig
from narwhal.errors import NarwhalError
from narwhal.scheduling.forecast import PrefillForecast
from narwhal.upstream.client import ChunkEvent, DoneEvent, EngineClient, ErrorFrameEvent

__all__ = ["Engine", "EnginePool", "EngineStatistics", "Slot", "TokenAccounting"]

log = logging.getLogger(__name__)

TokenAccounting = Literal["token_ids", "unavailable"]
EngineState = Literal["joining", "ready"]


@attrs.frozen
class EngineStatistics:
    """A snapshot of one engine, as ``/ready`` and ``/metrics`` show it."""

    name: str
    url: str
    dialect: str
    wave: str
    state: EngineState
    eligible: bool
    reason: str | None
    token_accounting: TokenAccounting
    prefill: int
    decode: int
    prefill_limit: int
    decode_limit: int
    completed: int
    failed: int
    prefill_scale: float


@attrs.define(eq=False)
class Engine:
    """One engine: its client, its state and what is running on it."""

    config: EngineConfig
    client: EngineClient
    prefill_limit: int
    decode_limit: int
    forecast: PrefillForecast
    state: EngineState = "joining"
    reason: str | None = "joining: waiting for /health and /v1/models"
    token_accounting: TokenAccounting = "unavailable"
    prefill: int = 0
    decode: int = 0
    completed: int = 0
    failed: int = 0
    pool_changed: Callable[[], None] = lambda: None
    rejoin: Callable[[Engine], None] = lambda engine: None
    slots: dict[Slot, None] = attrs.field(factory=dict)  # placed and not yet released

    @property
    def name(self) -> str:
        """The configured name."""
        return self.config.name

    @property
    def eligible(self) -> bool:
        """Whether new requests may be placed here."""
        return self.state == "ready"

    @property
    def can_place(self) -> bool:
        """Eligible, with a free prefill slot and decode headroom for when the prefill ends."""
        return (
            self.eligible
            and self.prefill < self.prefill_limit
            and self.prefill + self.decode < self.decode_limit
        )

    @property
    def provides_token_ids(self) -> bool:
        """Whether requests placed here are asked for, and validated by, token IDs."""
        return self.token_accounting == "token_ids"

    def mark_unreachable(self, reason: str) -> None:
        """No connection could be made: leave placement and probe until the engine is back."""
        if self.state != "ready":
            return
        self.state = "joining"
        self.reason = f"unreachable: {reason}"
        log.warning("engine %s left placement: %s", self.name, reason)
        self.pool_changed()
        self.rejoin(self)

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot."""
        return EngineStatistics(
            name=self.name,
            url=self.config.url,
            dialect=self.config.dialect,
            wave=self.config.wave,
            state=self.state,
            eligible=self.eligible,
            reason=self.reason,
            token_accounting=self.token_accounting,
            prefill=self.prefill,
            decode=self.decode,
            prefill_limit=self.prefill_limit,
            decode_limit=self.decode_limit,
            completed=self.completed,
            failed=self.failed,
            prefill_scale=self.forecast.scale,
        )

    async def join(self, model: str, *, retry_interval_s: float) -> None:
        """Probe until the engine serves ``model``; then mark it ready."""
        while True:
            try:
                await self._probe(model)
            except NarwhalError as exc:
                self.reason = f"joining: {exc.message}"
                log.info("engine %s not ready yet: %s", self.name, exc.message)
                await trio.sleep(retry_interval_s)
                continue
            self.state = "ready"
            self.reason = None
            self.pool_changed()
            log.info("engine %s joined (token_accounting=%s)", self.name, self.token_accounting)
            return

    async def _probe(self, model: str) -> None:
        await self.client.get_json("/health")
        listing = await self.client.get_json("/v1/models")
        served = {
            entry.get("id") for entry in (listing or {}).get("data", []) if isinstance(entry, dict)
        }
        if model not in served:
            raise _ProbeFailed(f"/v1/models does not list {model!r}")
        self.token_accounting = (
            await self._probe_token_ids(model) if self.config.wants_token_ids else "unavailable"
        )

    async def _probe_token_ids(self, model: str) -> TokenAccounting:
        body = orjson.dumps(
            {
                "model": model,
                "prompt": "Narwhal token probe",
                "max_tokens": 2,
                "stream": True,
                "return_token_ids": True,
                "stream_interval": 1,
            }
        )
        saw_output = False
        async with await self.client.open_stream("completions", body, ids_required=False) as stream:
            while True:
                event = await stream.next_event()
                if isinstance(event, DoneEvent):
                    break
                if isinstance(event, ErrorFrameEvent):
                    raise _ProbeFailed(f"token probe failed: {event.message()}")
                assert isinstance(event, ChunkEvent)
                if event.facts.output:
                    saw_output = True
                    if not event.facts.has_token_ids:
                        return "unavailable"
        return "token_ids" if saw_output else "unavailable"


class _ProbeFailed(NarwhalError):
    pass


@attrs.define(eq=False, hash=False)
class Slot:
    """A request's place on an engine: prefill until its first output event, then decode.

    Creating the slot takes the prefill slot and records the forecast; the slot is exchanged
    for a decode slot at the first output event and released once, whatever happens.
    """

    engine: Engine
    prompt_tokens: int
    placed_at: float
    route: str = "chat"
    max_tokens: int | None = None
    predicted_first_token_at: float = 0.0
    phase: Literal["prefill", "decode", "released"] = "prefill"
    context_tokens: int = 0
    generated_tokens: int = 0
    key: int = 0

    @classmethod
    def take(
        cls,
        engine: Engine,
        prompt_tokens: int,
        *,
        route: str = "chat",
        max_tokens: int | None = None,
    ) -> Slot:
        """Place a request on ``engine`` now."""
        now = trio.current_time()
        slot = cls(engine, prompt_tokens, now, route, max_tokens)
        slot.key, slot.predicted_first_token_at = engine.forecast.place(prompt_tokens, now)
        engine.prefill += 1
        engine.slots[slot] = None
        return slot

    def observe_gap(self, gap_s: float, tokens: int) -> None:
        """Time between two output events of this request, which carried ``tokens`` tokens."""
        self.engine.forecast.observe_gap(gap_s, max(1, tokens))

    @property
    def predicted_ttft_s(self) -> float:
        """Placement to first token, as predicted at placement."""
        return self.predicted_first_token_at - self.placed_at

    def to_decode(self) -> None:
        """Exchange the prefill slot for a decode slot (the first output event arrived)."""
        if self.phase != "prefill":
            return
        engine = self.engine
        engine.prefill -= 1
        engine.decode += 1
        self.phase = "decode"
        self.context_tokens = self.prompt_tokens
        now = trio.current_time()
        engine.forecast.saw_step(now)
        engine.forecast.first_token(
            self.key,
            placed_at=self.placed_at,
            predicted=self.predicted_first_token_at,
            now=now,
            tokens=self.prompt_tokens,
        )
        # A prefill slot is free now: a queued request may be placeable.
        engine.pool_changed()

    def generated(self, tokens: int) -> None:
        """Output tokens arrived: the request's context grew."""
        self.generated_tokens += tokens
        if self.phase == "decode" and tokens:
            self.context_tokens += tokens
            forecast = self.engine.forecast
            forecast.generated(tokens)
            forecast.saw_step(trio.current_time())

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        engine = self.engine
        if self.phase == "prefill":
            engine.prefill -= 1
            engine.forecast.abandon_prefill(self.key, trio.current_time())
        elif self.phase == "decode":
            engine.decode -= 1
            engine.forecast.finish_decode(self.context_tokens)
        else:
            return
        self.phase = "released"
        engine.slots.pop(self, None)
        engine.pool_changed()


class EnginePool:
    """The configured engines and the placement among them."""

    def __init__(self, engines: Iterable[Engine], *, tpot_target_s: float = math.inf) -> None:
        self.engines: Sequence[Engine] = tuple(engines)
        self.tpot_target_s = tpot_target_s
        self._changed = trio.Event()
        for engine in self.engines:
            engine.pool_changed = self.notify

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.engines)

    def notify(self) -> None:
        """Something changed (a slot freed, an engine joined): wake whoever waits for room."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Wait for the next :meth:`notify`."""
        await self._changed.wait()

    def eligible(self) -> list[Engine]:
        """Engines that may take new work now."""
        return [engine for engine in self.engines if engine.eligible]

    def any_eligible(self, *, need_token_ids: bool = False) -> bool:
        """Whether some engine is eligible (and provides token IDs, if needed)."""
        return any(
            engine.eligible and (engine.provides_token_ids or not need_token_ids)
            for engine in self.engines
        )

    def any_provides_token_ids(self) -> bool:
        """Whether a configured engine is (or is expected to be) able to return token IDs."""
        return any(
            engine.provides_token_ids
            or (engine.state == "joining" and engine.config.wants_token_ids)
            for engine in self.engines
        )

    def best(
        self,
        prompt_tokens: int,
        *,
        exclude: Iterable[Engine] = (),
        need_token_ids: bool = False,
    ) -> Engine | None:
        """The engine that may take the request now with the earliest predicted first token."""
        excluded = set(exclude)
        now = trio.current_time()
        best: Engine | None = None
        best_at = 0.0
        for engine in self.engines:
            if not engine.can_place or engine in excluded:
                continue
            if need_token_ids and not engine.provides_token_ids:
                continue
            if engine.forecast.tpot_with(prompt_tokens) > self.tpot_target_s:
                continue  # one more sequence would slow every stream there past the target
            at = engine.forecast.predict(prompt_tokens, now)
            if best is None or at < best_at:
                best, best_at = engine, at
        return best
