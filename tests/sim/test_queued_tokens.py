"""vLLM's engine-side admission cap, ``--max-num-queued-tokens``, in the simulator.

The rule is vLLM 0.32's ``AsyncLLM.check_admission``: the whole prompts of the requests before
their first token, not counting the new one, compared with ``>=``; the refusal is
``MaxQueuedTokensError``'s 503.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing

from narwhal.sim import Batcher, LinearTiming, SimEngine, SimTransport, profile
from narwhal.sim.calibration import engine_type
from narwhal.sim.server import main as sim_main
from tests.sim.helpers import CHAT, COMPLETIONS, MESSAGES, MODEL

GUARD_S = 60
REFUSAL = {
    "error": {
        "message": "The engine has reached its prefill token backlog limit. Please try again "
        "later or on a different instance.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
}


def body(stream: bool = True, **directives: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "stream": stream, "narwhal_sim": directives}


def step_engine(limit: int | None) -> SimEngine:
    return SimEngine(MODEL, timing=profile("h100-llama3-8b"), max_num_queued_tokens=limit)


def test_the_batcher_counts_whole_prompts_until_the_first_token() -> None:
    batcher = Batcher(engine_type("h100-llama3-8b"))
    big = batcher.submit(10_000, 4)  # more than one step's 8192 tokens: prefilled in 2 chunks
    small = batcher.submit(100, 4)
    assert batcher.prefill_tokens == 10_100
    step = batcher.next_step()
    assert step is not None
    batcher.complete(step)
    # Partly prefilled, the big prompt still counts whole (vLLM cannot see the progress).
    assert (big.prefilled, big.emitted, batcher.prefill_tokens) == (8192, 0, 10_100)
    step = batcher.next_step()
    assert step is not None
    batcher.complete(step)
    assert (big.emitted, small.emitted, batcher.prefill_tokens) == (1, 1, 0)
    waiting = batcher.submit(300, 4)
    assert batcher.statistics().prefill_tokens == 300
    batcher.abort(waiting)
    batcher.abort(big)  # decoding: it no longer counted
    assert batcher.prefill_tokens == 0


def test_the_backlog_refuses_once_it_reaches_the_limit() -> None:
    engine = step_engine(10_000)
    first = engine.plan(CHAT, body(prompt_tokens=8192, output_tokens=50))
    engine.stream(first)
    # 8192 < 10,000: admitted, however large (the new request is not counted).
    second = engine.plan(CHAT, body(prompt_tokens=6000, output_tokens=50))
    assert second.status == 200
    engine.stream(second)
    assert engine.queued_prompt_tokens() == 14_192
    refused = engine.plan(CHAT, body(prompt_tokens=1, output_tokens=1))
    assert refused.status == 503
    assert orjson.loads(refused.body) == REFUSAL
    assert dict(refused.headers) == {"content-type": "application/json"}  # no Retry-After
    assert engine.plan(COMPLETIONS, {"model": MODEL, "prompt": "x"}).status == 503
    stats = engine.statistics()
    assert (stats.requests, stats.errors, stats.rejected_queued_tokens) == (4, 2, 2)
    assert stats.queued_prompt_tokens == 14_192
    assert (
        'vllm:admission_rejections_total{model_name="qwen3-8b",reason="max_num_queued_tokens"} 2.0'
        in engine.metrics_text()
    )


def test_the_model_is_checked_before_the_backlog_and_the_context_after() -> None:
    engine = step_engine(0)  # vLLM: 0 >= 0, every request is refused
    wrong = engine.plan(CHAT, {**body(), "model": "other"})
    assert wrong.status == 404
    too_long = engine.plan(CHAT, body(prompt_tokens=10**6))
    assert (too_long.status, orjson.loads(too_long.body)) == (503, REFUSAL)
    assert engine.statistics().rejected_queued_tokens == 1


def test_no_limit_by_default() -> None:
    engine = step_engine(None)
    for _ in range(3):
        plan = engine.plan(CHAT, body(prompt_tokens=100_000, output_tokens=1))
        assert plan.status == 200
        engine.stream(plan)
    stats = engine.statistics()
    assert (stats.queued_prompt_tokens, stats.rejected_queued_tokens) == (300_000, 0)
    assert 'reason="max_num_queued_tokens"} 0.0' in engine.metrics_text()


async def status_at(client: httpx.AsyncClient, at: float, **directives: Any) -> int:
    await trio.sleep_until(at)
    async with client.stream("POST", CHAT, json=body(**directives)) as response:
        async for _ in response.aiter_raw():
            pass
        return response.status_code


async def test_the_backlog_drains_as_first_tokens_come(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = step_engine(8192)
    prefill_s = engine_type("h100-llama3-8b").prefill_ms(8192) / 1000
    statuses: dict[str, int] = {}

    async def one(label: str, at: float, directives: dict[str, Any]) -> None:
        statuses[label] = await status_at(client, at, **directives)

    async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
        with trio.fail_after(GUARD_S):
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "first", start, dict(prompt_tokens=8192, output_tokens=200))
                nursery.start_soon(one, "during", start + prefill_s / 2, dict(prompt_tokens=10))
                nursery.start_soon(one, "after", start + prefill_s * 1.5, dict(prompt_tokens=10))
    assert statuses == {"first": 200, "during": 503, "after": 200}
    assert engine.statistics().queued_prompt_tokens == 0


async def test_a_per_request_timed_answer_counts_until_its_first_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timing = LinearTiming(prefill_base_s=1.0, prefill_per_token_s=0.0, decode_step_s=0.5)
    engine = SimEngine(MODEL, timing=timing, max_num_queued_tokens=100)
    statuses: dict[str, int] = {}

    async def one(label: str, at: float, directives: dict[str, Any]) -> None:
        statuses[label] = await status_at(client, at, **directives)

    async with httpx.AsyncClient(transport=SimTransport(engine), base_url="http://s") as client:
        with trio.fail_after(GUARD_S):
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                # First token at 1 s, then 9 more tokens to 5.5 s.
                nursery.start_soon(one, "first", start, dict(prompt_tokens=100, output_tokens=10))
                nursery.start_soon(one, "before", start + 0.5, dict(prompt_tokens=1))
                nursery.start_soon(one, "after", start + 1.5, dict(prompt_tokens=1))
    assert statuses == {"first": 200, "before": 503, "after": 200}


@pytest.mark.parametrize("value", ["-1", "x"])
def test_the_command_refuses_a_bad_limit(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    if value == "x":
        with pytest.raises(SystemExit) as exc:
            sim_main(["--bind", "127.0.0.1:0", "--model", MODEL, "--max-num-queued-tokens", value])
        assert exc.value.code == 2
        return
    argv = ["--bind", "127.0.0.1:0", "--model", MODEL, "--max-num-queued-tokens", value]
    assert sim_main(argv) == 2
    assert "--max-num-queued-tokens must be at least 0" in capsys.readouterr().err
