"""vLLM 0.32 behaviours of the ``vllm`` dialect that Narwhal must handle (pure, and in-process).

Each is a fact of vLLM 0.32: a capture in ``tests/sim/captures/`` or a line of its source
(``vllm/entrypoints/openai/*/serving.py``, ``protocol.py``, ``vllm/renderers/params.py``,
``vllm/sampling_params.py``, ``vllm/entrypoints/serve/middleware/authenticate.py``).
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
import trio

from narwhal.sim import SimEngine, SimTransport
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, events, json_body, plan_events
from tests.sim.vllm_captures import capture

MESSAGES = [{"role": "user", "content": "Hello there"}]
PROMPT = "The capital of France is"


@pytest.fixture
def engine() -> SimEngine:
    return SimEngine(MODEL)


def chat(engine: SimEngine, **fields: Any) -> Any:
    return engine.plan(CHAT, {"model": MODEL, "messages": MESSAGES, **fields})


def completion(engine: SimEngine, **fields: Any) -> Any:
    return engine.plan(COMPLETIONS, {"model": MODEL, "prompt": PROMPT, **fields})


def error(plan: Any) -> dict[str, Any]:
    body = json_body(plan)
    assert set(body) == {"error"}, body
    return dict(body["error"])


# --- errors a stream hears of in band ---------------------------------------------------------


def test_too_many_logprobs_is_in_band_for_a_stream_and_a_400_otherwise(engine: SimEngine) -> None:
    fields = {"logprobs": True, "top_logprobs": 50}
    streamed = chat(engine, stream=True, **fields)
    assert (streamed.status, streamed.streaming) == (200, True)
    frame, done = events(streamed.body)
    assert done == "[DONE]"
    assert streamed.body == capture("error_stream_bad_logprobs").body
    whole = chat(engine, **fields)
    assert (whole.status, whole.streaming) == (400, False)
    assert error(whole) == frame["error"]
    assert engine.statistics().errors == 2


def test_completions_logprobs_over_the_limit(engine: SimEngine) -> None:
    streamed = completion(engine, stream=True, logprobs=21)
    assert streamed.status == 200
    assert events(streamed.body)[0]["error"]["message"] == (
        "Requested sample logprobs of 21, which is greater than max allowed: 20 "
        "(parameter=logprobs, value=21)"
    )
    assert completion(engine, logprobs=20).status == 200


def test_minus_one_asks_for_the_whole_vocabulary(engine: SimEngine) -> None:
    message = error(chat(engine, logprobs=True, top_logprobs=-1))["message"]
    assert message.startswith("Requested sample logprobs of 151936, which is greater than")


# --- prompt_logprobs --------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_prompt_logprobs_are_refused_on_streams(engine: SimEngine, path: str) -> None:
    make = chat if path == CHAT else completion
    plan = make(engine, stream=True, prompt_logprobs=1)
    assert plan.status == 400
    assert plan.body == capture("completions_stream_prompt_logprobs").body
    assert make(engine, stream=True, prompt_logprobs=0).status == 200  # vLLM lets 0 through


def test_prompt_logprobs_without_a_stream(engine: SimEngine) -> None:
    body = json_body(chat(engine, prompt_logprobs=2, narwhal_sim={"output_tokens": 2}))
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"]
    for entry in entries[1:]:
        assert 2 <= len(entry) <= 3  # the prompt's own token, and the two most likely
        assert all(
            k.isdigit() and set(v) == {"logprob", "rank", "decoded_token"} for k, v in entry.items()
        )
    text = json_body(completion(engine, prompt_logprobs=0, narwhal_sim={"output_tokens": 2}))
    choice = text["choices"][0]
    assert all(len(entry) == 1 for entry in choice["prompt_logprobs"][1:])
    assert (
        "".join(next(iter(e.values()))["decoded_token"] for e in choice["prompt_logprobs"][1:])
        == PROMPT[4:]
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-2, "`prompt_logprobs` must be a positive value or -1. "
             "(parameter=prompt_logprobs, value=-2)"),
        ("x", "`prompt_logprobs` must be an integer. (parameter=prompt_logprobs, value=x)"),
        (21, "Requested prompt logprobs of 21, which is greater than max allowed: 20 "
             "(parameter=prompt_logprobs, value=21)"),
    ],
)  # fmt: skip
def test_bad_prompt_logprobs(engine: SimEngine, value: Any, message: str) -> None:
    failure = error(completion(engine, prompt_logprobs=value))
    assert (failure["message"], failure["param"]) == (message, "prompt_logprobs")


# --- echo -------------------------------------------------------------------------------------


def test_completions_echo_prepends_the_prompt(engine: SimEngine) -> None:
    first, *_ = plan_events(completion(engine, stream=True, echo=True, logprobs=1))
    choice = first["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert isinstance(choice["prompt_token_ids"], list)  # an echo returns them, IDs or not
    assert choice["token_ids"] is None
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][:2] == [0, 4]
    body = json_body(completion(engine, echo=True, logprobs=1))
    assert body["choices"][0]["text"].startswith(PROMPT)
    assert body["choices"][0]["prompt_logprobs"][0] is None  # echo scores the prompt


def test_return_token_ids_drops_the_echo(engine: SimEngine) -> None:
    """vLLM 0.32 (completion/serving.py): with return_token_ids the echoed text is ""."""
    events_ = plan_events(completion(engine, stream=True, echo=True, return_token_ids=True))
    first = events_[0]["choices"][0]
    real = capture("completions_stream_echo").events()[0]["choices"][0]
    assert not first["text"].startswith(PROMPT) and not real["text"].startswith("The")
    assert first["prompt_token_ids"] and first["token_ids"]
    body = json_body(completion(engine, echo=True, return_token_ids=True))
    assert not body["choices"][0]["text"].startswith(PROMPT)
    assert body["choices"][0]["prompt_token_ids"]
    assert body["choices"][0]["text"]


def test_chat_echo_repeats_an_assistant_message_being_continued(engine: SimEngine) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    fields = {"model": MODEL, "messages": messages, "echo": True}
    _role, echoed, first, *_ = plan_events(engine.plan(CHAT, {**fields, "stream": True}))
    assert echoed["choices"][0] == {
        "index": 0,
        "delta": {"content": "Once upon"},
        "logprobs": None,
        "finish_reason": None,
    }
    assert "prompt_token_ids" not in echoed and "token_ids" in first["choices"][0]
    body = json_body(engine.plan(CHAT, fields))
    assert body["choices"][0]["message"]["content"].startswith("Once upon")
    # vLLM scores an echoed prompt with top_logprobs (0 by default): the prompt's own tokens.
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])
    # The last message is the user's: nothing to echo, the first chunk after the role's is output.
    unechoed = plan_events(chat(engine, stream=True, echo=True))
    assert "token_ids" in unechoed[1]["choices"][0]


# --- the context length -----------------------------------------------------------------------


def test_a_prompt_longer_than_the_context_is_vllms_400() -> None:
    engine = SimEngine(MODEL, max_model_len=100)
    text = error(engine.plan(COMPLETIONS, {"prompt": "x" * 404}))
    assert text == {
        "message": "This model's maximum context length is 100 tokens. However, your prompt "
        "contains at least 101 input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
        "value=101)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    ids = error(engine.plan(COMPLETIONS, {"prompt": list(range(300))}))["message"]
    assert "your prompt contains 300 input tokens" in ids  # IDs are not truncated
    streamed = engine.plan(
        CHAT, {"messages": [{"role": "user", "content": "y" * 500}], "stream": True}
    )
    assert streamed.status == 400  # found before any answer, stream or not
    full = error(engine.plan(COMPLETIONS, {"prompt": list(range(100))}))
    assert (
        full["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )


def test_the_output_is_capped_at_what_the_context_leaves() -> None:
    engine = SimEngine(MODEL, max_model_len=100)
    body = json_body(engine.plan(COMPLETIONS, {"prompt": list(range(97)), "max_tokens": 50}))
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    named = error(engine.plan(CHAT, {"messages": MESSAGES, "max_completion_tokens": 101}))
    assert named["param"] == "max_completion_tokens"
    assert named["message"].startswith("max_completion_tokens=101 cannot be greater than")


# --- sampling parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5. "
         "(parameter=temperature, value=2.5)", "temperature"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0.", None),
        ({"n": 0}, "n must be at least 1, got 0.", None),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
         "max_tokens"),
    ],
)  # fmt: skip
def test_sampling_parameters_are_checked_as_vllm_does(
    engine: SimEngine, fields: dict[str, Any], message: str, param: str | None
) -> None:
    failure = error(chat(engine, **fields))
    assert (failure["message"], failure["param"], failure["code"]) == (message, param, 400)


# --- held-back tokens -------------------------------------------------------------------------


def test_held_back_tokens_travel_with_their_ids_only_when_asked(engine: SimEngine) -> None:
    directives = {"output_tokens": 5, "hidden_tokens": 2}  # w H w H EOS
    with_ids = plan_events(chat(engine, stream=True, return_token_ids=True, narwhal_sim=directives))
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["token_ids"]) for e in with_ids[1:-1]]
    assert [bool(delta) for delta, _ in deltas] == [True, False, True, False, False]
    assert all(len(ids) == 1 for _, ids in deltas)
    plain = plan_events(chat(engine, stream=True, narwhal_sim=directives))
    assert [bool(e["choices"][0]["delta"]) for e in plain[1:-1]] == [True, True, False]
    with_logprobs = plan_events(chat(engine, stream=True, logprobs=True, narwhal_sim=directives))
    held = with_logprobs[2]["choices"][0]
    assert held["delta"] == {} and held["logprobs"]["content"][0]["token"] == ""
    body = json_body(chat(engine, return_token_ids=True, narwhal_sim=directives))
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"] == 5


def test_continuous_usage_counts_held_back_tokens(engine: SimEngine) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = plan_events(
        chat(
            engine,
            stream=True,
            stream_options=options,
            narwhal_sim={"output_tokens": 4, "hidden_tokens": 1},
        )
    )[1:-2]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 3, 4]  # the held token unsent


def test_completions_send_held_back_tokens_as_empty_text(engine: SimEngine) -> None:
    chunks = plan_events(
        completion(engine, stream=True, narwhal_sim={"output_tokens": 4, "hidden_tokens": 1})
    )
    assert [c["choices"][0]["text"] == "" for c in chunks[:-1]] == [False, True, False, True]


# --- identity and access ----------------------------------------------------------------------


def test_x_request_id_is_the_response_id(engine: SimEngine) -> None:
    headers = {"x-request-id": "abc-123"}
    plan = engine.respond("POST", CHAT, orjson.dumps({"messages": MESSAGES}), headers=headers)
    assert json_body(plan)["id"] == "chatcmpl-abc-123"
    raw = orjson.dumps({"prompt": PROMPT, "stream": True, "request_id": "body-id"})
    assert events(engine.respond("POST", COMPLETIONS, raw).body)[0]["id"] == "cmpl-body-id"
    assert events(engine.respond("POST", COMPLETIONS, raw, headers=headers).body)[0]["id"] == (
        "cmpl-abc-123"
    )


def test_an_api_key_guards_the_v1_routes() -> None:
    engine = SimEngine(MODEL, api_key="sekret")
    for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/v1/nowhere")):
        plan = engine.respond(method, path, orjson.dumps({"messages": MESSAGES}))
        assert (plan.status, plan.body) == (401, b'{"error":"Unauthorized"}')
        assert dict(plan.headers)["content-type"] == "application/json"
        wrong = engine.respond(method, path, headers={"authorization": "Basic sekret"})
        assert wrong.status == 401
    for path in ("/health", "/metrics", "/version"):
        assert engine.respond("GET", path).status == 200
    good = {"authorization": "bearer sekret"}  # vLLM reads the scheme case-insensitively
    assert engine.respond("GET", "/v1/models", headers=good).status == 200
    assert engine.respond("OPTIONS", "/v1/models").status != 401


def test_a_reasoning_parser_counts_reasoning_tokens_in_chat_usage() -> None:
    engine = SimEngine(MODEL, reasoning_parser=True)
    directives = {"output_tokens": 5, "reasoning_tokens": 2}
    body = json_body(chat(engine, narwhal_sim=directives))
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = plan_events(chat(engine, stream=True, stream_options=options, narwhal_sim=directives))
    assert [c["usage"]["completion_tokens_details"]["reasoning_tokens"] for c in chunks[:-1]] == [
        0,
        1,
        2,
        2,
        2,
        2,
    ]
    assert list(chunks[-2]["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "completion_tokens_details",
    ]
    text = json_body(completion(engine))  # the parsers serve chat only
    assert text["usage"]["completion_tokens_details"] is None


def test_version_is_a_vllm_route() -> None:
    assert json_body(SimEngine(MODEL).respond("GET", "/version")) == {"version": "0.32.0"}
    assert SimEngine(MODEL, dialect="sglang").respond("GET", "/version").status == 404


async def test_the_transport_passes_the_headers(autojump_clock: trio.testing.MockClock) -> None:
    transport = SimTransport(SimEngine(MODEL, api_key="k"))
    with trio.fail_after(60):
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            refused = await client.get("/v1/models")
            answer = await client.post(
                CHAT,
                json={"messages": MESSAGES},
                headers={"Authorization": "Bearer k", "X-Request-Id": "r-1"},
            )
    assert refused.status_code == 401
    assert answer.json()["id"] == "chatcmpl-r-1"
    assert answer.headers["content-length"] == str(len(answer.content))  # as vLLM's
