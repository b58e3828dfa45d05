"""The prefill forecast: the pipeline, its replanning, and what it learns."""

from __future__ import annotations

import random
import statistics

import pytest

from narwhal.scheduling.forecast import PrefillForecast
from narwhal.scheduling.profiles import PROFILES
from narwhal.sim import Batcher

H100 = PROFILES["h100-llama3-8b"]


def test_an_idle_engine_predicts_the_profiled_prefill() -> None:
    forecast = PrefillForecast(H100)
    key, at = forecast.place(1024, now=10.0)
    assert at - 10.0 == pytest.approx(H100.prefill_ms(1024) / 1000)
    assert forecast.in_prefill == 1 and key in forecast.pending


def test_prompts_queue_behind_each_other_and_joiners_skip_the_step_cost() -> None:
    forecast = PrefillForecast(H100)
    _, first = forecast.place(1024, now=0.0)
    _, second = forecast.place(1024, now=0.0)
    joined = H100.prefill_chunk_ms(0, 1024) / 1000
    assert second == pytest.approx(first + joined)


def test_a_first_token_replans_the_pipeline_from_what_is_pending() -> None:
    forecast = PrefillForecast(H100)
    key_a, _ = forecast.place(1024, now=0.0)
    forecast.place(1024, now=0.0)
    forecast.first_token(key_a, placed_at=0.0, predicted=0.028, now=0.5, tokens=1024)
    # b joined a's step, so a's first token was expected with b's; a came late, and b, in the
    # same step, is expected now.
    assert forecast.free_at == pytest.approx(0.5)
    assert forecast.decoding == 1 and forecast.decode_context == 1024


def test_a_prompt_that_joins_a_step_delays_the_prompts_already_in_it() -> None:
    forecast = PrefillForecast(H100)
    key_a, first = forecast.place(1024, now=0.0)
    key_b, second = forecast.place(1024, now=0.0)
    # Both come out of the one step: a is expected when b is.
    assert forecast.expected_first_token(key_a) == pytest.approx(second)
    assert forecast.expected_first_token(key_b) == pytest.approx(second)
    assert second - first == pytest.approx(H100.prefill_chunk_ms(0, 1024) / 1000)


def test_the_share_of_a_step_s_room_that_later_prompts_take_is_learned() -> None:
    forecast = PrefillForecast(H100, prefill_limit=4)
    key, first = forecast.place(1024, now=0.0)
    room = (8192 - 1024) * H100.prefill_per_token_ms / 1000  # idle: the whole budget is free
    assert forecast.room_s(forecast.pipeline) == pytest.approx(room)
    forecast.place(2048, now=0.0)  # joins its step
    joined = H100.prefill_chunk_ms(0, 2048) / 1000
    forecast.first_token(key, placed_at=0.0, predicted=first + joined, now=1.0, tokens=1024)
    assert forecast.fill == pytest.approx(0.05 * joined / room)
    # A prompt nobody joins teaches that its room stayed empty.
    forecast = PrefillForecast(H100, prefill_limit=4, fill=0.5)
    key, first = forecast.place(1024, now=0.0)
    forecast.first_token(key, placed_at=0.0, predicted=first, now=1.0, tokens=1024)
    assert forecast.fill == pytest.approx(0.5 * 0.95)


def test_a_step_full_of_prompts_has_no_room_to_expect_joiners_in() -> None:
    forecast = PrefillForecast(H100, prefill_limit=2, fill=1.0)
    forecast.place(1024, now=0.0)
    forecast.place(1024, now=0.0)  # the step holds prefill_limit prompts
    assert forecast.room_s(forecast.pipeline) == 0.0
    assert forecast.joining_s(forecast.pipeline) == 0.0


def test_a_prompt_that_spills_past_a_step_delays_it_by_its_share_only() -> None:
    forecast = PrefillForecast(H100, decoding=10, decode_context=10_000)
    key_a, first = forecast.place(8000, now=0.0)  # 182 tokens of the step's budget are left
    forecast.place(8000, now=0.0)
    share = H100.prefill_per_token_ms * (8192 - 10 - 8000) / 1000
    assert forecast.expected_first_token(key_a) == pytest.approx(first + share)


def test_a_prompt_placed_after_the_last_step_started_delays_nobody() -> None:
    forecast = PrefillForecast(H100, decoding=10, decode_context=10_000)
    key_a, first = forecast.place(8000, now=0.0)
    forecast.place(1000, now=0.01)  # a's step is running: it cannot join it
    assert forecast.expected_first_token(key_a) == pytest.approx(first)


