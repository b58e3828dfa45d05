"""Every fault directive, streaming and not, in every dialect where it differs (pure)."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from narwhal.sim import LinearTiming, SimEngine
from tests.sim.helpers import MODEL, chat, completion, json_body, plan_events

EXACT = LinearTiming(prefill_base_s=0.5, prefill_per_token_s=0.0, decode_step_s=0.25)


def engine(dialect: str = "vllm") -> SimEngine:
    return SimEngine(MODEL, dialect=dialect, timing=EXACT)  # type: ignore[arg-type]


def fault(name: str, at: int = 0, **extra: Any) -> dict[str, Any]:
    return {"output_tokens": 5, "fault": name, "fault_at": at, **extra}


def stream(dialect: str = "vllm", **directives: Any) -> list[Any]:
    ids = {"return_token_ids": True} if dialect == "vllm" else {}
    plan = chat(engine(dialect), stream=True, narwhal_sim=directives, **ids)
    return plan_events(plan)


def carried_ids(events: list[Any]) -> list[Any]:
    return [
        i
        for e in events
        if isinstance(e, dict) and e.get("choices")
        for i in e["choices"][0].get("token_ids") or []
    ]


# --- immediate errors -------------------------------------------------------------------------


@pytest.mark.parametrize("stream_flag", [True, False])
@pytest.mark.parametrize(
    ("name", "status", "vllm_type"),
    [
        ("http_500", 500, "InternalServerError"),
        ("http_503", 503, "Service Unavailable"),
        ("http_400", 400, "Bad Request"),
    ],
)
def test_http_faults_answer_at_once(
    name: str, status: int, vllm_type: str, stream_flag: bool
) -> None:
    plan = chat(engine(), stream=stream_flag, narwhal_sim=fault(name, at=3))
    assert plan.status == status and plan.duration_s == 0.0
    error = json_body(plan)["error"]
    assert (error["type"], error["code"]) == (vllm_type, status)


def test_vllm_http_400_names_the_missing_field() -> None:
    assert json_body(chat(engine(), narwhal_sim=fault("http_400")))["error"]["param"] == (
        "body.messages"
    )
    cmpl = completion(engine(), narwhal_sim=fault("http_400"))
    assert json_body(cmpl)["error"]["param"] == "body.prompt"


@pytest.mark.parametrize("dialect", ["sglang", "openai"])
def test_http_faults_in_other_dialects(dialect: str) -> None:
    body = json_body(chat(engine(dialect), narwhal_sim=fault("http_400")))
    error = body if dialect == "sglang" else body["error"]
    assert error["message"]


# --- in-band and stream faults ----------------------------------------------------------------


def test_error_frame_then_done() -> None:
    events = stream(**fault("error_frame", at=2))
    _role, first, second, error, done = events
    assert carried_ids([first, second]) and len(carried_ids([first, second])) == 2
    assert error == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert done == "[DONE]"


def test_error_frame_at_zero_comes_before_the_role_chunk() -> None:
    plan = chat(engine(), stream=True, narwhal_sim=fault("error_frame"))
    assert [list(e) for e in plan_events(plan)[:1]] == [["error"]]
    assert plan.frames[0].delay_s == 0.5  # when the first output would have been


@pytest.mark.parametrize(
    ("name", "expected"),
    [("malformed_token_ids", [True]), ("missing_token_ids", None), ("negative_token_id", [-1])],
)
@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
def test_token_id_faults_hit_the_chunk_carrying_that_token(
    name: str, expected: list[Any] | None, dialect: str
) -> None:
    events = stream(dialect, **fault(name, at=2))
    _role, first, second, third, *_ = events
    assert third["choices"][0]["token_ids"] == expected
    for other in (first, second):  # the others are intact (vLLM) or carry no key at all
        ids = other["choices"][0].get("token_ids", [0])
        assert len(ids) == 1 and type(ids[0]) is int and ids[0] >= 0
    assert events[-1] == "[DONE]"


def test_token_id_fault_on_a_requested_stream_keeps_the_other_ids() -> None:
    events = stream(**fault("malformed_token_ids", at=3))
    ids = carried_ids(events)
    assert len(ids) == 5 and ids[3] is True
    assert sum(1 for i in ids if isinstance(i, bool)) == 1
    missing = stream(**fault("missing_token_ids", at=3))
    assert [e["choices"][0]["token_ids"] is None for e in missing[1:-1]] == [
        False,
        False,
        False,
        True,
        False,
    ]


def test_non_json_line_then_the_stream_goes_on() -> None:
    events = stream(**fault("non_json", at=1))
    assert isinstance(events[2], str) and events[2] != "[DONE]"
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(events[2])
    assert len(carried_ids(events)) == 5 and events[-1] == "[DONE]"


def test_truncate_ends_without_finish_or_done() -> None:
    plan = chat(engine(), stream=True, narwhal_sim=fault("truncate", at=3))
    events = plan_events(plan)
    assert len(events) == 4  # role and three tokens
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    assert not plan.drop
    assert plan.duration_s == 0.5 + 3 * 0.25  # ends when token 3 would have come


def test_truncate_past_the_end_still_withholds_the_finish() -> None:
    events = stream(**fault("truncate", at=99))
    assert len(carried_ids(events)) == 4
    assert "[DONE]" not in events


def test_no_done_keeps_finish_and_usage() -> None:
    plan = chat(
        engine(),
        stream=True,
        stream_options={"include_usage": True},
        narwhal_sim=fault("no_done"),
    )
    events = plan_events(plan)
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "[DONE]" not in events


def test_stall_waits_before_that_chunk() -> None:
    plan = chat(engine(), stream=True, narwhal_sim=fault("stall", at=2, stall_s=3.0))
    assert [f.delay_s for f in plan.frames] == [0.5, 0.0, 0.25, 3.25, 0.25, 0.25, 0.0]
    assert len(carried_ids(plan_events(plan))) == 0  # not requested: null IDs


def test_stall_defaults_to_forever_and_at_zero_precedes_everything() -> None:
    plan = chat(engine(), stream=True, narwhal_sim=fault("stall"))
    assert plan.frames[0].delay_s == math.inf
    assert plan.duration_s == math.inf


def test_drop_breaks_the_connection_there() -> None:
    plan = chat(engine(), stream=True, narwhal_sim=fault("drop", at=2))
    assert plan.drop
    assert len(plan_events(plan)) == 3  # role and two tokens
    assert plan.frames[-1].data == b"" and plan.duration_s == 1.0


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("unsupported_field", "audio", {"id": "x"}),
        ("annotations", "annotations", None),
    ],
)
def test_field_faults_put_a_value_in_the_delta(name: str, key: str, value: Any) -> None:
    events = stream(**fault(name, at=1))
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    carrying = [d for d in deltas if key in d]
    assert len(carrying) == 1 and carrying[0] is deltas[2]
    assert carrying[0][key] == value if value is not None else carrying[0][key]
    cmpl = plan_events(completion(engine(), stream=True, narwhal_sim=fault(name, at=1)))
    assert key in cmpl[1]["choices"][0]


# --- non-streaming ----------------------------------------------------------------------------


def test_non_streaming_faults() -> None:
    sim = engine()
    error = chat(sim, narwhal_sim=fault("error_frame", at=2))
    assert (error.status, error.head_delay_s) == (500, 1.0)
    dropped = chat(sim, narwhal_sim=fault("drop", at=4))
    assert dropped.drop and dropped.frames == () and dropped.head_delay_s == 1.5
    cut = chat(sim, narwhal_sim=fault("truncate"))
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(cut.body)
    assert chat(sim, narwhal_sim=fault("non_json")).body.startswith(b"{this")
    stalled = chat(sim, narwhal_sim=fault("stall", stall_s=2.0))
    assert stalled.head_delay_s == 1.5 + 2.0
    assert chat(sim, narwhal_sim=fault("no_done")).status == 200


@pytest.mark.parametrize(
    ("dialect", "key"), [("vllm", "token_ids"), ("sglang", "response_token_ids")]
)
def test_non_streaming_token_id_faults(dialect: str, key: str) -> None:
    body = json_body(
        chat(engine(dialect), return_token_ids=True, narwhal_sim=fault("malformed_token_ids"))
    )
    ids = body["choices"][0][key]
    assert ids[0] is True and len(ids) == 5


def test_non_streaming_field_faults() -> None:
    body = json_body(chat(engine(), narwhal_sim=fault("unsupported_field")))
    assert body["choices"][0]["message"]["audio"] == {"id": "x"}
    body = json_body(chat(engine(), narwhal_sim=fault("annotations")))
    assert body["choices"][0]["message"]["annotations"]
