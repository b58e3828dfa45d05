"""The engine pool: each engine's state, occupancy and token accounting, and placement.

An engine becomes eligible once it has *joined*: it answers ``/health``, lists the served model
in ``/v1/models`` and, where token IDs are wanted, a probe request has shown whether it really
returns them (vLLM before 0.10.2 ignores ``return_token_ids``: such an engine is reported
``token_accounting: unavailable`` instead of failing every request).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Literal

import attrs
import orjson
import trio

from narwhal.config import EngineConfig
from narwhal.errors import NarwhalError
from narwhal.upstream.client import ChunkEvent, DoneEvent, EngineClient, ErrorFrameEvent

__all__ = ["Engine", "EnginePool", "EngineStatistics", "TokenAccounting"]

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
    completed: int
    failed: int


@attrs.define(eq=False)
class Engine:
    """One engine: its client, its state and what is running on it."""

    config: EngineConfig
    client: EngineClient
    state: EngineState = "joining"
    reason: str | None = "joining: waiting for /health and /v1/models"
    token_accounting: TokenAccounting = "unavailable"
    prefill: int = 0
    decode: int = 0
    completed: int = 0
    failed: int = 0

    @property
    def name(self) -> str:
        """The configured name."""
        return self.config.name

    @property
    def eligible(self) -> bool:
        """Whether new requests may be placed here."""
        return self.state == "ready"

    @property
    def provides_token_ids(self) -> bool:
        """Whether requests placed here are asked for, and validated by, token IDs."""
        return self.token_accounting == "token_ids"

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
            completed=self.completed,
            failed=self.failed,
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


class EnginePool:
    """The configured engines and the placement among them."""

    def __init__(self, engines: Iterable[Engine]) -> None:
        self.engines: Sequence[Engine] = tuple(engines)
        self._turn = itertools.count()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.engines)

    def eligible(self) -> list[Engine]:
        """Engines that may take new work now."""
        return [engine for engine in self.engines if engine.eligible]

    def any_provides_token_ids(self) -> bool:
        """Whether a configured engine is (or is expected to be) able to return token IDs."""
        return any(
            engine.provides_token_ids
            or (engine.state == "joining" and engine.config.wants_token_ids)
            for engine in self.engines
        )

    def choose(
        self, *, exclude: Iterable[Engine] = (), need_token_ids: bool = False
    ) -> Engine | None:
        """The least-occupied eligible engine, round-robin among equals; ``None`` if none."""
        excluded = set(exclude)
        best: Engine | None = None
        best_key: tuple[int, int] | None = None
        turn = next(self._turn)
        count = len(self.engines)
        for offset in range(count):
            engine = self.engines[(turn + offset) % count]
            if not engine.eligible or engine in excluded:
                continue
            if need_token_ids and not engine.provides_token_ids:
                continue
            key = (engine.prefill + engine.decode, engine.prefill)
            if best_key is None or key < best_key:
                best, best_key = engine, key
        return best