def test_abandoning_a_prefill_gives_its_time_back() -> None:
    forecast = PrefillForecast(H100)
    _, _ = forecast.place(4096, now=0.0)
    key, _ = forecast.place(4096, now=0.0)
    before = forecast.free_at
    forecast.abandon_prefill(key, now=0.0)
    assert forecast.free_at < before and forecast.in_prefill == 1


def test_decoding_sequences_slow_prefill_down() -> None:
    idle = PrefillForecast(H100)
    busy = PrefillForecast(H100, decoding=128, decode_context=128 * 1500)
    assert busy.predict(1024, 0.0) > idle.predict(1024, 0.0)


def test_learning_separates_latency_from_compute() -> None:
    forecast = PrefillForecast(H100)
    now = 0.0
    # The engine is twice as slow as its profile and adds 20 ms that do not queue.
    for tokens in [256, 4096, 1024, 8000, 512, 2048] * 40:
        key, predicted = forecast.place(tokens, now)
        truth = 0.020 + 2 * H100.prefill_ms(tokens) / 1000
        forecast.first_token(key, placed_at=now, predicted=predicted, now=now + truth, tokens=0)
        forecast.finish_decode(0)
        now += 10
    assert forecast.scale == pytest.approx(2.0, rel=0.05)
    assert forecast.latency_s == pytest.approx(0.020, abs=0.003)


def test_a_request_placed_behind_others_teaches_the_scale_at_half_the_rate() -> None:
    forecast = PrefillForecast(H100)
    forecast.place(1024, now=0.0)
    key, predicted = forecast.place(1024, now=0.0)  # waited behind the first
    forecast.first_token(key, placed_at=0.0, predicted=predicted, now=10.0, tokens=0)
    # 150 times late, clipped to a quarter, at a tenth: its time was partly the first's.
    assert forecast.scale == pytest.approx(1.025) and forecast.latency_s == 0.0


def test_a_busy_engine_that_turned_twice_as_slow_is_learned_while_it_is_busy() -> None:
    # No prompt ever finds the pipeline idle (a burst): only the busy ones can teach. Each
    # first token comes twice as long after placement as the profile says.
    forecast = PrefillForecast(H100)
    scales = []
    for n in range(30):
        now = 10.0 * n
        scale = forecast.scale
        ahead, _ = forecast.place(2048, now=now)
        key, predicted = forecast.place(1024, now=now)
        forecast.abandon_prefill(ahead, now)  # the one ahead teaches nothing here
        observed = now + 2 * (predicted - now) / scale
        forecast.first_token(key, placed_at=now, predicted=predicted, now=observed, tokens=0)
        forecast.finish_decode(0)
        scales.append(forecast.scale)
    assert scales[0] == pytest.approx(1.025)
    assert scales == sorted(scales)
    assert scales[9] > 1.25 and 1.8 < scales[-1] < 2.0  # towards the truth, never past it


def test_one_outlier_moves_the_model_by_at_most_a_quarter_of_the_error_bound() -> None:
    forecast = PrefillForecast(H100)
    key, predicted = forecast.place(1024, now=0.0)
    before = predicted
    forecast.first_token(key, placed_at=0.0, predicted=predicted, now=10.0, tokens=0)
    forecast.finish_decode(0)
    _, after = forecast.place(1024, now=100.0)
    assert after - 100.0 <= 1.25 * before + 1e-9


def test_a_prompt_on_an_idle_pipeline_waits_for_the_running_decode_step() -> None:
    forecast = PrefillForecast(H100, decoding=100, decode_context=100_000)
    step = H100.decode_step_ms(100, 100_000) / 1000
    forecast.saw_step(1.0)  # output arrived: a step ended at 1.0, the next runs until 1.0 + step
    _, at = forecast.place(1000, now=1.004)
    own = (H100.prefill_chunk_ms(0, 1000) / 1000) + step
    assert at == pytest.approx(1.0 + step + own)


def test_a_late_first_token_makes_what_follows_as_late() -> None:
    forecast = PrefillForecast(H100, decoding=10, decode_context=10_000)
    key_a, first = forecast.place(8000, now=0.0)  # one whole step of its own
    _, second = forecast.place(8000, now=0.0)  # its first 182 tokens share a's step
    share = H100.prefill_per_token_ms * (8192 - 10 - 8000) / 1000
    forecast.first_token(key_a, placed_at=0.0, predicted=first, now=first + 0.1, tokens=8000)
    # a came 0.1 s after its prediction at placement, 0.1 s less b's share of its step after
    # the revised one: b is as late as that.
    assert forecast.free_at == pytest.approx(second + 0.1 - share)


