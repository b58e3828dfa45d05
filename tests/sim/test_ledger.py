"""The engine's own step ledger (``narwhal sim --ledger``): engine time by request and second."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

import httpx
import orjson
import pytest
import trio
import trio.testing

from narwhal.sim.batching import Batcher, BatchSeq, BatchStep
from narwhal.sim.calibration import EngineType
from narwhal.sim.engine import SimEngine
from narwhal.sim.ledger import SimLedger, charge_step
from narwhal.sim.timing import StepTiming, profile
from narwhal.sim.transport import SimTransport
from tests.sim.helpers import LEDGER_COSTS as COSTS
from tests.sim.helpers import MESSAGES, MODEL, decoding

SHIFT = 100.0  # the ledger's clock reads the Trio clock plus this


def _on_clock(jitter: float = 0.0) -> float:
    return trio.current_time() + SHIFT + jitter


def _jittering(rng: random.Random) -> Callable[[], float]:
    """The ledger's clock read up to a microsecond off, either way, at each call."""
    return lambda: _on_clock(rng.uniform(-1e-6, 1e-6))


async def test_a_step_across_bucket_edges_is_split_by_its_time_in_each(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = SimLedger(COSTS, clock=_on_clock)
    batcher = Batcher(COSTS)
    tagged, untagged = decoding(batcher, 100, 300)
    ledger.submitted(tagged, "req-a")
    ledger.submitted(untagged, None)
    step = batcher.next_step()
    assert step is not None and len(step.decodes) == 2
    # 2.5 s from 0.25 s on the Trio clock: 100.25 to 102.75 on the ledger's.
    ledger.stepped(step, 0.25, 2.5)
    charge = dict((seq.id, c) for seq, c in charge_step(COSTS, step, 2.5))[tagged.id]
    assert ledger.busy == pytest.approx({100: 0.75, 101: 1.0, 102: 0.75})
    account = ledger.charges["req-a"]
    assert account == pytest.approx({100: 0.3 * charge, 101: 0.4 * charge, 102: 0.3 * charge})
    # The untagged request's charge is nobody's: it counts in the busy time only.
    assert list(ledger.charges) == ["req-a"]
    assert sum(account.values()) < sum(ledger.busy.values())
    data = orjson.loads(orjson.dumps(ledger.as_json()))
    assert (data["clock"], data["bucket_s"], data["steps"]) == ("time.monotonic", 1.0, 1)
    assert data["busy_s"] == pytest.approx({"100": 0.75, "101": 1.0, "102": 0.75})
    assert data["charged_s"]["req-a"]["101"] == pytest.approx(0.4 * charge)


async def test_a_request_submitted_and_not_yet_charged_is_in_the_ledger() -> None:
    ledger = SimLedger(COSTS, clock=_on_clock)
    seq = Batcher(COSTS).submit(100, 5)
    ledger.submitted(seq, "waiting")
    assert ledger.as_json()["charged_s"] == {"waiting": {}}


async def test_no_bucket_is_charged_more_than_the_engine_was_busy_in_it() -> None:
    """Random batches, bucket lengths and tags, steps back to back with idle gaps, the two clocks
    read a microsecond apart either way: in every bucket the charges add up to at most the busy
    time, and the busy time to at most the bucket's length."""
    rng = random.Random(11)
    for bucket_s in (0.05, 0.3, 1.0):
        ledger = SimLedger(COSTS, bucket_s=bucket_s, clock=_jittering(rng))
        batcher, now, total = Batcher(COSTS), trio.current_time(), 0.0
        for _ in range(400):
            if rng.random() < 0.3:
                seq = batcher.submit(rng.randrange(1, 3000), rng.randrange(1, 40))
                ledger.submitted(seq, rng.choice([None, "a", "b", f"r{rng.random()}"]))
            step = batcher.next_step()
            if step is None:
                now += rng.random() * 0.2  # idle
                continue
            duration = step.cost_ms / 1000 * rng.uniform(0.5, 40.0)  # scaled, jittered, slowed
            ledger.stepped(step, now, duration)
            total += duration
            now += duration
            batcher.complete(step)
        assert sum(ledger.busy.values()) == pytest.approx(total)
        for bucket, busy in ledger.busy.items():
            charged = sum(account.get(bucket, 0.0) for account in ledger.charges.values())
            assert charged <= busy * (1 + 1e-9)
            assert busy <= bucket_s * (1 + 1e-9)


def _chat(tag: str | None, prompt: int, output: int) -> tuple[dict[str, object], dict[str, str]]:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": True,
        "narwhal_sim": {"prompt_tokens": prompt, "output_tokens": output},
    }
    return body, ({} if tag is None else {"X-Request-Id": tag})


async def test_the_engine_tags_its_requests_by_their_request_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timing = profile("h100-llama3-8b", time_scale=4.0)
    assert isinstance(timing, StepTiming) and isinstance(timing.profile, EngineType)
    engine = SimEngine(MODEL, timing=timing)
    assert engine.watch_steps(SimLedger(timing.profile, clock=_on_clock))
    start = trio.current_time()
    with trio.fail_after(600):
        async with (
            httpx.AsyncClient(transport=SimTransport(engine), base_url="http://sim") as client,
            trio.open_nursery() as nursery,
        ):
            for tag, prompt, output in (("one", 500, 20), ("two", 2000, 5), (None, 100, 8)):
                body, headers = _chat(tag, prompt, output)
                post = partial(client.post, "/v1/chat/completions", json=body, headers=headers)
                nursery.start_soon(post)
        busy_until = trio.current_time()
    data = orjson.loads(engine.respond("GET", "/sim/ledger").body)
    assert set(data["charged_s"]) == {"one", "two"}
    busy = sum(data["busy_s"].values())
    # Back to back from the first request: busy until the last token, in scaled seconds.
    assert busy == pytest.approx(busy_until - start)
    charged = {tag: sum(account.values()) for tag, account in data["charged_s"].items()}
    assert 0 < charged["one"] and 0 < charged["two"]
    assert charged["one"] + charged["two"] < busy  # the untagged request's share is nobody's
    assert min(int(bucket) for bucket in data["busy_s"]) == int(start + SHIFT)


async def test_without_a_ledger_the_route_says_to_start_with_it() -> None:
    for engine in (SimEngine(MODEL), SimEngine(MODEL, timing=profile("zero"))):
        plan = engine.respond("GET", "/sim/ledger")
        error = orjson.loads(plan.body)["error"]
        assert plan.status == 404 and "--ledger" in error["message"]
    assert SimEngine(MODEL).respond("POST", "/sim/ledger").status == 405


def _ids(step: BatchStep) -> list[int]:
    return [seq.id for seq in step.decodes] + [chunk.seq.id for chunk in step.chunks]


async def test_the_step_loop_hands_the_request_id_to_its_ledger(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.tags: list[str | None] = []

        def submitted(self, seq: BatchSeq, request_id: str | None) -> None:
            self.tags.append(request_id)

        def stepped(self, step: BatchStep, start: float, duration_s: float) -> None:
            assert _ids(step)

    engine = SimEngine(MODEL, timing=profile("h100-llama3-8b"))
    recorder = Recorder()
    assert engine.watch_steps(recorder)
    for tag in ("first", None):
        body, headers = _chat(tag, 50, 2)
        plan = engine.plan("/v1/chat/completions", body, request_id=headers.get("X-Request-Id"))
        assert plan.request_id == headers.get("X-Request-Id")
        with trio.fail_after(60):
            async for _ in engine.stream(plan):
                pass
    assert recorder.tags == ["first", None]
