"""Planning: determinism, lengths, timing, sizing, directives, statistics (pure)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from narwhal.sim import LinearTiming, SimEngine, StepTiming, profile
from narwhal.sim.calibration import engine_type
from narwhal.sim.engine import DEFAULT_CREATED
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat, json_body, plan_events

EXACT = LinearTiming(prefill_base_s=0.5, prefill_per_token_s=0.0, decode_step_s=0.25)


def text_of(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )


def test_the_same_seed_and_body_give_the_same_plan() -> None:
    body = {"messages": [{"role": "user", "content": "Tell me"}], "stream": True}
    first = SimEngine(MODEL, seed=3).plan(CHAT, body)
    again = SimEngine(MODEL, seed=3).plan(CHAT, dict(body))
    assert first == again


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_identical_requests_get_distinct_ids_and_the_same_answer(dialect: str, path: str) -> None:
    engine = SimEngine(MODEL, dialect=dialect, seed=3)  # type: ignore[arg-type]
    body: dict[str, Any] = {"model": MODEL, "stream": True}
    body.update(
        {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "x"}
    )
    plans = [engine.plan(path, body) for _ in range(3)]
    ids = [plan_events(plan)[0]["id"] for plan in plans]
    assert len(set(ids)) == 3
    for plan, response_id in zip(plans, ids, strict=True):
        decoded = [e for e in plan_events(plan) if isinstance(e, dict)]
        assert {e["id"] for e in decoded} == {response_id}  # one id per response
    texts = [plan.body.replace(i.encode(), b"") for plan, i in zip(plans, ids, strict=True)]
    assert texts[0] == texts[1] == texts[2]


def test_seed_and_body_change_the_answer() -> None:
    body = {"messages": [{"role": "user", "content": "Tell me"}], "stream": True}
    base = text_of(plan_events(SimEngine(MODEL, seed=3).plan(CHAT, body)))
    other_seed = text_of(plan_events(SimEngine(MODEL, seed=4).plan(CHAT, body)))
    other_body = text_of(
        plan_events(SimEngine(MODEL, seed=3).plan(CHAT, {**body, "temperature": 0.5}))
    )
    assert len({base, other_seed, other_body}) == 3


def test_default_length_is_seeded_between_8_and_48() -> None:
    engine = SimEngine(MODEL)
    lengths = {
        json_body(chat(engine, user=str(i)))["usage"]["completion_tokens"] for i in range(60)
    }
    assert min(lengths) >= 8 and max(lengths) <= 48 and len(lengths) > 10


def test_reasoning_adds_to_the_default_length() -> None:
    engine = SimEngine(MODEL)
    usage = json_body(chat(engine, narwhal_sim={"reasoning_tokens": 50}))["usage"]
    assert 58 <= usage["completion_tokens"] <= 98


@pytest.mark.parametrize(("key", "value"), [("max_tokens", 5), ("max_completion_tokens", 5)])
def test_max_tokens_caps_the_output(key: str, value: int) -> None:
    body = json_body(chat(SimEngine(MODEL), **{key: value}, narwhal_sim={"output_tokens": 20}))
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_ignore_eos_runs_a_plain_answer_to_its_cap(dialect: str) -> None:
    # vLLM's and SGLang's sampling parameter: the end-of-sequence token does not end the
    # answer, max_tokens does (what profiling's decode probes rely on).
    engine = SimEngine(MODEL, dialect=dialect)  # type: ignore[arg-type]
    body = json_body(chat(engine, max_tokens=300, ignore_eos=True))
    assert body["usage"]["completion_tokens"] == 300
    assert body["choices"][0]["finish_reason"] == "length"
    assert json_body(chat(engine, max_tokens=300))["usage"]["completion_tokens"] <= 48


def test_openai_has_no_ignore_eos() -> None:
    engine = SimEngine(MODEL, dialect="openai")
    body = json_body(chat(engine, max_tokens=300, ignore_eos=True))
    assert body["usage"]["completion_tokens"] <= 48


def test_a_non_boolean_ignore_eos_is_vllms_validation_error() -> None:
    plan = chat(SimEngine(MODEL), ignore_eos="yes")
    assert plan.status == 400
    assert json_body(plan)["error"]["message"].count("ignore_eos") == 1


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = json_body(
        chat(
            SimEngine(MODEL),
            max_tokens=2,
            max_completion_tokens=4,
            narwhal_sim={"output_tokens": 20},
        )
    )
    assert body["usage"]["completion_tokens"] == 4


def test_zero_output_tokens_is_a_finish_with_no_ids() -> None:
    events = plan_events(
        chat(SimEngine(MODEL), stream=True, return_token_ids=True, narwhal_sim={"output_tokens": 0})
    )
    _role, finish, done = events
    assert finish["choices"][0]["token_ids"] == []
    assert finish["choices"][0]["delta"] == {"content": ""}
    assert done == "[DONE]"


def test_frames_are_timed_by_the_timing_model() -> None:
    engine = SimEngine(MODEL, timing=EXACT)
    plan = chat(engine, stream=True, narwhal_sim={"output_tokens": 3})
    assert [f.delay_s for f in plan.frames] == [0.5, 0.0, 0.25, 0.25, 0.0]
    assert plan.duration_s == 1.0


def test_prefill_grows_with_the_prompt() -> None:
    engine = SimEngine(MODEL, timing=LinearTiming(0.0, 0.25, 0.0))
    plan = engine.plan(CHAT, {"messages": [{"role": "user", "content": "x" * 16}], "stream": True})
    assert plan.frames[0].delay_s == 1.0  # 16 characters are 4 tokens
    assert plan.prompt_tokens == 4


def test_directives_override_timing_and_are_scaled() -> None:
    engine = SimEngine(MODEL, timing=profile("h100-llama3-8b", time_scale=2.0))
    plan = chat(engine, stream=True, narwhal_sim={"output_tokens": 2, "ttft_s": 0.25, "itl_s": 1})
    assert [f.delay_s for f in plan.frames] == [0.5, 0.0, 2.0, 0.0]


def test_zero_profile_has_no_delay_at_all() -> None:
    plan = chat(SimEngine(MODEL, timing=profile("zero")), stream=True)
    assert all(frame.delay_s == 0.0 for frame in plan.frames)
    assert plan.head_delay_s == 0.0


def test_non_streaming_answers_after_the_whole_generation() -> None:
    plan = chat(SimEngine(MODEL, timing=EXACT), narwhal_sim={"output_tokens": 3})
    assert plan.head_delay_s == 1.0
    assert [f.delay_s for f in plan.frames] == [0.0]


def test_prompt_size_and_ids() -> None:
    engine = SimEngine(MODEL)
    messages = [
        {"role": "system", "content": "abcd" * 3},
        {"role": "user", "content": [{"type": "text", "text": "efgh"}]},
    ]
    body = json_body(engine.plan(CHAT, {"messages": messages, "return_token_ids": True}))
    assert body["usage"]["prompt_tokens"] == 5  # 17 characters (with the separator)
    assert (
        body["prompt_token_ids"]
        == json_body(
            engine.plan(CHAT, {"messages": messages, "return_token_ids": True, "user": "x"})
        )["prompt_token_ids"]
    )
    forced = json_body(chat(engine, return_token_ids=True, narwhal_sim={"prompt_tokens": 9}))
    assert forced["usage"]["prompt_tokens"] == len(forced["prompt_token_ids"]) == 9


def test_created_can_come_from_a_clock() -> None:
    engine = SimEngine(MODEL)
    assert json_body(chat(engine))["created"] == DEFAULT_CREATED
    body = json_body(engine.plan(CHAT, {"messages": [{"role": "user", "content": "x"}]}, created=7))
    assert body["created"] == 7


@pytest.mark.parametrize(
    ("directives", "param"),
    [
        ({"colour": "red"}, "narwhal_sim.colour"),
        ({"output_tokens": -1}, "narwhal_sim.output_tokens"),
        ({"output_tokens": True}, "narwhal_sim.output_tokens"),
        ({"tokens_per_chunk": 0}, "narwhal_sim.tokens_per_chunk"),
        ({"ttft_s": "soon"}, "narwhal_sim.ttft_s"),
        ({"fault": "gremlins"}, "narwhal_sim.fault"),
        ({"refusal": 3}, "narwhal_sim.refusal"),
        ({"ignore_token_ids": 1}, "narwhal_sim.ignore_token_ids"),
        ("everything", "narwhal_sim"),
    ],
)
def test_bad_directives_are_a_400_naming_the_key(directives: Any, param: str) -> None:
    plan = chat(SimEngine(MODEL), narwhal_sim=directives)
    assert plan.status == 400
    assert json_body(plan)["error"]["param"] == param


def test_engine_directives_apply_under_the_request_ones() -> None:
    engine = SimEngine(MODEL)
    engine.set_directives({"output_tokens": 3, "fault": "http_503"})
    assert chat(engine).status == 503
    assert engine.directives == {"output_tokens": 3, "fault": "http_503"}
    engine.set_directives({"output_tokens": 3})
    assert json_body(chat(engine))["usage"]["completion_tokens"] == 3
    assert (
        json_body(chat(engine, narwhal_sim={"output_tokens": 5}))["usage"]["completion_tokens"] == 5
    )
    engine.set_directives(None)
    with pytest.raises(ValueError, match=r"narwhal_sim\.fault"):
        engine.set_directives({"fault": "nope"})


def test_info_routes() -> None:
    engine = SimEngine(MODEL)
    assert engine.respond("GET", "/health").status == 200
    models = json_body(engine.respond("GET", "/v1/models"))
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    metrics = engine.respond("GET", "/metrics").body.decode()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{engine="0",model_name="{MODEL}"}} 0.0' in metrics
        assert f"# TYPE vllm:{name} gauge" in metrics
    assert engine.respond("POST", "/health").status == 405


def test_statistics_count_plans_and_running_streams() -> None:
    engine = SimEngine(MODEL, timing=EXACT, kv_capacity_tokens=100)
    plan = chat(engine, stream=True, narwhal_sim={"output_tokens": 7, "prompt_tokens": 3})
    chat(engine, narwhal_sim={"fault": "http_500"})
    engine.plan(COMPLETIONS, {"prompt": ""})
    stream = engine.stream(plan)
    stats = engine.statistics()
    assert (stats.requests, stats.errors, stats.running) == (3, 2, 1)
    assert (stats.kv_tokens, stats.kv_cache_usage) == (10, 0.1)
    assert "vllm:num_requests_running" in engine.metrics_text()
    stream.close()
    stats = engine.statistics()
    assert (stats.running, stats.kv_tokens, stats.closed_early) == (0, 0, 1)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": "hi"}, "body.messages"),
        (CHAT, {"messages": ["hi"]}, "body.messages.0"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "body.stream"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "stop": 3}, "body.stop"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": {}}, "body.tools"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "stream_options": 1},
         "body.stream_options"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                "top_logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "logprobs": -1}, "logprobs"),  # the whole vocabulary
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 0}, None),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, -2]}, "prompt"),
    ],
)  # fmt: skip
def test_request_validation(path: str, body: dict[str, Any], param: str | None) -> None:
    plan = SimEngine(MODEL).plan(path, body)
    assert plan.status == 400
    assert json_body(plan)["error"]["param"] == param


def test_lenient_request_forms() -> None:
    engine = SimEngine(MODEL)
    accepted: list[tuple[str, dict[str, Any]]] = [
        (COMPLETIONS, {"prompt": ["one prompt"], "logprobs": 20}),
        (COMPLETIONS, {"prompt": [[1, 2, 3]]}),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "stop": []}),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "unknown_field": 1}),
        (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
    ]  # fmt: skip
    for path, body in accepted:
        assert engine.plan(path, body).status == 200, body
    assert engine.plan_bytes(CHAT, b"[1, 2]").status == 400
    assert engine.plan("/v1/embeddings", {}).status == 404


def test_step_model_plans_wait_for_output_steps() -> None:
    engine = SimEngine(MODEL)  # h100-llama3-8b: the step loop
    plan = chat(engine, stream=True, narwhal_sim={"output_tokens": 3})
    assert plan.batched
    assert [f.step for f in plan.frames] == [1, 1, 2, 3, 3]  # role, tokens, [DONE]
    alone = engine.timing.first_token_delay_s(plan.prompt_tokens)
    assert plan.frames[0].delay_s == alone  # the per-request clock: alone on an idle engine
    whole = chat(engine, narwhal_sim={"output_tokens": 3})
    assert (whole.batched, whole.head_step, whole.head_hold_s) == (True, 3, 0.0)
    stalled = chat(engine, narwhal_sim={"output_tokens": 3, "fault": "stall", "stall_s": 2.0})
    assert (stalled.head_step, stalled.head_hold_s) == (3, 2.0)
    assert not chat(engine, narwhal_sim={"ttft_s": 0.1}).batched
    assert not chat(engine, narwhal_sim={"itl_s": 0.1}).batched
    assert not chat(SimEngine(MODEL, timing=EXACT)).batched
    assert not chat(engine, narwhal_sim={"fault": "http_500"}).batched


def test_admin_routes_switch_the_engine() -> None:
    engine = SimEngine(MODEL, name="sim-a")
    state = json_body(engine.respond("GET", "/sim/state"))
    assert (state["name"], state["slowdown"], state["kv_capacity_tokens"]) == ("sim-a", 1.0, 467000)
    assert (state["running"], state["waiting"], state["directives"]) == (0, 0, {})
    assert engine.respond("POST", "/sim/slowdown", b'{"factor": 3}').status == 200
    assert engine.slowdown == 3.0 and engine.statistics().slowdown == 3.0
    for raw in (b'{"factor": -1}', b'{"factor": true}', b'{"factor": "2"}', b"{}", b"[1]", b"{"):
        refused = engine.respond("POST", "/sim/slowdown", raw)
        assert refused.status == 400 and json_body(refused)["error"]["message"], raw
    assert engine.slowdown == 3.0
    assert engine.respond("POST", "/sim/directives", b'{"fault": "http_503"}').status == 200
    assert chat(engine).status == 503
    bad = engine.respond("POST", "/sim/directives", b'{"output_tokens": -1}')
    assert json_body(bad)["error"]["param"] == "narwhal_sim.output_tokens"
    assert engine.respond("POST", "/sim/directives", b"{}").status == 200
    assert chat(engine).status == 200
    assert engine.respond("GET", "/sim/slowdown").status == 405
    assert engine.respond("POST", "/sim/state").status == 405
    assert engine.respond("HEAD", "/sim/state").status == 200
    with pytest.raises(ValueError, match="slowdown"):
        engine.set_slowdown(float("inf"))


def test_kv_capacity_comes_from_the_profile_unless_given() -> None:
    assert SimEngine(MODEL).statistics().kv_capacity_tokens == 467_000
    small = attrs.evolve(engine_type("a100"), kv_capacity_tokens=400_000)
    assert SimEngine(MODEL, timing=StepTiming(small)).statistics().kv_capacity_tokens == 400_000
    assert SimEngine(MODEL, kv_capacity_tokens=1000).statistics().kv_capacity_tokens == 1000
    assert SimEngine(MODEL, timing=EXACT).statistics().kv_capacity_tokens == 262144
    with pytest.raises(ValueError):
        SimEngine(MODEL, kv_capacity_tokens=0)


def test_a_step_model_stream_queues_for_the_batch_until_a_loop_runs() -> None:
    engine = SimEngine(MODEL)
    plan = chat(engine, stream=True, narwhal_sim={"output_tokens": 7, "prompt_tokens": 3})
    stream = engine.stream(plan)  # outside Trio: no loop yet, so it waits in the queue
    stats = engine.statistics()
    assert (stats.running, stats.waiting, stats.kv_tokens, stats.steps) == (0, 1, 0, 0)
    assert "vllm:num_requests_waiting" in engine.metrics_text()
    stream.close()
    stats = engine.statistics()
    assert (stats.waiting, stats.closed_early) == (0, 1)
