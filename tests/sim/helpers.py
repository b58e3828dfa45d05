"""Helpers for the simulator tests: decode SSE bodies and compare JSON shapes key for key."""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.scheduling.profiles import EngineProfile
from narwhal.sim import SimEngine, SimPlan
from narwhal.sim.batching import Batcher, BatchSeq
from narwhal.sim.calibration import EngineType

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "qwen3-8b"
MESSAGES = [{"role": "user", "content": "Hello there"}]

# The step ledgers' tests (tests/sim/test_ledger.py, tests/bench/test_ledger.py), in round
# numbers: a decode step of B sequences holding K context tokens costs 4 + B + K/100 ms; a
# prefill chunk 0.01 ms a token; a prefill-only step 5 ms more. Two seats.
LEDGER_COSTS = EngineType(
    name="ledger-test",
    prefill_base_ms=5.0,
    prefill_per_token_ms=0.01,
    prefill_quadratic_ms=1e-12,
    decode_base_ms=4.0,
    decode_per_seq_ms=1.0,
    decode_per_kv_token_ms=0.01,
    max_num_seqs=2,
    max_num_batched_tokens=1000,
    kv_capacity_tokens=100_000,
)


def events(body: bytes) -> list[Any]:
    """Each ``data:`` payload of an SSE body, decoded; ``[DONE]`` and non-JSON stay strings."""
    result: list[Any] = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        try:
            result.append(orjson.loads(payload))
        except orjson.JSONDecodeError:
            result.append(payload.decode())
    return result


def plan_events(plan: SimPlan) -> list[Any]:
    """The decoded events of a streaming plan."""
    return events(plan.body)


def captured(line: str) -> Any:
    """A captured line (``data: {...}`` or a bare body) as JSON."""
    return orjson.loads(line.removeprefix("data: "))


def skeleton(value: Any, key: str | None = None) -> Any:
    """The shape of a JSON value: keys in order, value types, nulls kept.

    Lists become the ordered set of their elements' shapes, so ``[9707]`` and ``[1, 2, 3]`` match.
    A completions ``top_logprobs`` entry maps token texts to numbers, so its keys are abstracted.
    """
    if isinstance(value, dict):
        if key == "top_logprobs" and "token" not in value:
            return "token->logprob"
        return [(k, skeleton(v, k)) for k, v in value.items()]
    if isinstance(value, list):
        shapes: list[Any] = []
        for item in value:
            shape = skeleton(item, key)
            if shape not in shapes:
                shapes.append(shape)
        return ["list", *shapes]
    if value is None:
        return None
    return type(value).__name__


def chat(engine: SimEngine, **fields: Any) -> SimPlan:
    """Plan a chat request with a default message."""
    return engine.plan(CHAT, {"model": engine.model, "messages": MESSAGES, **fields})


def completion(engine: SimEngine, **fields: Any) -> SimPlan:
    """Plan a completions request with a default prompt."""
    body = {"model": engine.model, "prompt": "The capital of France is", **fields}
    return engine.plan(COMPLETIONS, body)


def json_body(plan: SimPlan) -> Any:
    """The plan's body as JSON."""
    return orjson.loads(plan.body)


TOY = EngineProfile(
    name="toy",
    prefill_base_ms=4.0,
    prefill_per_token_ms=0.5,
    prefill_quadratic_ms=0.001,
    decode_base_ms=8.0,
    decode_per_seq_ms=1.0,
    decode_per_kv_token_ms=0.01,
    max_num_seqs=3,
    max_num_batched_tokens=64,
    kv_capacity_tokens=1000,
)
"""A small profile with round numbers, for step-by-step tests of the batching model."""


def decoding(batcher: Batcher, *prompts: int) -> list[BatchSeq]:
    """Sequences past their prefill (one output step each), decoding from the next step."""
    seqs = [batcher.submit(prompt, 10) for prompt in prompts]
    while any(seq.emitted == 0 for seq in seqs):
        step = batcher.next_step()
        assert step is not None
        batcher.complete(step)
    return seqs
