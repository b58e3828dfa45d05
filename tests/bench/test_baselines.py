"""The baselines predictive admission must beat, run in the same benchmark: a fixed router
queue cap (``queue-cap``) and vLLM's engine-side admission (``engine-cap``)."""

from __future__ import annotations

import math

import pytest

from narwhal.bench.admission import AdmissionSettings, default_modes, queue_cap_for
from narwhal.bench.goodput import ENGINE_BUSY, Capacity, Outcome
from narwhal.bench.inprocess import engine_cap_supported
from narwhal.bench.replay import (
    MODE_DESCRIPTIONS,
    ReplayJob,
    VirtualSetup,
    default_router,
    run_replay,
)
from narwhal.scheduling.profiles import get_profile

SETUP = VirtualSetup(default_router(), duration_s=20.0)
# 10 minutes of trace (about 1,100 requests) at five times what two h100 engines complete of
# it: more than their batches and a queue hold.
BUSY = VirtualSetup(default_router(), duration_s=600.0)
OVERLOAD_RPS = 38.4 * 5


def test_each_mode_configures_the_router_as_a_user_would() -> None:
    queue = SETUP.config("queue-cap", 2.0, queue_cap=77).admission
    assert (queue.mode, queue.queue_limit, queue.ttft_budget_s) == ("open", 77, 2.0)
    engine = SETUP.config("engine-cap", 1.5).admission
    assert engine.mode == "open" and engine.ttft_budget_s == 1.5
    # The router only balances: the engines hold the waiting requests and refuse work.
    assert min(engine.prefill_concurrency, engine.decode_concurrency, engine.queue_limit) >= 4096
    assert SETUP.config("predictive", 2.0).admission.mode == "predictive"
    with pytest.raises(ValueError, match="queue cap"):
        SETUP.config("queue-cap", 2.0)
    assert set(MODE_DESCRIPTIONS) == {"predictive", "open", "queue-cap", "engine-cap"}


def test_the_caps_a_user_would_choose() -> None:
    # The router's queue holds what the pool completes in one budget.
    assert queue_cap_for(Capacity(rps=38.4, engine_s_per_s=1.0), 2.0) == 77
    # vLLM's cap: the budget times the prefill throughput the engine's profile states.
    per_token_ms = get_profile("h100-llama3-8b").prefill_per_token_ms
    assert SETUP.engine_caps(2.0) == (round(2000 / per_token_ms),) * 2
    mixed = VirtualSetup(default_router(types=("h100", "a100")))
    h100, a100 = mixed.engine_caps(2.0)
    assert h100 > a100  # the slower engine holds less
    expected = ("predictive", "open", "queue-cap", "engine-cap")
    assert engine_cap_supported() and default_modes() == expected
    assert AdmissionSettings(SETUP).modes == expected


def test_the_engine_busy_code_is_not_admitted() -> None:
    busy = Outcome(0, 0.0, 100, 10, 502, ENGINE_BUSY, None, None)
    assert not busy.admitted and not busy.in_budget(2.0)
    assert Outcome(0, 0.0, 100, 10, 502, "engine_error", None, None).admitted


def test_queue_cap_rejects_beyond_its_queue_under_overload() -> None:
    cap = math.ceil(38.4 * 2.0)
    result = run_replay(ReplayJob(BUSY, "queue-cap", OVERLOAD_RPS, 2.0, queue_cap=cap))
    labels = [outcome.code for outcome in result.outcomes]
    assert labels.count("admission_queue_full") > 0
    assert result.books["rejected"] == labels.count("admission_queue_full")
    assert all(outcome.projected_ttft_s is None for outcome in result.outcomes)  # open mode


def test_engine_cap_lets_the_engines_refuse_under_overload() -> None:
    caps = (20_000, 20_000)  # a small backlog, so that three times capacity overflows it
    job = ReplayJob(BUSY, "engine-cap", OVERLOAD_RPS, 2.0, max_num_queued_tokens=caps)
    result = run_replay(job)
    busy = [outcome for outcome in result.outcomes if outcome.code == ENGINE_BUSY]
    assert busy and not any(outcome.admitted for outcome in busy)
    # Each was refused by both engines (the router tries another once): the engines' books.
    assert result.books["engine_rejections"] >= len(busy)
    assert result.books["refused"] == 0 and result.books["rejected"] == 0  # not the router
    served = [outcome for outcome in result.outcomes if outcome.completed]
    assert len(served) > len(busy) / 10
