"""Admission control, row by row, at exact virtual times."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest
import trio

from narwhal.admission.margin import SafetyMargin
from narwhal.config import AdmissionConfig, ServingConfig
from narwhal.errors import PredictiveRefusal
from narwhal.scheduling.health import Failure
from tests.conftest import MODEL, Fleet, StartFleet
from tests.support import until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def admission(**values: Any) -> AdmissionConfig:
    values.setdefault("mode", "open")
    return AdmissionConfig(**values)


async def post(
    fleet: Fleet,
    sim: dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    content: str = "hi",
    stream: bool = False,
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
    }
    if sim is not None:
        body["narwhal_sim"] = sim
    return await fleet.client.post("/v1/chat/completions", json=body, headers=headers or {})


async def background(
    nursery: trio.Nursery, fleet: Fleet, sim: dict[str, Any], results: list[httpx.Response]
) -> None:
    async def run() -> None:
        results.append(await post(fleet, sim))

    nursery.start_soon(run)
    await trio.lowlevel.checkpoint()  # let it arrive first


def assert_refusal(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code
    return error


STALL = {"output_tokens": 2, "fault": "stall", "stall_s": 10.0}


async def test_retention_full_is_a_429_with_retry_after_1(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(admission=admission(http_retention_limit=2))
    done: list[httpx.Response] = []
    for _ in range(2):
        await background(nursery, fleet, STALL, done)
    await trio.sleep(0.1)
    response = await post(fleet)
    error = assert_refusal(response, 429, "http_retention_full")
    assert error["type"] == "rate_limit_error"
    assert response.headers["retry-after"] == "1"
    counters = fleet.counters()
    assert counters["rejected"] == 1 and counters["unsized_offered"] == 1
    assert fleet.router.retention.in_use == 2
    with trio.fail_after(30):
        await until(lambda: len(done) == 2)
    fleet.assert_quiescent()
    assert fleet.router.retention.in_use == 0


async def test_queue_full_is_a_429_and_the_queue_counts_live_requests(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(
        [("sim-a", "vllm")], admission=admission(prefill_concurrency=1, queue_limit=1)
    )
    done: list[httpx.Response] = []
    await background(nursery, fleet, STALL, done)  # holds the only prefill slot
    await trio.sleep(0.1)
    await background(nursery, fleet, {"output_tokens": 2}, done)  # waits in the queue
    await trio.sleep(0.1)
    assert fleet.router.queue.statistics().depth == 1
    response = await post(fleet)
    assert_refusal(response, 429, "admission_queue_full")
    assert response.headers["retry-after"] == "1"
    counters = fleet.counters()
    assert counters["rejected"] == 1 and counters["unsized_offered"] == 0
    with trio.fail_after(60):
        await until(lambda: len(done) == 2)
    assert [r.status_code for r in done] == [200, 200], [r.text for r in done]
    fleet.assert_quiescent()


async def test_admission_wait_expires_at_exactly_admission_wait_s(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(
        [("sim-a", "vllm")], admission=admission(prefill_concurrency=1, admission_wait_s=2.0)
    )
    done: list[httpx.Response] = []
    await background(nursery, fleet, STALL, done)
    await trio.sleep(0.1)
    start = trio.current_time()
    response = await post(fleet)
    assert trio.current_time() - start == pytest.approx(2.0)
    assert_refusal(response, 504, "admission_wait_expired")
    assert response.headers["x-should-retry"] == "false"
    assert fleet.counters()["expired"] == 1
    assert fleet.router.queue.statistics().depth == 0


async def test_request_deadline_while_queued_is_request_deadline_expired(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(
        [("sim-a", "vllm")], admission=admission(prefill_concurrency=1, admission_wait_s=20)
    )
    done: list[httpx.Response] = []
    await background(nursery, fleet, STALL, done)
    await trio.sleep(0.1)
    start = trio.current_time()
    response = await post(fleet, headers={"x-narwhal-deadline-ms": "750"})
    assert trio.current_time() - start == pytest.approx(0.75)
    assert_refusal(response, 504, "request_deadline_expired")


async def test_queued_requests_are_placed_in_order_when_a_prefill_slot_frees(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=admission(prefill_concurrency=1))
    order: list[str] = []
    first_token: dict[str, float] = {}

    async def run(name: str, sim: dict[str, Any]) -> None:
        async with fleet.client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True, "narwhal_sim": sim}
        ) as response:
            first_token[name] = trio.current_time()
            order.append(name)
            await response.aread()

    start = trio.current_time()
    nursery.start_soon(run, "a", {"output_tokens": 3, "ttft_s": 1.0, "itl_s": 0.01})
    await trio.lowlevel.checkpoint()
    nursery.start_soon(run, "b", {"output_tokens": 3, "ttft_s": 0.5, "itl_s": 0.01})
    await trio.lowlevel.checkpoint()
    nursery.start_soon(run, "c", {"output_tokens": 3, "ttft_s": 0.5, "itl_s": 0.01})
    with trio.fail_after(10):
        await until(lambda: len(first_token) == 3)
    assert order == ["a", "b", "c"]
    # b is placed at a's first token (1.0 s) and takes its 0.5 s; c waits for b's in turn.
    assert first_token["a"] - start == pytest.approx(1.0, abs=0.02)
    step_b = first_token["b"] - first_token["a"]
    step_c = first_token["c"] - first_token["b"]
    assert 0.5 <= step_b < 0.55
    assert step_c == pytest.approx(step_b)


async def test_decode_headroom_is_checked_at_placement(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(
        [("sim-a", "vllm")], admission=admission(prefill_concurrency=4, decode_concurrency=1)
    )
    done: list[httpx.Response] = []
    long_decode = {"output_tokens": 20, "ttft_s": 0.1, "itl_s": 0.1}
    await background(nursery, fleet, long_decode, done)
    await trio.sleep(0.5)
    assert fleet.router.statistics().engines[0].decode == 1
    start = trio.current_time()
    response = await post(fleet, {"output_tokens": 1, "ttft_s": 0.1})
    assert response.status_code == 200
    # Placed only once the first request released its decode slot (~2.0 s after it began).
    assert trio.current_time() - start > 1.0


async def test_queued_requests_get_their_503_at_once_when_no_engine_is_eligible(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=admission(prefill_concurrency=1))
    done: list[httpx.Response] = []
    await background(nursery, fleet, STALL, done)
    await trio.sleep(0.1)
    queued: list[httpx.Response] = []
    for _ in range(3):
        await background(nursery, fleet, {"output_tokens": 1}, queued)
    await trio.sleep(0.1)
    assert fleet.router.queue.statistics().depth == 3
    engine = fleet.router.pool.engines[0]
    engine.poll_failed(trio.current_time(), Failure("unhealthy", "/health answered 503"))
    lost_at = trio.current_time()
    with trio.fail_after(1):
        await until(lambda: len(queued) == 3)
    assert trio.current_time() - lost_at < 0.01
    for response in queued:
        assert_refusal(response, 503, "backend_unavailable")
        assert response.headers["retry-after"] == "1"
    assert fleet.counters()["unavailable"] == 3


@pytest.mark.parametrize("state", ["standby", "fenced", "maintenance", "monitoring_degraded"])
async def test_a_router_that_is_not_active_refuses_with_its_reason(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, state: str
) -> None:
    fleet = await start_fleet()
    control = fleet.router.control
    if state in ("standby", "fenced"):
        control.set_lease(state)  # type: ignore[arg-type]
    elif state == "maintenance":
        control.set_maintenance("router_maintenance")
    else:
        control.set_degraded("router_monitoring_degraded")
    response = await post(fleet)
    error = assert_refusal(response, 503, f"router_{state}")
    assert error["type"] == "service_unavailable_error"
    assert response.headers["retry-after"] == "1"
    ready = await fleet.client.get("/ready")
    assert ready.status_code == 503 and ready.json()["state"] == state
    counters = fleet.counters()
    assert counters["unavailable"] == 1 and counters["unsized_offered"] == 1


async def test_prompt_alone_over_budget_is_refused_without_retry_after(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(admission=AdmissionConfig(mode="predictive", ttft_budget_s=0.1))
    response = await post(fleet, content="word " * 8000)  # ~10k tokens: ~0.4 s of prefill
    error = assert_refusal(response, 429, "prompt_exceeds_ttft_budget")
    assert "shorten the prompt or raise the target" in error["message"]
    assert "retry-after" not in response.headers
    assert response.headers["x-should-retry"] == "false"
    assert fleet.counters()["refused"] == 1
    assert fleet.completions_received() == 0
    # A prompt too long for the budget says nothing of the load: admission is not refusing.
    assert not fleet.router.margin.overloaded(trio.current_time() + 0.001, 0.1)


async def test_projection_over_budget_is_refused_with_the_overrun(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet(
        [("sim-a", "vllm")],
        admission=AdmissionConfig(mode="predictive", ttft_budget_s=1.0, prefill_concurrency=64),
    )
    done: list[httpx.Response] = []
    prompt = "word " * 4000  # ~5k tokens: ~0.16 s each on the H100 profile
    for _ in range(12):
        nursery.start_soon(partial(post, fleet, {"output_tokens": 1}, content=prompt))
    await trio.sleep(0.001)
    response = await post(fleet, content=prompt)
    error = assert_refusal(response, 429, "ttft_budget_exceeded")
    seconds = int(response.headers["retry-after"])
    millis = int(response.headers["retry-after-ms"])
    assert 1 <= seconds <= 120 and 1000 <= millis <= 120_000
    assert abs(millis / 1000 - seconds) <= 0.5 or seconds == 1
    assert "exceeds the budget" in error["message"]
    # The burst itself filled the budget: at least this one was refused.
    assert fleet.counters()["refused"] >= 1
    del done
    # Admission is refusing now: for the next budget's seconds the caution grows with the wait.
    # (Whether this instant counts depends on the burst's own refusals, a millisecond earlier:
    # a tick's refusals do not tighten that tick, test_margin says how.)
    now = trio.current_time()
    assert fleet.router.margin.overloaded(now + 0.001, 1.0)
    assert not fleet.router.margin.overloaded(now + 1.0, 1.0)
    # While it refuses, the cautions are read high (too few outcomes to call calm: the 99th).
    await trio.sleep(0.001)
    text = (await fleet.client.get("/metrics")).text
    assert "narwhal_admission_caution_quantile 0.99" in text


async def test_requests_of_one_instant_are_judged_with_their_company(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    # Three requests in one instant: the first, while no tick is expected, is decided at once,
    # alone; the two behind it are decided with the rest of their instant, as a tick's (the
    # margin reads them at its tick quantile while admission is not refusing). A request of a
    # later instant is alone again.
    fleet = await start_fleet(admission=AdmissionConfig(mode="shadow"))
    seen: list[bool] = []
    original = SafetyMargin.caution_s

    def spy(self: SafetyMargin, *args: Any, company: bool = False, **kwargs: Any) -> float:
        seen.append(company)
        return original(self, *args, company=company, **kwargs)

    monkeypatch.setattr(SafetyMargin, "caution_s", spy)
    async with trio.open_nursery() as tick:
        for _ in range(3):
            tick.start_soon(post, fleet)
    assert seen == [False, True, True]
    seen.clear()
    await trio.sleep(1.0)
    assert (await post(fleet)).status_code == 200
    assert seen == [False]


@pytest.mark.parametrize(
    ("overrun", "seconds", "millis"),
    [
        (0.001, "1", "1000"),
        (0.2, "1", "1000"),
        (1.2, "1", "1200"),
        (1.49, "1", "1490"),
        (1.5, "2", "1500"),
        (2.0001, "2", "2001"),
        (119.6, "120", "119600"),
        (500.0, "120", "120000"),
    ],
)
def test_retry_after_formulas(overrun: float, seconds: str, millis: str) -> None:
    refusal = PredictiveRefusal.over_budget(overrun)
    assert refusal.headers == {"Retry-After": seconds, "retry-after-ms": millis}
    assert refusal.code == "ttft_budget_exceeded" and refusal.status == 429


async def test_open_mode_never_refuses_predictively(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet(admission=admission(ttft_budget_s=0.01))
    response = await post(fleet, {"output_tokens": 1}, content="word " * 8000)
    assert response.status_code == 200


async def test_disconnect_while_queued_takes_no_slot(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=admission(prefill_concurrency=1))
    done: list[httpx.Response] = []
    await background(nursery, fleet, {"output_tokens": 2, "ttft_s": 1.0}, done)
    await trio.sleep(0.1)
    with trio.move_on_after(0.3):
        await post(fleet)
    await trio.sleep(0.001)
    assert fleet.router.queue.statistics().depth == 0
    assert fleet.counters()["cancelled"] == 1
    with trio.fail_after(10):
        await until(lambda: bool(done))
    assert fleet.completions_received() == 1, "the cancelled request never reached an engine"
    fleet.assert_quiescent()


async def test_metrics_show_queue_retention_and_occupancy(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    fleet = await start_fleet([("sim-a", "vllm")], admission=admission(prefill_concurrency=1))
    done: list[httpx.Response] = []
    await background(nursery, fleet, STALL, done)
    await background(nursery, fleet, STALL, done)
    await trio.sleep(0.1)
    text = (await fleet.client.get("/metrics")).text
    assert "narwhal_queue_depth 1.0" in text
    assert "narwhal_http_retention_in_use 2.0" in text
    assert 'narwhal_engine_occupancy{engine="sim-a",phase="prefill"} 1.0' in text
    assert "narwhal_queue_wait_seconds_bucket" in text
    assert "narwhal_predicted_ttft_error_ratio_bucket" in text
    assert "narwhal_admission_safety_factor 2.0" in text  # the prior: nothing learned yet
    # Admission is not refusing: the cautions are read at the median.
    assert "narwhal_admission_caution_quantile 0.5" in text
    assert "narwhal_admission_recent_misses 0.0" in text
    assert "narwhal_admission_tick_share 0.0" in text  # no instant of several has passed


def test_serving_config_keeps_its_defaults() -> None:
    assert ServingConfig().tokenizer == ""