def test_tpot_counts_every_sequence_that_will_decode() -> None:
    forecast = PrefillForecast(H100, decoding=10, decode_context=10_000)
    forecast.place(1000, now=0.0)
    assert forecast.tpot_with(1000) == pytest.approx(H100.decode_step_ms(12, 12_000) / 1000)


def test_a_prompt_joined_in_its_step_teaches_only_as_a_busy_one() -> None:
    forecast = PrefillForecast(H100)
    key, predicted = forecast.place(1024, now=0.0)  # alone on an idle pipeline: a teacher
    forecast.place(4096, now=0.0)  # ...until this one shares its step and slows it down
    forecast.first_token(key, placed_at=0.0, predicted=predicted, now=predicted * 3, tokens=0)
    # Not the latency, and the scale by a tenth of a quarter at most (a busy engine's
    # speed is learned from such prompts too, clipped towards the typical case).
    assert forecast.scale == pytest.approx(1.025) and forecast.latency_s == 0.0


def test_a_step_holds_at_most_prefill_limit_prompts() -> None:
    shared = PrefillForecast(H100, prefill_limit=8)
    limited = PrefillForecast(H100, prefill_limit=2)
    for forecast in (shared, limited):
        for _ in range(2):
            forecast.place(500, now=0.0)
    _, joined = shared.place(500, now=0.0)
    _, next_step = limited.place(500, now=0.0)
    assert next_step == pytest.approx(joined + H100.prefill_base_ms / 1000)


def _decoding(forecast: PrefillForecast, batch: int, context: int = 1000) -> None:
    forecast.decoding = batch
    forecast.decode_context = batch * context


def _gap(forecast: PrefillForecast, ratio: float, tokens: int = 16) -> None:
    """One stream's gap of ``tokens`` tokens at ``ratio`` times the profiled decode step."""
    step = forecast.decode_step_s(forecast.decoding, forecast.decode_context, scaled=False)
    forecast.observe_gap(ratio * step * tokens, tokens)


def test_the_decode_scale_remembers_seconds_of_steps_not_a_count_of_gaps() -> None:
    # 256 streams each tell of the same 16 steps: one round of their gaps is 16 steps of the
    # engine's time, and moves the scale as little as 16 steps' worth, not 256 gaps' worth.
    large = PrefillForecast(H100)
    _decoding(large, 256)
    step = large.decode_step_s(256, large.decode_context, scaled=False)
    for _ in range(256):
        _gap(large, 2.0)
    # Each gap weighs gap / (256 x memory): together, about 16 steps over the memory.
    moved = large.decode_scale - 1.0
    assert 0.5 * (16 * 2 * step / 2.0) < moved < 16 * 2 * step / 2.0
    assert moved < 0.4  # 2 % of the way per gap, as it was, moved it 99 % of the way
    # One slow step (its long prompt's chunk) seen by every stream once moves it less still.
    spiky = PrefillForecast(H100)
    _decoding(spiky, 256)
    for _ in range(256):
        _gap(spiky, 2.0, tokens=1)
    assert spiky.decode_scale - 1.0 < moved / 8


def test_a_lone_stream_teaches_the_decode_scale_within_its_memory() -> None:
    # One stream: each gap is the engine's whole time. Two seconds of gaps at twice the
    # profiled step move the scale more than half of the way.
    forecast = PrefillForecast(H100)
    _decoding(forecast, 1)
    step = forecast.decode_step_s(1, forecast.decode_context, scaled=False)
    tokens = 16
    for _ in range(round(2.0 / (2 * step * tokens))):
        _gap(forecast, 2.0, tokens)
    assert 1.5 < forecast.decode_scale < 2.0


def test_an_overdue_first_token_makes_the_work_behind_it_at_least_as_late() -> None:
    forecast = PrefillForecast(H100)
    head, _ = forecast.place(8000, now=0.0)
    forecast.place(8000, now=0.0)  # most of a step of its own, after the head's
    first = forecast.expected_first_token(head)
    assert first is not None
    on_time = forecast.predict(1024, now=first)
    step = H100.prefill_base_ms / 1000  # nothing decodes: a step's fixed cost
    # A first token comes at the end of a step: within one step of its time it is not late.
    assert forecast.overdue_s(first + step) == pytest.approx(0.0)
    # None 0.1 s after it was due: its compute is not done, and everything placed after it
    # (and anything placed now) runs at least that late, less the step.
    assert forecast.overdue_s(first + 0.1) == pytest.approx(0.1 - step)
    assert forecast.predict(1024, now=first + 0.1) == pytest.approx(on_time + 0.1 - step)


