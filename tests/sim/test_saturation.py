"""The step loop through the in-process transport, in virtual time: calibration and saturation.

Every request here streams a chat answer; ``pieces[0]`` is the role chunk (sent with the first
token), ``pieces[1 + k]`` carries token ``k``, the last piece is ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

from narwhal.sim import Batcher, SimEngine, SimTransport, StepTiming, profile
from narwhal.sim.calibration import engine_type
from tests.sim.helpers import CHAT, MESSAGES, MODEL

H100 = engine_type("h100-llama3-8b")  # the simulator's own calibrated H100
BLOCKER = {"prompt_tokens": 8192, "output_tokens": 1}  # a whole step of prefill
LONG_PREFILL_S = H100.prefill_ms(8192) / 1000
TICK = 1e-6  # arrivals this far apart have a definite order
GUARD_S = 60


def body(stream: bool = True, **directives: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "stream": stream, "narwhal_sim": directives}


@pytest.fixture
def engine() -> SimEngine:
    return SimEngine(MODEL, timing=profile("h100-llama3-8b"))


@pytest.fixture
async def client(engine: SimEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = SimTransport(engine)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim.test") as http:
        yield http


async def pieces_at(
    client: httpx.AsyncClient, after_s: float = 0.0, **directives: Any
) -> list[float]:
    """Wait ``after_s``, stream one request; the virtual time each piece arrived."""
    await trio.sleep(after_s)
    times = []
    async with client.stream("POST", CHAT, json=body(**directives)) as response:
        assert response.status_code == 200
        async for _ in response.aiter_raw():
            times.append(trio.current_time())
    return times


async def together(
    client: httpx.AsyncClient, requests: Sequence[tuple[float, dict[str, Any]]]
) -> list[list[float]]:
    """Run ``(after_s, directives)`` requests concurrently; each one's piece times."""
    results: list[list[float]] = [[] for _ in requests]

    async def one(index: int, after_s: float, directives: dict[str, Any]) -> None:
        results[index] = await pieces_at(client, after_s, **directives)

    async with trio.open_nursery() as nursery:
        for index, (after_s, directives) in enumerate(requests):
            nursery.start_soon(one, index, after_s, directives)
    return results


async def together_into(
    results: list[list[float]],
    client: httpx.AsyncClient,
    requests: Sequence[tuple[float, dict[str, Any]]],
) -> None:
    """:func:`together`, its results appended to ``results`` (for ``start_soon``)."""
    results.extend(await together(client, requests))


