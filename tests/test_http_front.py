"""The HTTP front: validation rows, envelopes, limits, routes, /ready and /metrics."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import ServingConfig
from tests.conftest import MODEL, StartFleet


def assert_envelope(response: httpx.Response, status: int, code: str, param: Any) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_request", None),
        (b"[]", 400, "invalid_request", None),
        (
            json.dumps({"model": MODEL, "messages": "hi"}).encode(),
            400,
            "invalid_request",
            "messages",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(),
            400,
            "invalid_request",
            "messages[0].content",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [],
                    "stream": True,
                    "stream_options": {"include_usage": 1},
                }
            ).encode(),
            400,
            "invalid_request",
            "messages",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
            400,
            "invalid_request",
            "model",
        ),
        (
            json.dumps(
                {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}
            ).encode(),
            404,
            "model_not_found",
            "model",
        ),
        (
            json.dumps(
                {"model": MODEL, "n": 2, "messages": [{"role": "user", "content": "x"}]}
            ).encode(),
            400,
            "invalid_sampling_width",
            "n",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "audio": {"voice": "x"},
                    "messages": [{"role": "user", "content": "x"}],
                }
            ).encode(),
            400,
            "unsupported_option",
            "audio",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "modalities": ["text", "audio"],
                    "messages": [{"role": "user", "content": "x"}],
                }
            ).encode(),
            400,
            "unsupported_option",
            "modalities",
        ),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "tools": [{"type": "custom", "custom": {"name": "x"}}],
                    "messages": [{"role": "user", "content": "x"}],
                }
            ).encode(),
            400,
            "unsupported_option",
            "tools",
        ),
    ],
)
async def test_validation_rows(
    start_fleet: StartFleet,
    autojump_clock: trio.testing.MockClock,
    body: bytes,
    status: int,
    code: str,
    param: Any,
) -> None:
    fleet = await start_fleet()
    response = await fleet.client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    error = assert_envelope(response, status, code, param)
    assert error["type"] == "invalid_request_error"
    if code == "invalid_sampling_width":
        assert "Invalid sampling width" in error["message"]
    counters = fleet.counters()
    assert counters["offered"] == 1 and counters["invalid_requests"] == 1
    assert counters["unsized_offered"] == 1
    assert fleet.completions_received() == 0
    fleet.assert_quiescent()


async def test_best_of_on_completions(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    assert_envelope(await fleet.completion(best_of=3), 400, "invalid_sampling_width", "best_of")


async def test_unsupported_options_pass_when_streaming(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    response = await fleet.chat(stream=True, modalities=["text", "audio"])
    assert response.status_code == 200


async def test_unknown_fields_pass_to_the_engine_untouched(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")])
    extra = {"top_k": 5, "seed": 7, "user": "u", "metadata": {"a": [1, 2]}}
    assert (await fleet.chat(**extra)).status_code == 200
    sent = fleet.sims["sim-a"].requests[-1]
    for key, value in extra.items():
        assert sent[key] == value


async def test_body_over_the_limit_by_content_length(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(serving=ServingConfig(model=MODEL, max_request_bytes=1000))
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]})
    response = await fleet.client.post(
        "/v1/chat/completions", content=big, headers={"content-type": "application/json"}
    )
    assert_envelope(response, 413, "request_too_large", None)
    assert fleet.counters()["invalid_requests"] == 1


async def test_body_over_the_limit_while_streaming_in(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(serving=ServingConfig(model=MODEL, max_request_bytes=100_000))

    async def body() -> Any:
        for _ in range(10):
            yield b"x" * 65536  # no Content-Length: the running count decides

    response = await fleet.client.post("/v1/chat/completions", content=body())
    assert_envelope(response, 413, "request_too_large", None)


async def test_unknown_route_and_wrong_method_answer_with_envelopes(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    assert_envelope(await fleet.client.get("/v2/nothing"), 404, "not_found", None)
    assert_envelope(await fleet.client.get("/v1/chat/completions"), 405, "method_not_allowed", None)
    assert fleet.counters()["offered"] == 0


async def test_a_405_names_the_allowed_methods(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    wrong = await fleet.client.get("/v1/chat/completions")
    assert_envelope(wrong, 405, "method_not_allowed", None)
    assert wrong.headers["allow"] == "POST"
    wrong = await fleet.client.post("/ready")
    assert_envelope(wrong, 405, "method_not_allowed", None)
    assert wrong.headers["allow"] == "GET, HEAD"
    assert "allow" not in (await fleet.client.get("/v2/nothing")).headers


@pytest.mark.parametrize("header", ["x-narwhal-deadline-ms", "x-envoy-expected-rq-timeout-ms"])
@pytest.mark.parametrize("value", ["0", "-5", "1.5", "soon", ""])
async def test_malformed_deadline_header_is_a_400(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, header: str, value: str
) -> None:
    fleet = await start_fleet()
    response = await fleet.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers={header: value},
    )
    assert_envelope(response, 400, "invalid_request", header)


async def test_models_health_ready_metrics(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-a", "vllm"), ("sim-b", "sglang")])
    models = (await fleet.client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert (await fleet.client.get("/health")).status_code == 200
    await fleet.chat()
    ready = await fleet.client.get("/ready")
    assert ready.status_code == 200
    body = ready.json()
    assert body["state"] == "active"
    assert set(body["counters"]) >= {
        "offered",
        "unsized_offered",
        "completed",
        "rejected",
        "refused",
        "invalid_requests",
        "expired",
        "unavailable",
        "failed",
        "cancelled",
        "in_flight",
    }
    engines = {engine["name"]: engine for engine in body["engines"]}
    assert engines["sim-a"]["token_accounting"] == "token_ids"
    assert engines["sim-b"]["token_accounting"] == "unavailable"
    for engine in engines.values():
        assert set(engine) == {
            "name",
            "eligible",
            "reason",
            "token_accounting",
            "wave",
            "occupancy",
            "profiled",
            "drift",
        }
        assert engine["occupancy"] == {"prefill": 0, "decode": 0}
    text = (await fleet.client.get("/metrics")).text
    for name in (
        "narwhal_offered_total 1.0",
        'narwhal_completed_total{reason=""} 1.0',
        "narwhal_in_flight 0.0",
        'narwhal_engine_occupancy{engine="sim-a",phase="prefill"}',
        "narwhal_ttft_seconds_bucket",
        "narwhal_inter_token_gap_seconds_bucket",
    ):
        assert name in text


async def test_ready_is_503_until_an_engine_has_joined(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(wait_ready=False)
    response = await fleet.client.get("/ready")
    assert response.status_code == 503
    assert response.json()["engines"][0]["eligible"] is False
    with trio.fail_after(10):
        await fleet.router.wait_ready()
    assert (await fleet.client.get("/ready")).status_code == 200


async def test_no_eligible_engine_is_a_503(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(wait_ready=False)
    response = await fleet.chat()
    error = assert_envelope(response, 503, "backend_unavailable", None)
    assert error["type"] == "service_unavailable_error"
    assert response.headers["retry-after"] == "1"
    assert fleet.counters()["unavailable"] == 1


async def test_token_ids_requested_without_a_provider_is_a_400(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet([("sim-s", "sglang")])
    response = await fleet.chat(return_token_ids=True)
    assert_envelope(response, 400, "unsupported_option", "return_token_ids")


async def test_size_limit_comes_before_header_validation(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(serving=ServingConfig(model=MODEL, max_request_bytes=100))
    response = await fleet.client.post(
        "/v1/chat/completions",
        content=b"x" * 500,
        headers={"x-narwhal-deadline-ms": "soon"},
    )
    assert_envelope(response, 413, "request_too_large", None)


async def test_a_router_bug_is_a_500_counted_as_failed(
    start_fleet: StartFleet,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = await start_fleet()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr("narwhal.web.completions.parse_request", broken)
    response = await fleet.chat()
    error = assert_envelope(response, 500, "internal_error", None)
    assert error["type"] == "server_error"
    assert fleet.counters()["failed"] == 1 and fleet.counters()["cancelled"] == 0
