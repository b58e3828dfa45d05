"""The ``vllm`` dialect against real vLLM 0.32 answers (``tests/sim/captures/``), key for key.

Each case replays a captured request against the simulator, with directives that give the same
token layout (how many tokens, which of them hold their text back), and compares every chunk's
shape: which keys exist, in which order, null or not. Errors and the info routes are compared
byte for byte.
"""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.sim import SimEngine
from tests.sim.helpers import CHAT, COMPLETIONS, events, json_body
from tests.sim.vllm_captures import capture, same, shape

MODEL = "tiny"
MAX_MODEL_LEN = 2048
MESSAGES = [{"role": "user", "content": "Hello there"}]
PROMPT = "The capital of France"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def engine() -> SimEngine:
    return SimEngine(MODEL, max_model_len=MAX_MODEL_LEN)


def assert_same_stream(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    for number, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert same(shape(a), shape(b)), (number, a, b)


def collapsed(stream: list[Any]) -> list[Any]:
    """The stream's shapes with runs of one shape counted once."""
    shapes: list[Any] = []
    for event in stream:
        if not shapes or not same(shape(event), shapes[-1]):
            shapes.append(shape(event))
    return shapes


# Each capture, and a request giving the simulator the same layout. The captured model's
# text holds a token back after each visible one ("wo", held, "\ufffdwo", ...): hidden_tokens.
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_stream_plain": (CHAT, {"max_tokens": 4, "narwhal_sim": {"hidden_tokens": 2}}),
    "chat_stream_include_usage": (
        CHAT,
        {
            "max_tokens": 6,
            "stream_options": {"include_usage": True},
            "narwhal_sim": {"hidden_tokens": 3},
        },
    ),
    "chat_stream_logprobs": (
        CHAT,
        {"max_tokens": 3, "logprobs": True, "top_logprobs": 2, "narwhal_sim": {"hidden_tokens": 1}},
    ),
    "chat_stream_token_ids": (
        CHAT,
        {
            "max_tokens": 6,
            "return_token_ids": True,
            "stream_interval": 1,
            "narwhal_sim": {"hidden_tokens": 3},
        },
    ),
    "chat_stream_token_ids_usage_continuous": (
        CHAT,
        {
            "max_tokens": 4,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "narwhal_sim": {"hidden_tokens": 2},
        },
    ),
    "completions_stream_echo": (
        COMPLETIONS,
        {"max_tokens": 3, "echo": True, "return_token_ids": True},
    ),
    "completions_stream_logprobs": (
        COMPLETIONS,
        {
            "max_tokens": 4,
            "logprobs": 2,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    ),
}

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_nonstream": (CHAT, {"max_tokens": 6, "narwhal_sim": {"hidden_tokens": 3}}),
    "chat_nonstream_token_ids_logprobs": (
        CHAT,
        {
            "max_tokens": 3,
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 1,
            "narwhal_sim": {"hidden_tokens": 1},
        },
    ),
    "chat_nonstream_tool_named": (CHAT, {"tools": TOOLS, "tool_choice": NAMED}),
    "completions_nonstream_logprobs": (COMPLETIONS, {"max_tokens": 4, "logprobs": 2}),
    "completions_nonstream_prompt_logprobs": (
        COMPLETIONS,
        {"max_tokens": 3, "prompt_logprobs": 1},
    ),
}

# Exact answers: the body (and for a stream, every byte of it).
EXACT: dict[str, tuple[str, dict[str, Any]]] = {
    "completions_stream_prompt_logprobs": (COMPLETIONS, {"stream": True, "prompt_logprobs": 1}),
    "error_bad_temperature": (CHAT, {"temperature": -1}),
    "error_stream_bad_logprobs": (CHAT, {"stream": True, "logprobs": True, "top_logprobs": 50}),
    "error_too_long": (CHAT, {"max_tokens": 4000}),
    "error_unknown_model": (CHAT, {"model": "nope"}),
}


