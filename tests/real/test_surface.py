"""The rest of what a vLLM user relies on, through Narwhal: models, health, request ids, a client
that goes away (vLLM must stop generating), and the books afterwards."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from narwhal.admission.accounting import TERMINAL_CLASSES
from tests.real.contract import CHAT, COMPLETIONS, chat, completion, normalise, send
from tests.real.servers import MAX_MODEL_LEN, MODEL, metric

pytestmark = [pytest.mark.real_engine, pytest.mark.realtime]


def _model_object(listing: dict[str, Any]) -> dict[str, Any]:
    (only,) = [entry for entry in listing["data"] if entry["id"] == MODEL]
    return normalise_model(only)


def normalise_model(entry: dict[str, Any]) -> dict[str, Any]:
    """A model object without what changes at every call (``created``, the permission's id)."""
    normalised = {**entry, "created": 0}
    if isinstance(entry.get("permission"), list):
        normalised["permission"] = normalise(entry["permission"])
    return normalised


def test_models_are_the_engines_own(direct: httpx.Client, routed: httpx.Client) -> None:
    expected = direct.get("/v1/models").json()
    actual = routed.get("/v1/models").json()
    assert actual["object"] == "list"
    assert [normalise_model(entry) for entry in actual["data"]] == [
        normalise_model(entry) for entry in expected["data"]
    ]
    assert _model_object(actual)["max_model_len"] == MAX_MODEL_LEN


def test_one_model_by_id(direct: httpx.Client, routed: httpx.Client) -> None:
    """vLLM has no ``/v1/models/{id}``; Narwhal serves OpenAI's, with vLLM's object."""
    expected = _model_object(direct.get("/v1/models").json())
    answer = routed.get(f"/v1/models/{MODEL}")
    assert answer.status_code == 200
    assert normalise_model(answer.json()) == expected
    missing = routed.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_health(direct: httpx.Client, routed: httpx.Client) -> None:
    assert direct.get("/health").status_code == 200
    assert routed.get("/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_request_id_is_the_response_id(stream: bool, routed: httpx.Client) -> None:
    """vLLM makes the response id from X-Request-Id; Narwhal forwards it and answers with it."""
    given = f"contract-{int(stream)}-{time.monotonic_ns()}"
    case = chat("id", stream=True) if stream else chat("id")
    answer = send(routed, case, headers={"x-request-id": given})
    assert answer.status == 200
    assert answer.headers["x-request-id"] == given
    first = answer.body[0] if stream else answer.body
    assert first["id"] == f"chatcmpl-{given}"


def test_a_request_id_is_made_when_none_is_sent(routed: httpx.Client) -> None:
    answer = send(routed, completion("made"))
    assert answer.status == 200
    made = answer.headers["x-request-id"]
    assert made and answer.body["id"] == f"cmpl-{made}"


def _vllm_metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=5).text


def _poll(condition: Any, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # polling, with the deadline above


def _settled(url: str) -> tuple[float, float, float]:
    """vLLM's generated tokens, ``length`` finishes and running requests, once they hold
    still for a second (vLLM publishes its statistics a little after the fact)."""

    def read() -> tuple[float, float, float]:
        text = _vllm_metrics(url)
        return (
            metric(text, "vllm:generation_tokens_total"),
            metric(text, "vllm:request_success_total", finished_reason="length"),
            metric(text, "vllm:num_requests_running"),
        )

    deadline = time.monotonic() + 20
    last = read()
    while True:
        time.sleep(1.0)  # the quiet period, with the deadline below
        now = read()
        if now == last and now[2] == 0:
            return now
        assert time.monotonic() < deadline, f"vLLM's statistics never settled: {now}"
        last = now


def test_a_client_gone_stops_vllm(vllm_url: str, narwhal_url: str) -> None:
    """A client that leaves mid-stream: vLLM stops generating instead of running to the end.

    vLLM does not count an aborted request as finished (not even as ``abort``), so what shows it
    is that, once vLLM's statistics settle, far fewer tokens were generated than asked and no
    request finished for ``length`` (the whole run would take vLLM about two seconds here).
    """
    generated, ran_out, _ = _settled(vllm_url)
    router_before = httpx.get(f"{narwhal_url}/metrics").text
    asked = MAX_MODEL_LEN - 64
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": asked,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=narwhal_url, timeout=30) as client,
        client.stream("POST", COMPLETIONS, json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):  # a few tokens in, then the client goes
            next(lines)
    # A request that went on would keep vLLM's counters moving until it finished for length.
    after_generated, after_ran_out, _ = _settled(vllm_url)
    assert after_ran_out == ran_out, "the request of a client gone ran to max_tokens"
    spent = after_generated - generated
    assert 0 < spent < asked / 2, f"vLLM generated {spent:g} of {asked} tokens for a client gone"
    _poll(
        lambda: (
            metric(httpx.get(f"{narwhal_url}/metrics").text, "narwhal_cancelled_total")
            == metric(router_before, "narwhal_cancelled_total") + 1
        ),
        10,
        "the router did not count the request cancelled",
    )


def test_books_balance_afterwards(routed: httpx.Client) -> None:
    """After everything the tier sent (run last in its session): nothing in flight, every
    offered request in exactly one terminal class, the router ready."""
    _poll(
        lambda: routed.get("/ready").json()["counters"]["in_flight"] == 0,
        10,
        "requests still in flight at the router",
    )
    ready = routed.get("/ready")
    assert ready.status_code == 200, ready.text
    counters = ready.json()["counters"]
    assert counters["offered"] > 0
    assert counters["offered"] == sum(counters[name] for name in TERMINAL_CLASSES)
    text = routed.get("/metrics").text
    assert metric(text, "narwhal_offered_total") == counters["offered"]
    assert metric(text, "narwhal_in_flight") == 0
    for name in ("prefill", "decode"):
        assert metric(text, "narwhal_engine_occupancy", phase=name) == 0
    assert routed.post(CHAT, json=chat("after").body).status_code == 200