def gauge(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(f"vllm:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


# --- calibration ------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "published_s"), [(1024, 0.028), (8192, 0.309)])
async def test_prefill_calibration_on_the_h100_profile(
    client: httpx.AsyncClient,
    autojump_clock: trio.testing.MockClock,
    tokens: int,
    published_s: float,
) -> None:
    with trio.fail_after(GUARD_S):
        start = trio.current_time()
        times = await pieces_at(client, prompt_tokens=tokens, output_tokens=1)
    ttft = times[0] - start
    assert ttft == pytest.approx(H100.prefill_ms(tokens) / 1000, rel=1e-12)
    # The reference's table (section 2.2: vidur, H100 scaled) within 8 %: the calibrated type
    # takes BLIS's measured per-token slope and adds the per-step overhead.
    assert ttft == pytest.approx(published_s, rel=0.08)


# --- saturation -------------------------------------------------------------------------------


async def test_ttft_grows_with_the_prefills_queued_ahead_fcfs(
    client: httpx.AsyncClient, engine: SimEngine, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(GUARD_S):
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            results: list[list[float]] = []
            arrivals = [(k * TICK, BLOCKER) for k in range(4)]
            nursery.start_soon(together_into, results, client, arrivals)
            await trio.sleep(LONG_PREFILL_S / 2)
            stats = engine.statistics()
            assert (stats.running, stats.waiting, stats.prefilling) == (1, 3, 1)
    first_tokens = [times[0] - start for times in results]
    expected = [(k + 1) * LONG_PREFILL_S for k in range(4)]
    assert first_tokens == pytest.approx(expected, abs=1e-9)


async def test_the_decode_step_grows_with_the_batch(
    client: httpx.AsyncClient, autojump_clock: trio.testing.MockClock
) -> None:
    request = {"prompt_tokens": 100, "output_tokens": 3}
    with trio.fail_after(GUARD_S):
        alone = await pieces_at(client, **request)
        start = trio.current_time()
        crowd = await together(client, [(0.0, BLOCKER)] + [(0.001, request)] * 32)
    assert alone[2] - alone[1] == pytest.approx(H100.decode_step_ms(1, 101) / 1000, rel=1e-12)
    prefill_s = (H100.prefill_base_ms + 32 * H100.prefill_chunk_ms(0, 100)) / 1000
    batch_step_s = H100.decode_step_ms(32, 32 * 101) / 1000
    for times in crowd[1:]:
        assert times[0] - start == pytest.approx(LONG_PREFILL_S + prefill_s, abs=1e-9)
        assert times[2] - times[1] == pytest.approx(batch_step_s, abs=1e-9)
    assert batch_step_s > alone[2] - alone[1]


async def test_requests_wait_when_the_kv_cache_is_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimEngine(MODEL, timing=profile("h100-llama3-8b"), kv_capacity_tokens=1000)
    request = {"prompt_tokens": 100, "output_tokens": 400}  # 500 tokens of KV each
    async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
        with trio.fail_after(GUARD_S):
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                results: list[list[float]] = []
                arrivals = [(k * TICK, request) for k in range(3)]
                nursery.start_soon(together_into, results, client, arrivals)
                await trio.sleep(0.1)
                metrics = (await client.get("/metrics")).text
    assert gauge(metrics, "num_requests_running") == 2.0
    assert gauge(metrics, "num_requests_waiting") == 1.0
    assert gauge(metrics, "kv_cache_usage_perc") == 1.0
    first, _, third = results
    assert third[1] > first[-1]  # admitted only once the first one finished and freed its KV
    # The same arrivals replayed on the pure scheduler give the same first token, to the step.
    batcher = Batcher(H100, kv_capacity_tokens=1000)
    seqs = [batcher.submit(100, 400)]
    clock = 0.0
    while seqs[-1].emitted == 0 or len(seqs) < 3:
        step = batcher.next_step()
        assert step is not None
        if len(seqs) == 1:
            seqs += [batcher.submit(100, 400), batcher.submit(100, 400)]
        clock += step.cost_ms / 1000
        batcher.complete(step)
    assert third[0] - start == pytest.approx(clock, abs=1e-9)
    assert engine.statistics().kv_tokens == 0


async def test_max_num_seqs_bounds_the_running_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timing = StepTiming(attrs.evolve(H100, max_num_seqs=2))
    engine = SimEngine(MODEL, timing=timing)
    seen: set[tuple[int, int]] = set()
    async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                request = {"prompt_tokens": 10, "output_tokens": 20}
                nursery.start_soon(together, client, [(k * TICK, request) for k in range(5)])
                await trio.sleep(TICK * 10)
                while engine.statistics().completed < 5:
                    stats = engine.statistics()
                    seen.add((stats.running, stats.waiting))
                    await trio.sleep(0.001)
    assert max(running for running, _ in seen) == 2
    assert (2, 3) in seen


async def test_the_time_scale_multiplies_every_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    runs = []
    for scale in (1.0, 2.5):
        engine = SimEngine(MODEL, timing=profile("h100-llama3-8b", time_scale=scale))
        async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
            with trio.fail_after(GUARD_S):
                start = trio.current_time()
                arrivals = [(0.0, BLOCKER), (0.01, {"prompt_tokens": 500, "output_tokens": 5})]
                results = await together(client, arrivals)
        runs.append([t - start for times in results for t in times])
    assert runs[1] == pytest.approx([2.5 * t for t in runs[0]], rel=1e-9)


async def test_jitter_is_deterministic_from_the_seed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def timeline(jitter: float, seed: int) -> list[float]:
        timing = profile("h100-llama3-8b", jitter=jitter, seed=seed)
        engine = SimEngine(MODEL, timing=timing)
        async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
            start = trio.current_time()
            arrivals = [(k * TICK, {"prompt_tokens": 3000, "output_tokens": 6}) for k in range(4)]
            results = await together(client, arrivals)
        return [t - start for times in results for t in times]

    with trio.fail_after(GUARD_S):
        plain = await timeline(0.0, 1)
        first, again, other = await timeline(0.2, 1), await timeline(0.2, 1), await timeline(0.2, 2)
    assert first == pytest.approx(again, abs=1e-12)  # the same steps, from another start time
    assert first != other and first != plain
    assert all(0.8 * p - 1e-9 <= f <= 1.2 * p + 1e-9 for f, p in zip(first, plain, strict=True))


# --- run-time switches, overrides, early ends, faults -----------------------------------------


async def test_slowdown_and_directives_switch_at_run_time(
    client: httpx.AsyncClient, engine: SimEngine, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(GUARD_S):
        slowed = await client.post("/sim/slowdown", json={"factor": 2.0})
        assert slowed.status_code == 200 and slowed.json()["slowdown"] == 2.0
        start = trio.current_time()
        times = await pieces_at(client, prompt_tokens=1024, output_tokens=1)
        assert times[0] - start == pytest.approx(2 * H100.prefill_ms(1024) / 1000, rel=1e-12)
        refused = await client.post("/sim/slowdown", json={"factor": 0})
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "factor")
        switched = await client.post("/sim/directives", json={"output_tokens": 2})
        assert switched.json()["directives"] == {"output_tokens": 2}
        answer = (await client.post(CHAT, json={"model": MODEL, "messages": MESSAGES})).json()
        assert answer["usage"]["completion_tokens"] == 2
        bad = await client.post("/sim/directives", json={"fault": "gremlins"})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "narwhal_sim.fault")
        state = (await client.get("/sim/state")).json()
    assert engine.slowdown == 2.0
    assert state["slowdown"] == 2.0 and state["directives"] == {"output_tokens": 2}
    assert (state["running"], state["waiting"], state["kv_capacity_tokens"]) == (0, 0, 467_000)
    assert state["steps"] == 3 and state["completed"] == 2


async def test_timing_overrides_bypass_the_batch(
    client: httpx.AsyncClient, engine: SimEngine, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(GUARD_S):
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            results: list[list[float]] = []
            overridden = {"output_tokens": 3, "ttft_s": 0.05, "itl_s": 0.01}
            arrivals = [(0.0, BLOCKER), (TICK, overridden)]
            nursery.start_soon(together_into, results, client, arrivals)
            await trio.sleep(0.03)
            stats = engine.statistics()
            assert (stats.running, stats.waiting) == (2, 0)  # the blocker and the override
    _, fixed = results
    expected = [0.05, 0.05, 0.06, 0.07]  # role and first token, then two gaps
    assert [t - start - TICK for t in fixed[:4]] == pytest.approx(expected, abs=1e-9)


async def test_a_stream_closed_early_leaves_the_batch_and_the_queue(
    client: httpx.AsyncClient, engine: SimEngine, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(GUARD_S):
        async with client.stream("POST", CHAT, json=body(prompt_tokens=8192, output_tokens=500)):
            with trio.move_on_after(0.1):
                await client.post(CHAT, json=body(stream=False, output_tokens=5))
            stats = engine.statistics()
            assert (stats.running, stats.waiting, stats.closed_early) == (1, 0, 1)
            assert stats.kv_tokens == 8692
        stats = engine.statistics()
        assert (stats.running, stats.kv_tokens, stats.closed_early) == (0, 0, 2)


async def test_closing_a_stream_wakes_its_reader(
    engine: SimEngine, autojump_clock: trio.testing.MockClock
) -> None:
    plan = engine.plan(CHAT, body(prompt_tokens=100, output_tokens=1000))
    stream = engine.stream(plan)
    read: list[bytes] = []

    async def reader() -> None:
        read.extend([piece async for piece in stream])

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.1)
            closed_at = trio.current_time()
            stream.close()
    assert trio.current_time() == closed_at  # the reader did not wait for the next token
    assert 2 < len(read) < 100 and stream.state == "closed_early"
    assert engine.statistics().running == 0


async def test_faults_keep_their_positions_in_the_step_loop(
    client: httpx.AsyncClient, engine: SimEngine, autojump_clock: trio.testing.MockClock
) -> None:
    request = {"prompt_tokens": 100, "output_tokens": 5}
    with trio.fail_after(GUARD_S):
        start = trio.current_time()
        plain = await pieces_at(client, **request)
        ttft = plain[0] - start
        stalled = await pieces_at(client, **request, fault="stall", fault_at=2, stall_s=1.0)
        start = trio.current_time()
        with pytest.raises(httpx.RemoteProtocolError):
            await pieces_at(client, **request, fault="drop", fault_at=2)
        dropped_at = trio.current_time() - start
        await trio.sleep(1)  # the step planned before the drop was seen ends first
        start = trio.current_time()
        whole = await client.post(CHAT, json=body(stream=False, **request))
        answered_at = trio.current_time() - start
    plain = [t - plain[0] for t in plain]
    stalled = [t - stalled[0] for t in stalled]
    assert stalled[:3] == pytest.approx(plain[:3])
    # The engine goes on generating through a stall: only the delivery waits, then catches up.
    assert stalled[3:] == pytest.approx([plain[3] + 1.0] * 4)
    assert dropped_at == pytest.approx(ttft + plain[3], abs=1e-9)  # when token 2 came out
    assert answered_at == pytest.approx(ttft + plain[5], abs=1e-9)  # at the last token
    assert whole.json()["usage"]["completion_tokens"] == 5


async def test_the_zero_profile_runs_no_step_loop(autojump_clock: trio.testing.MockClock) -> None:
    engine = SimEngine(MODEL, timing=profile("zero"))
    async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
        with trio.fail_after(GUARD_S):
            start = trio.current_time()
            times = await pieces_at(client, output_tokens=50)
    assert times[-1] == start
    assert engine.statistics().steps == 0


def test_an_engine_moved_to_a_new_trio_run_forgets_the_old_one() -> None:
    engine = SimEngine(MODEL, timing=profile("h100-llama3-8b"))

    async def abandon() -> None:
        plan = engine.plan(CHAT, body(prompt_tokens=100, output_tokens=10_000))
        await engine.stream(plan).__anext__()  # left open when the run ends

    async def fresh() -> float:
        async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
            start = trio.current_time()
            times = await pieces_at(client, prompt_tokens=1024, output_tokens=1)
            return times[0] - start

    trio.run(abandon, clock=trio.testing.MockClock(autojump_threshold=0))
    assert engine.statistics().running == 1
    ttft = trio.run(fresh, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ttft == pytest.approx(H100.prefill_ms(1024) / 1000, rel=1e-12)
    assert engine.statistics().running == 0