def body_for(path: str, fields: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL}
    base.update({"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT})
    fields = {"narwhal_sim": {"output_tokens": 10}, **fields}
    return {**base, **fields}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_streams_match_vllm_chunk_for_chunk(engine: SimEngine, name: str) -> None:
    path, fields = STREAMS[name]
    plan = engine.plan(path, body_for(path, {"stream": True, **fields}))
    real = capture(name)
    assert (plan.status, dict(plan.headers)["content-type"]) == (
        real.status,
        real.header("content-type"),
    )
    assert_same_stream(events(plan.body), real.events())


@pytest.mark.parametrize("name", sorted(BODIES))
def test_bodies_match_vllm_key_for_key(engine: SimEngine, name: str) -> None:
    path, fields = BODIES[name]
    plan = engine.plan(path, body_for(path, fields))
    real = capture(name)
    assert (plan.status, dict(plan.headers)["content-type"]) == (
        real.status,
        real.header("content-type"),
    )
    ours, theirs = json_body(plan), real.json()
    assert same(shape(ours), shape(theirs)), (ours, theirs)


def test_a_forced_call_streams_the_chunks_vllm_sends(engine: SimEngine) -> None:
    """``required``: the name, the arguments, the finish (vLLM's arguments came in one chunk)."""
    body = body_for(CHAT, {"stream": True, "tools": TOOLS, "tool_choice": "required"})
    ours = events(engine.plan(CHAT, body).body)
    theirs = capture("chat_stream_tool_required").events()
    assert len(collapsed(ours)) == len(collapsed(theirs)) == 5
    assert all(map(same, collapsed(ours), collapsed(theirs)))


def test_a_named_call_with_ids_has_every_kind_of_chunk_vllm_sends(engine: SimEngine) -> None:
    """The real stream holds back 35 tokens around the call; every chunk's shape is one of
    vLLM's, and each of vLLM's shapes is there."""
    fields = {"stream": True, "return_token_ids": True, "tools": TOOLS, "tool_choice": NAMED}
    body = body_for(CHAT, {**fields, "narwhal_sim": {"hidden_tokens": 2}})
    ours = [shape(e) for e in events(engine.plan(CHAT, body).body)]
    theirs = [shape(e) for e in capture("chat_stream_tool_named").events()]
    assert all(any(same(a, b) for b in theirs) for a in ours)
    assert all(any(same(a, b) for a in ours) for b in theirs)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_errors_are_vllms_bytes(engine: SimEngine, name: str) -> None:
    path, fields = EXACT[name]
    plan = engine.plan(path, {**body_for(path, {}), **fields, "narwhal_sim": {}})
    real = capture(name)
    assert plan.status == real.status
    assert dict(plan.headers)["content-type"] == real.header("content-type")
    assert plan.body == real.body


@pytest.mark.parametrize(
    ("path", "name"), [("/health", "health"), ("/version", "version"), ("/v1/models", "models")]
)
def test_info_routes_match_vllm(engine: SimEngine, path: str, name: str) -> None:
    plan = engine.respond("GET", path, created=1796114271)
    real = capture(name)
    assert plan.status == real.status
    assert dict(plan.headers).get("content-type") == real.header("content-type")
    if name == "health":
        assert plan.body == real.body == b""
        return
    ours, theirs = json_body(plan), real.json()
    assert same(shape(ours), shape(theirs))
    if name == "models":
        (card,) = ours["data"]
        (real_card,) = theirs["data"]
        assert card.pop("root") == MODEL  # vLLM's is the model's path
        real_card.pop("root")
        (permission,) = card.pop("permission")
        (real_permission,) = real_card.pop("permission")
        assert card == real_card  # id, object, created, owned_by, parent, max_model_len
        assert permission.pop("id").startswith("modelperm-")
        real_permission.pop("id")
        assert permission == real_permission
    else:
        assert ours == theirs


def test_the_fingerprint_names_vllm_0_32(engine: SimEngine) -> None:
    finish = events(engine.plan(CHAT, body_for(CHAT, {"stream": True})).body)[-2]
    real = capture("chat_stream_plain").events()[-2]
    assert finish["system_fingerprint"].startswith("vllm-0.32.0-")
    assert len(finish["system_fingerprint"]) == len(real["system_fingerprint"])


def test_ids_look_like_vllms(engine: SimEngine) -> None:
    chat = json_body(engine.plan(CHAT, body_for(CHAT, {})))
    text = json_body(engine.plan(COMPLETIONS, body_for(COMPLETIONS, {})))
    assert len(chat["id"]) == len(capture("chat_nonstream").json()["id"])  # chatcmpl- + 16 hex
    assert len(text["id"]) == len(capture("completions_nonstream_logprobs").json()["id"])
