"""The learned safety margin of predictive admission: how late a first token may come, in
seconds, on the wait, and on the own prefill of a request that hardly waits."""

from __future__ import annotations

import math

import pytest

from narwhal.admission.margin import WAIT_BANDS, Overruns, Ratios, SafetyMargin

BUDGET = 2.0


def overruns(prior: float, *, min_samples: int = 32, window: int = 512) -> Overruns:
    """Overruns whose every band learns from ``min_samples`` and keeps ``window``."""
    return Overruns(
        prior,
        tuple(
            Ratios(prior=0.0, least=-math.inf, min_samples=min_samples, window=window)
            for _ in WAIT_BANDS
        ),
    )


def biases(min_samples: int) -> dict[str, Ratios]:
    def ratios() -> Ratios:
        return Ratios(prior=1.0, least=0.0, min_samples=min_samples)

    return {
        "every": Ratios(prior=2.0, least=0.0, min_samples=min_samples),
        "compute": ratios(),
        "seats": ratios(),
        "own_bias": ratios(),
    }


def quick(
    min_samples: int = 1, window: int = 512, quiet_quantile: float | None = None, **kw: object
) -> SafetyMargin:
    """A margin whose every part learns from ``min_samples`` requests. Its cautions are read as
    while admission refuses, quiet or not, unless ``quiet_quantile`` is given: the tests of
    what is learned read it at the quantiles that hold while refusing."""
    return SafetyMargin(
        compute_late=overruns(1.5, min_samples=min_samples, window=window),
        seat_late=overruns(2.0, min_samples=min_samples, window=window),
        own=overruns(1.25, min_samples=min_samples, window=window),
        quiet_quantile=quiet_quantile,
        **biases(min_samples),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _waited(margin: SafetyMargin, predicted_wait: float, observed_wait: float) -> None:
    """A request that waited: 10 ms in the router, 0.1 s of own prefill, as predicted."""
    fixed, own = 0.01, 0.1
    margin.observe(fixed, predicted_wait, own, fixed + observed_wait + own, budget_s=BUDGET)


def test_until_requests_have_taught_it_the_caution_is_the_prior() -> None:
    margin = SafetyMargin()
    # 1.5 times the compute ahead, 2 times a seat's wait (the two root-sum-square), 1.25 times
    # an idle prompt's prefill.
    assert margin.caution_s(1.0, 0.1) == pytest.approx(0.5)
    assert margin.caution_s(1.0, 0.1, seat_s=0.4) == pytest.approx(math.hypot(0.6 * 0.5, 0.4))
    assert margin.caution_s(0.0, 1.0) == pytest.approx(0.25)
    for _ in range(31):
        _waited(margin, 1.0, 1.0)
    assert margin.caution_s(1.0, 0.1) == pytest.approx(0.5)
    assert margin.factor == margin.wait.prior == 2.0
    _waited(margin, 1.0, 1.0)  # the 32nd: the band is taught, and every wait came on time
    assert margin.caution_s(1.0, 0.1) == 0.0
    assert margin.factor == 1.0


def test_while_what_is_admitted_meets_the_budget_the_caution_is_the_95th_percentile() -> None:
    """The parts' cautions are read at the 95th percentile while at most one of the last
    ``outcomes`` admitted requests missed the budget, and at the 99th once more did: the
    in-budget target is 99 %, and misses come in bursts, which the 99th percentile holds."""
    margin = quick(min_samples=32, window=200, outcomes=200)
    for number in range(200):
        _waited(margin, 1.0, 1.0 + number / 400)  # 0 to 0.4975 s late, every one in budget
    assert margin.typical(1.0, 0.1)[0] == pytest.approx(1.25)
    assert margin.quantile == 0.95
    assert margin.caution_s(1.0, 0.1) == pytest.approx(1.475 - 1.25)

    def missed() -> None:  # an idle long prompt whose first token came after the budget
        margin.observe(0.0, 0.0, 1.0, BUDGET + 0.5, budget_s=BUDGET)

    assert (margin.caution_quantile(), margin.recent_misses) == (0.95, 0)
    missed()
    assert margin.quantile == 0.95  # one miss in 200 is inside the target
    missed()
    assert margin.quantile is None
    assert (margin.caution_quantile(), margin.recent_misses) == (0.99, 2)
    assert margin.caution_s(1.0, 0.1) == pytest.approx(1.495 - 1.25)  # the 99th percentile


def test_while_admission_is_not_refusing_the_caution_is_read_at_the_median() -> None:
    """While admission is not refusing, nobody waits at the budget's edge behind a request:
    admitting it risks its own budget only, so it is admitted when it is as likely to meet it
    as not (each part read at its median). While refusing, at the 95th percentile, plus the
    overload share."""
    margin = quick(min_samples=32, window=200, outcomes=200, quiet_quantile=0.5)
    for number in range(200):
        _waited(margin, 1.0, 1.0 + number / 400)  # 0 to 0.4975 s late, every one in budget
    assert margin.typical(1.0, 0.1)[0] == pytest.approx(1.25)
    assert margin.reading(overloaded=False) == margin.caution_quantile(overloaded=False) == 0.5
    assert margin.caution_s(1.0, 0.1) == pytest.approx(0.0)  # the median is the typical
    assert margin.reading(overloaded=True) == margin.caution_quantile() == 0.95
    assert margin.caution_s(1.0, 0.1, overloaded=True) == pytest.approx(1.475 - 1.25 + 0.25)
    # The shipped margin reads a quiet caution at the median.
    assert SafetyMargin().quiet_quantile == 0.5


def test_a_request_of_a_tick_is_read_lower_while_quiet_and_may_come_under_its_typical() -> None:
    """A request decided with the rest of its instant (a tick's, ``company``) knows every
    request that arrived with it, and while admission is not refusing nobody else waits at the
    edge: it is read at the tick quantile (the 20th percentile), which may lie under its
    typical first token. A request alone is read at the median, never under its typical; while
    refusing, both are read alike."""
    margin = quick(min_samples=32, window=200, outcomes=200, quiet_quantile=0.5, tick_quantile=0.2)
    for number in range(200):
        _waited(margin, 1.0, 1.0 + number / 400)  # 0 to 0.4975 s late, every one in budget
    assert margin.typical(1.0, 0.1)[0] == pytest.approx(1.25)  # the median ratio
    assert margin.reading(overloaded=False, company=True) == 0.2
    # The 20th percentile of a 1.0 s wait comes 0.1 s late, 0.15 s before the typical 1.25.
    assert margin.caution_s(1.0, 0.1, company=True) == pytest.approx(-0.15)
    assert margin.caution_s(1.0, 0.1) == pytest.approx(0.0)  # alone: the median, no lower
    # Refusing: the 95th percentile and the overload share, with company or not.
    refusing = margin.caution_s(1.0, 0.1, overloaded=True)
    assert margin.caution_s(1.0, 0.1, overloaded=True, company=True) == refusing
    assert refusing == pytest.approx(1.475 - 1.25 + 0.25)
    # The shipped margin reads a tick's request at the 20th percentile while quiet.
    assert SafetyMargin().tick_quantile == 0.2


def test_a_seat_no_seat_has_taught_is_judged_with_the_compute_aheads_waits() -> None:
    """On traffic whose waits are seldom for a seat, the seat's bands stay untaught: a seat
    that is part of a wait the compute ahead's bands know is not given the seat's prior (twice
    its wait); the whole wait is judged by those bands, until seats have taught their own."""
    margin = quick(min_samples=32, window=200)
    for number in range(200):
        _waited(margin, 1.0, 1.0 + number / 400)  # compute waits, 0 to 0.4975 s late
    assert margin.compute_late.taught(1.0, BUDGET) and not margin.seat_late.taught(0.3, BUDGET)
    # A 1.0 s wait, 0.3 s of it for a seat: a 1.0 s compute wait at the 95th percentile (0.475
    # s late), beyond its typical (1.25 s). The seat's prior would have made it
    # hypot(1.5 x 0.7 - 0.875, 2 x 0.3 - 0.375) = 0.285 s.
    assert margin.caution_s(1.0, 0.1, seat_s=0.3) == pytest.approx(0.225)
    # Seats teach their band (waits mostly for a seat, on time): each part by its own now.
    for _ in range(200):
        margin.observe(0.01, 0.3, 0.1, 0.41, budget_s=BUDGET, seat_s=0.2)
    assert margin.seat_late.taught(0.3, BUDGET)
    # The compute ahead (0.7 s, its bands untaught below 0.8 s: the prior, 1.5 x) beyond its
    # typical (1.25 x, its own bias now), and the seat on time: hypot(1.05 - 0.875, 0).
    assert margin.caution_s(1.0, 0.1, seat_s=0.3) == pytest.approx(0.175)


def test_the_waits_caution_is_the_99th_percentile_of_how_late_waits_came() -> None:
    margin = quick(min_samples=32, window=100)
    for number in range(100):
        _waited(margin, 1.0, 1.0 + number / 200)  # 0 to 0.495 s late
    # The typical wait is the median's (1.25 s); decided on at the 99th percentile, 1.495 s.
    assert margin.typical(1.0, 0.1)[0] == pytest.approx(1.25)
    assert margin.caution_s(1.0, 0.1) == pytest.approx(0.495 - 0.25)
    # The ratios' quantile is still what the metric shows.
    assert margin.factor == pytest.approx(1.495)
    # Only the wait was taught: an idle prompt keeps its prior.
    assert margin.caution_s(0.0, 1.0) == pytest.approx(0.25)


def test_a_waits_error_is_taught_in_seconds_not_as_a_ratio() -> None:
    """Waits err by about the same seconds whatever their length: 0.15 s waits that came
    0.3 s late (three times their prediction) do not put three times a 0.35 s wait on it."""
    margin = quick()
    for _ in range(10):
        _waited(margin, 0.15, 0.45)
    assert margin.compute_late.over_s(0.35, BUDGET) == pytest.approx(0.3)  # the same band
    typical_wait = margin.typical(0.35, 0.1)[0]
    assert typical_wait == pytest.approx(0.35 * 3.0)  # the bias of every wait, until taught
    assert margin.caution_s(0.35, 0.1) == 0.0  # typical already as late as the band's worst


def test_the_parts_that_do_not_wait_are_taken_out_of_the_observed_wait() -> None:
    margin = quick()
    # 0.5 s predicted wait, 0.3 s own prefill, 0.2 s in the router: observed 1.5 s, so the
    # wait was 1.0 s, 0.5 s late.
    margin.observe(0.2, 0.5, 0.3, 1.5, budget_s=BUDGET)
    assert margin.compute_late.over_s(0.5, BUDGET) == pytest.approx(0.5)
    assert margin.wait.samples == 1 and margin.factor == pytest.approx(2.0)


def test_short_waits_do_not_teach_the_wait() -> None:
    margin = quick()
    _waited(margin, 0.04, 0.08)  # under 5 % of the budget
    assert margin.wait.samples == 0
    assert margin.compute_late.over_s(0.5, BUDGET) is None


def test_a_wait_under_the_first_band_takes_its_caution_in_proportion() -> None:
    margin = quick()
    _waited(margin, 0.2, 0.5)  # 0.3 s late, in the first band (from 0.1 s)
    assert margin.compute_late.over_s(0.05, BUDGET) == pytest.approx(0.15)


def test_a_long_wait_is_judged_by_long_waits_and_an_untaught_band_climbs_a_ladder() -> None:
    margin = quick()
    for _ in range(3):
        _waited(margin, 0.2, 0.6)  # short waits, 0.4 s late
        _waited(margin, 1.0, 1.1)  # half the budget (the band from 0.8 s): 0.1 s late
    assert margin.compute_late.over_s(0.2, BUDGET) == pytest.approx(0.4)
    assert margin.compute_late.over_s(1.0, BUDGET) == pytest.approx(0.1)
    # A band not yet taught climbs from the nearest taught below: 5 % more of the wait per
    # band, compounded, at most what the prior (1.5) adds.
    assert margin.compute_late.over_s(1.4, BUDGET) == pytest.approx(0.1 + 0.05 * 1.4)
    assert margin.compute_late.over_s(1.8, BUDGET) == pytest.approx(0.1 + (1.05**2 - 1) * 1.8)
    short = quick()
    for _ in range(3):
        _waited(short, 0.2, 1.2)  # 1 s late: a longer wait climbs to the prior, no further
    assert short.compute_late.over_s(0.5, BUDGET) == pytest.approx(0.5 * 0.5)
    # Nothing taught up to it: none (the prior applies).
    assert quick().compute_late.over_s(1.0, BUDGET) is None
    assert quick().compute_late.cautious_s(1.0, BUDGET) == pytest.approx(1.5)


def test_waits_that_come_early_lower_the_caution_to_nothing() -> None:
    margin = quick()
    for _ in range(10):
        _waited(margin, 1.0, 0.5)
    assert margin.compute_late.over_s(1.0, BUDGET) == pytest.approx(-0.5)
    assert margin.typical(1.0, 0.1)[0] == pytest.approx(0.5)
    assert margin.caution_s(1.0, 0.1) == 0.0
    # The own prefill of a request that hardly waits keeps its prior all the same.
    assert margin.caution_s(0.0, 1.0) == pytest.approx(0.25)


def test_the_window_forgets_old_errors() -> None:
    margin = quick(window=10)
    for _ in range(10):
        _waited(margin, 1.0, 2.0)
    assert margin.compute_late.over_s(1.0, BUDGET) == pytest.approx(1.0)
    for _ in range(10):
        _waited(margin, 1.0, 1.5)
    assert margin.compute_late.over_s(1.0, BUDGET) == pytest.approx(0.5)


def test_a_long_prompt_that_hardly_waited_teaches_the_own_prefill() -> None:
    margin = quick()
    # 1.2 s of own prefill, 10 ms of wait: it came at 1.5 s, its prefill took 1.48 s.
    margin.observe(0.01, 0.01, 1.2, 1.5, budget_s=BUDGET)
    assert margin.own_bias.samples == 1 and margin.wait.samples == 0
    assert margin.own.over_s(1.2, BUDGET) == pytest.approx(0.28)
    # Its typical is the median's (1.48 s), and it came no later than that.
    assert margin.typical(0.0, 1.2)[1] == pytest.approx(1.48)
    assert margin.caution_s(0.0, 1.2) == pytest.approx(0.0)


def test_a_short_prompts_step_neighbour_puts_seconds_not_a_ratio_on_a_long_one() -> None:
    """Short prompts (0.15 s) that came 0.15 s late (a neighbour shared their step) put
    0.15 s on a longer prompt of their band, not twice its prefill; a longer untaught band
    climbs from it, at most to the prior (1.25); a band taught by long prompts of its own is
    judged by them."""
    margin = quick(min_samples=1)
    for _ in range(10):
        margin.observe(0.0, 0.0, 0.15, 0.30, budget_s=BUDGET)
    assert margin.own.over_s(0.35, BUDGET) == pytest.approx(0.15)
    assert margin.own.over_s(0.5, BUDGET) == pytest.approx(0.25 * 0.5)  # the prior's
    assert margin.own.over_s(1.4, BUDGET) == pytest.approx(0.25 * 1.4)
    for _ in range(10):
        margin.observe(0.0, 0.0, 0.5, 0.5 + 0.01, budget_s=BUDGET)  # 0.5 s prompts: 10 ms
    assert margin.own.over_s(0.7, BUDGET) == pytest.approx(0.01)
    assert margin.own.over_s(0.9, BUDGET) == pytest.approx(0.01 + 0.05 * 0.9)
    margin.observe(0.0, 0.0, 1.4, 1.4 + 0.05, budget_s=BUDGET)
    assert margin.own.over_s(1.4, BUDGET) == pytest.approx(0.05)


def test_a_wait_as_long_as_the_prefill_teaches_neither() -> None:
    margin = quick()
    margin.observe(0.01, 0.09, 0.1, 0.5, budget_s=BUDGET)  # under the floor, but not short
    assert margin.own_bias.samples == 0 and margin.wait.samples == 0
    assert margin.own.over_s(0.1, BUDGET) is None


def test_a_waiting_request_carries_its_own_prefills_error_in_its_waits() -> None:
    """The wait's errors were measured with the own prefill taken as predicted: a request
    that waits gets neither the own prefill's bias nor its caution (both would count a step's
    neighbour twice)."""
    margin = quick()
    for _ in range(3):
        margin.observe(0.0, 0.0, 0.2, 0.5, budget_s=BUDGET)  # idle prompts, 0.3 s late
    assert margin.own_bias.median == pytest.approx(2.5)
    assert margin.typical(0.0, 0.2)[1] == pytest.approx(0.5)  # hardly waits: its bias
    assert margin.typical(0.5, 0.2)[1] == pytest.approx(0.2)  # waits: as predicted
    assert margin.caution_s(0.0, 0.2) == pytest.approx(0.0)  # 0.2 + 0.3 = its typical
    # A 0.1 s prompt after a 50 ms wait: 0.3 s late at most, against 0.25 s typical; and the
    # untaught wait at 1.5 times.
    assert margin.caution_s(0.05, 0.1) == pytest.approx(math.hypot(0.05 * 0.5, 0.4 - 0.25))
    # Waiting 0.5 s: the wait's caution (untaught: 1.5 times the compute ahead) and no own.
    assert margin.caution_s(0.5, 0.1) == pytest.approx(0.5 * 0.5)


def test_the_typical_parts_are_corrected_by_their_median_ratio() -> None:
    margin = quick(min_samples=3)
    for observed in (1.1, 1.2, 1.3):
        _waited(margin, 1.0, observed)
    for observed in (0.018, 0.02, 0.05):  # short prompts that did not wait: 20 ms predicted
        margin.observe(0.0, 0.0, 0.02, observed, budget_s=BUDGET)
    assert margin.typical(1.0, 0.02) == pytest.approx((1.2, 0.02))
    assert margin.typical(0.0, 0.02) == pytest.approx((0.0, 0.02))
    # Decided on at the 99th percentile of the three waits, the latest: 0.3 s late.
    assert margin.caution_s(1.0, 0.0) == pytest.approx(1.3 - 1.2)


def test_a_queue_that_overruns_now_raises_the_waits_caution_at_once() -> None:
    margin = quick()
    _waited(margin, 1.0, 1.2)
    assert margin.caution_s(1.0, 0.0) == pytest.approx(0.0)  # one sample: quantile = bias
    assert margin.caution_s(1.0, 0.0, overrun=1.8) == pytest.approx(1.8 - 1.2)
    assert margin.caution_s(1.0, 0.0, overrun=1.1) == pytest.approx(0.0)


def test_each_part_of_the_wait_teaches_its_own_bias() -> None:
    margin = quick()
    fixed, own = 0.01, 0.1

    def waited(wait: float, seat: float, observed_wait: float) -> None:
        observed = fixed + observed_wait + own
        margin.observe(fixed, wait, own, observed, budget_s=BUDGET, seat_s=seat)

    waited(1.0, 0.05, 1.2)  # a seat's share of 5 %: a wait for the compute ahead
    assert (margin.compute.samples, margin.seats.samples) == (1, 0)
    waited(1.0, 0.8, 1.4)  # mostly a seat's: the compute ahead taken as predicted
    assert margin.seats.samples == 1
    assert margin.seats.median == pytest.approx((1.4 - 0.2) / 0.8)
    waited(1.0, 0.3, 1.0)  # both: it teaches neither part, only every wait
    waited(0.15, 0.08, 0.2)  # mostly a seat, but a seat too short to judge
    assert (margin.compute.samples, margin.seats.samples) == (1, 1)
    assert margin.every.samples == 4
    # Each teaches how late its own part comes: the compute ahead by the band of the wait, the
    # seat by the band of the seat's wait.
    assert margin.compute_late.bands[2].samples == 1
    assert margin.seat_late.bands[2].samples == 1
    assert margin.seat_late.over_s(0.8, BUDGET) == pytest.approx(1.4 - 1.0)


def test_each_part_of_the_typical_wait_is_corrected_by_its_own_median() -> None:
    """Seat waits and compute waits err differently (a seat frees when the running outputs
    end; the prefills ahead are known sizes): once both parts are taught, the typical wait
    corrects each part by its own median ratio, not both by every wait's."""
    margin = quick(min_samples=3)
    fixed, own = 0.01, 0.1

    def waited(wait: float, seat: float, observed_wait: float) -> None:
        observed = fixed + observed_wait + own
        margin.observe(fixed, wait, own, observed, budget_s=BUDGET, seat_s=seat)

    for observed in (1.1, 1.2, 1.3):  # waits for the compute ahead: 1.2 typical
        waited(1.0, 0.0, observed)
    # Seats not taught yet: every wait's median (1.2) corrects the whole wait.
    assert margin.typical(1.0, 0.1, 0.6) == pytest.approx((1.2, 0.1))
    for observed in (0.4, 0.6, 0.8):  # 0.8 s seats, 0.2 s of compute ahead taken as predicted
        waited(1.0, 0.8, observed)
    assert margin.seats.median == pytest.approx((0.6 - 0.2) / 0.8)
    # Now each part by its own: 0.4 s of compute at 1.2, 0.6 s of seat at 0.5.
    assert margin.typical(1.0, 0.1, 0.6) == pytest.approx((0.4 * 1.2 + 0.6 * 0.5, 0.1))
    assert margin.typical(1.0, 0.1) == pytest.approx((1.2, 0.1))  # no seat: the compute's
    # The every-wait median, 1.1 here, would have put both at 1.1.
    assert margin.every.median == pytest.approx(1.1)


def test_the_computes_and_the_seats_cautions_add_as_independent_errors() -> None:
    """A wait partly for the compute ahead and partly for a seat: each part's caution is how
    late waits of its kind came beyond their typical, and the two add root-sum-square (a
    prefill's speed and an output's length err apart). On the bursty trace a small seat at its
    untaught prior of 2, summed onto a long compute wait, refused waits that came in on time."""
    margin = quick(min_samples=3)
    fixed, own = 0.01, 0.1

    def waited(wait: float, seat: float, observed_wait: float) -> None:
        margin.observe(fixed, wait, own, fixed + observed_wait + own, budget_s=BUDGET, seat_s=seat)

    for observed in (0.5, 0.54, 0.8):  # 0.6 s compute waits: typical 0.9 of it, 0.2 s late
        waited(0.6, 0.0, observed)
    for observed in (0.5, 0.6, 0.9):  # 0.6 s seats (0.2 s of compute taken as predicted)
        waited(0.8, 0.6, observed + 0.2)
    # A 1.2 s wait, 0.6 s of it for a seat: the compute's 0.6 s at 0.9 typical and at most
    # 0.2 s late (0.26 s beyond typical); the seat's 0.6 s at 1.0 typical, 0.3 s late.
    assert margin.typical(1.2, 0.1, 0.6) == pytest.approx((0.6 * 0.9 + 0.6, 0.1))
    compute_over = 0.6 + 0.2 - 0.6 * 0.9
    seat_over = 0.6 + 0.3 - 0.6
    assert margin.caution_s(1.2, 0.1, seat_s=0.6) == pytest.approx(
        math.hypot(compute_over, seat_over)
    )


def test_the_wait_and_the_own_prefill_cautions_add_as_independent_errors() -> None:
    """For a request that hardly waits, both at their 99th percentile at once is far rarer
    than either: 0.045 s of caution on its wait and 0.4 s on its own prefill give about
    0.403 s, not 0.445 s."""
    margin = SafetyMargin(compute_late=Overruns(2.0), own=Overruns(1.4))
    assert margin.caution_s(0.045, 0.0) == pytest.approx(0.045)
    assert margin.caution_s(0.0, 1.0) == pytest.approx(0.4)
    assert margin.caution_s(0.045, 1.0) == pytest.approx(math.hypot(0.045, 0.4))


def test_while_admission_refuses_the_caution_grows_with_the_wait() -> None:
    """A refusal within the last budget, before this instant, adds a quarter of the predicted
    wait to the caution: requests keep arriving at the edge, and a long wait is the one a
    slower engine found late makes miss."""
    margin = quick()
    for _ in range(3):
        _waited(margin, 1.0, 1.1)
    calm = margin.caution_s(1.0, 0.1)
    assert not margin.overloaded(10.0, BUDGET)  # nothing refused yet
    margin.refused(10.0)
    # The same instant (a tick's later arrivals) is not overloaded by its own refusals.
    assert not margin.overloaded(10.0, BUDGET)
    assert margin.overloaded(10.001, BUDGET) and margin.overloaded(11.999, BUDGET)
    assert not margin.overloaded(12.0, BUDGET)  # a budget later: over
    loaded = margin.caution_s(1.0, 0.1, overloaded=True)
    assert loaded == pytest.approx(calm + 0.25 * 1.0)
    assert margin.caution_s(0.0, 0.1, overloaded=True) == margin.caution_s(0.0, 0.1)


def test_a_ticks_own_refusal_does_not_hide_an_earlier_ticks() -> None:
    """Ticks of requests arriving in one instant, each refusing its tail: the first refusal of
    a tick must not make the rest of that tick quiet while the tick before it refused within
    the budget (it did, and every tick of an overload looked quiet after its first refusal)."""
    margin = quick()
    margin.refused(10.0)
    margin.refused(10.0)  # the same tick's tail
    margin.refused(11.0)  # the next tick's first refusal
    assert margin.overloaded(11.0, BUDGET)  # the tick of 10.0 still counts
    margin.refused(11.0)
    assert margin.overloaded(11.0, BUDGET)
    assert margin.overloaded(12.5, BUDGET)
    margin.refused(14.0)  # a tick over a budget after the last: its own refusals do not count
    assert not margin.overloaded(14.0, BUDGET)
    assert margin.overloaded(14.001, BUDGET)