def test_the_step_a_first_token_may_wait_for_is_the_running_batch_s() -> None:
    forecast = PrefillForecast(H100, decoding=64, decode_context=64 * 2000)
    head, _ = forecast.place(2048, now=0.0)
    first = forecast.expected_first_token(head)
    assert first is not None
    step = forecast.decode_step_s(64, 64 * 2000)
    assert forecast.overdue_s(first + step) == pytest.approx(0.0)
    assert forecast.overdue_s(first + step + 0.1) == pytest.approx(0.1)


def test_a_placement_behind_an_overdue_head_is_predicted_late_and_cannot_teach() -> None:
    forecast = PrefillForecast(H100)
    head, first = forecast.place(4096, now=0.0)
    step = H100.prefill_base_ms / 1000
    key, at = forecast.place(1024, now=first + 0.5)
    # The head's compute runs at least until a step before now: the newcomer waits for it.
    assert at >= first + 0.5 - step + forecast.compute_s(1024)
    assert forecast.expected_first_token(head) == pytest.approx(first + 0.5 - step)
    assert forecast.pending[key].teaches is None
    # The head's first token then comes on the lateness it was already charged with: what
    # follows it moves by the step only.
    free_at = forecast.free_at
    forecast.first_token(head, placed_at=0.0, predicted=first, now=first + 0.5, tokens=4096)
    assert forecast.free_at == pytest.approx(free_at + step)


def serve_bursts(
    forecast: PrefillForecast, bursts: list[tuple[float, list[tuple[int, int]]]]
) -> list[float]:
    """Serve ``bursts`` (an instant, and its ``(prompt, output)`` requests, all arriving then) on
    the simulator's batcher running the forecast's own profile, telling the forecast what the
    router would (placements, first tokens, output, ends) with the prediction the router
    judges the engine by; return each first token's observed over that prediction."""
    batcher = Batcher(forecast.profile)
    arrivals = [(at, prompt, output) for at, burst in bursts for prompt, output in burst]
    placed: dict[int, tuple[int, float, float]] = {}  # by sequence id: key, placed at, predicted
    context: dict[int, int] = {}
    ratios = []
    now, next_arrival = 0.0, 0

    def arrive_until(until: float) -> None:
        nonlocal next_arrival
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= until:
            at, prompt, output = arrivals[next_arrival]
            seq = batcher.submit(prompt, output)
            placed[seq.id] = (*forecast.place(prompt, at), at)
            next_arrival += 1

    while next_arrival < len(arrivals) or not batcher.idle:
        step = batcher.next_step()
        if step is None:  # idle: the next burst starts the next step
            now = max(now, arrivals[next_arrival][0])
            arrive_until(now)
            continue
        end = now + step.cost_ms / 1000
        arrive_until(end - 1e-9)  # those that arrive while it runs wait for the next step
        now = end
        for seq in batcher.complete(step):
            if seq.emitted == 1:
                key, predicted, at = placed.pop(seq.id)
                predicted += forecast.joined_s(key)
                forecast.saw_step(now)
                forecast.first_token(
                    key, placed_at=at, predicted=predicted, now=now, tokens=seq.prompt_tokens
                )
                ratios.append((now - at) / (predicted - at))
                context[seq.id] = seq.prompt_tokens
            else:
                forecast.generated(1)
                context[seq.id] += 1
            if seq.state == "finished":
                forecast.finish_decode(context.pop(seq.id))
    return ratios


def test_an_engine_that_runs_as_its_profile_teaches_a_scale_of_one_through_bursts() -> None:
    # The simulator's batcher on the router's own profile: the forecast's model of steps,
    # chunks and prompts sharing steps is what the engine does, so nothing it learns may move
    # it (by much: the decode batch the steps run beside changes as prompts finish). Judged by
    # each placement's prediction alone, the prompts of a burst placed after the first made
    # every earlier one late, and the scale learned 1.28.
    rng = random.Random(7)
    bursts = [
        (
            at * 4.0,
            [(rng.randrange(50, 6000), rng.randrange(1, 300)) for _ in range(rng.randrange(5, 25))],
        )
        for at in range(60)
    ]
    forecast = PrefillForecast(H100)
    ratios = serve_bursts(forecast, bursts)
    assert len(ratios) == sum(len(burst) for _, burst in bursts)
    deciles = statistics.quantiles(ratios, n=10)
    assert 0.9 < deciles[0] and deciles[-1] < 1.1  # judged by the placement alone: 0.81, 1.54
    assert forecast.scale == pytest.approx(1.0, abs=0.05)  # by the placement alone: 1.28
