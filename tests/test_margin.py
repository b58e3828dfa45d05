"""The learned safety margin of predictive admission: caution on the wait, and on the own
prefill, each from its own error."""

from __future__ import annotations

import pytest

from narwhal.admission.margin import WAIT_BANDS, Ratios, SafetyMargin, WaitFactors

BUDGET = 2.0


def waits(*, prior: float = 2.0, min_samples: int = 32, window: int = 512) -> WaitFactors:
    """Wait factors whose every band (and their union) learn as ``Ratios`` of these."""

    def ratios() -> Ratios:
        return Ratios(prior=prior, least=0.0, min_samples=min_samples, window=window)

    return WaitFactors(prior, tuple(ratios() for _ in WAIT_BANDS), ratios())


def cautious(
    *, prior: float = 2.0, min_samples: int = 32, window: int = 512, **kw: object
) -> SafetyMargin:
    """A margin whose compute waits, seat waits (prior 2) and every wait together learn as
    ``waits`` of these."""
    every = Ratios(prior=prior, least=0.0, min_samples=min_samples, window=window)
    return SafetyMargin(
        waits=waits(prior=prior, min_samples=min_samples, window=window),
        seats=waits(prior=2.0, min_samples=min_samples, window=window),
        every=every,
        **kw,  # type: ignore[arg-type]
    )


def _waited(margin: SafetyMargin, predicted_wait: float, observed_wait: float) -> None:
    """A request that waited: 10 ms in the router, 0.1 s of own prefill, as predicted."""
    fixed, own = 0.01, 0.1
    margin.observe(fixed, predicted_wait, own, fixed + observed_wait + own, budget_s=BUDGET)


def test_until_enough_requests_taught_it_the_factor_is_the_prior() -> None:
    margin = SafetyMargin()
    for _ in range(31):
        _waited(margin, 1.0, 1.0)
    assert margin.factor == margin.wait.prior == 2.0
    _waited(margin, 1.0, 1.0)
    assert margin.factor == 1.0


def test_the_wait_factor_is_the_99th_percentile_of_observed_over_predicted_wait() -> None:
    margin = cautious(prior=2.0, window=100)
    for number in range(100):
        _waited(margin, 1.0, 1.0 + number / 50)  # ratios 1.00 .. 2.98
    assert margin.factor == pytest.approx(2.98)
    # Only the wait is cautious: the own prefill keeps its prior.
    assert margin.own.all.samples == 0
    # The typical wait is the median's (2.0 s); the projection decided on is at the factor.
    assert margin.typical(1.0, 0.0)[0] == pytest.approx(2.0)
    assert margin.caution_s(1.0, 0.0) == pytest.approx(0.98)


def test_the_parts_that_do_not_wait_are_taken_out_of_the_observed_wait() -> None:
    margin = cautious(prior=2.0, min_samples=1)
    # 0.5 s predicted wait, 0.3 s own prefill, 0.2 s in the router: observed 1.5 s, so the
    # wait was 1.0 s, twice the prediction.
    margin.observe(0.2, 0.5, 0.3, 1.5, budget_s=BUDGET)
    assert margin.factor == pytest.approx(2.0)
    assert margin.wait.samples == 1


def test_short_waits_do_not_teach_the_wait_factor() -> None:
    margin = cautious(prior=2.0, min_samples=1)
    _waited(margin, 0.04, 0.08)  # under 5 % of the budget
    assert margin.wait.samples == 0 and margin.factor == 2.0


def own(*, min_samples: int = 1) -> WaitFactors:
    """Own-prefill factors (prior 1.25, never under 1) whose bands learn from ``min_samples``."""

    def ratios() -> Ratios:
        return Ratios(prior=1.25, min_samples=min_samples)

    return WaitFactors(1.25, tuple(ratios() for _ in WAIT_BANDS), ratios())


def test_a_long_prompt_that_hardly_waited_teaches_the_own_prefill_factor() -> None:
    margin = SafetyMargin(own=own())
    # 1.2 s of own prefill, 10 ms of wait: it came at 1.5 s, its prefill took 1.48 s.
    margin.observe(0.01, 0.01, 1.2, 1.5, budget_s=BUDGET)
    assert margin.own.all.samples == 1 and margin.wait.samples == 0
    assert margin.own.factor(1.2, BUDGET) == pytest.approx(1.48 / 1.2)
    assert margin.caution_s(0.0, 1.2) == pytest.approx(0.28)


def test_short_prompts_errors_never_raise_a_long_prompts_own_caution() -> None:
    # Short prompts (0.15 s) that came twice as late as predicted (a neighbour shared their
    # step) teach their band 2.0; a 1.4 s prompt, three bands up and untaught, climbs from it
    # and stays at the prior 1.25.
    margin = SafetyMargin(own=own())
    for _ in range(10):
        margin.observe(0.0, 0.0, 0.15, 0.30, budget_s=BUDGET)
    assert margin.own.factor(0.15, BUDGET) == pytest.approx(2.0)
    assert margin.own.factor(1.4, BUDGET) == 1.25
    # A band taught by long prompts of its own is judged by them.
    margin.observe(0.0, 0.0, 1.4, 1.4 * 1.1, budget_s=BUDGET)
    assert margin.own.factor(1.4, BUDGET) == pytest.approx(1.1)


def test_a_wait_as_long_as_the_prefill_teaches_neither_the_own_factor() -> None:
    margin = SafetyMargin(own=own())
    margin.observe(0.01, 0.09, 0.1, 0.5, budget_s=BUDGET)  # under the floor, but not short
    assert margin.own.all.samples == 0 and margin.wait.samples == 0
    assert margin.own_bias.samples == 0


def test_waits_shorter_than_predicted_lower_the_wait_factor_below_one() -> None:
    margin = cautious(prior=2.0, min_samples=1)
    for _ in range(10):
        _waited(margin, 1.0, 0.5)
    assert margin.factor == pytest.approx(0.5)
    assert margin.caution_s(1.0, 1.0) == pytest.approx(0.25)  # the own prior is still 1.25


def test_the_own_factor_never_goes_below_one() -> None:
    margin = SafetyMargin(own=own())
    margin.observe(0.01, 0.0, 1.0, 0.51, budget_s=BUDGET)  # half its predicted prefill
    assert margin.own.factor(1.0, BUDGET) == margin.own.all.least == 1.0


def test_the_window_forgets_old_errors() -> None:
    margin = cautious(prior=2.0, window=10, min_samples=1)
    for _ in range(10):
        _waited(margin, 1.0, 3.0)
    assert margin.factor == pytest.approx(3.0)
    for _ in range(10):
        _waited(margin, 1.0, 1.5)
    assert margin.factor == pytest.approx(1.5)


def test_the_typical_parts_are_corrected_by_their_median_ratio() -> None:
    margin = cautious(min_samples=3, own_bias=Ratios(prior=1.0, least=0.0, min_samples=3))
    for observed in (1.1, 1.2, 1.3):
        _waited(margin, 1.0, observed)
    for observed in (0.018, 0.02, 0.05):  # short prompts that did not wait: 20 ms predicted
        margin.observe(0.0, 0.0, 0.02, observed, budget_s=BUDGET)
    assert margin.typical(1.0, 0.02) == pytest.approx((1.2, 0.02))
    # Decided on at the factor: the 99th percentile of the three waits is the longest.
    assert margin.caution_s(1.0, 0.0) == pytest.approx(1.3 - 1.2)


def test_a_queue_that_overruns_now_raises_the_wait_factor_at_once() -> None:
    margin = cautious(prior=2.0, min_samples=1)
    _waited(margin, 1.0, 1.2)
    assert margin.caution_s(1.0, 0.0) == pytest.approx(0.0)  # one sample: factor = bias
    assert margin.caution_s(1.0, 0.0, overrun=1.8) == pytest.approx(1.8 - 1.2)
    assert margin.caution_s(1.0, 0.0, overrun=1.1) == pytest.approx(0.0)


def test_a_long_wait_is_judged_by_long_waits_and_an_untaught_band_climbs_a_ladder() -> None:
    margin = SafetyMargin(waits=waits(min_samples=3))
    assert margin.waits.factor(1.0, BUDGET) == 2.0  # nothing taught: the prior
    for observed in (1.1, 1.2, 1.3):  # 1 s waits, half the budget: the band from 0.4
        _waited(margin, 1.0, observed)
    assert margin.waits.factor(1.0, BUDGET) == pytest.approx(1.3)
    # A longer wait, in the band from 0.6 of the budget, has not been seen yet: the factor of
    # the band below, with more caution; shorter waits have nothing below them: the prior.
    assert margin.waits.factor(1.4, BUDGET) == pytest.approx(1.3 * 1.15)
    assert margin.waits.factor(1.8, BUDGET) == pytest.approx(1.3 * 1.15**2)
    assert margin.waits.factor(0.3, BUDGET) == 2.0


def test_shorter_waits_errors_never_raise_a_longer_waits_caution_above_the_prior() -> None:
    margin = SafetyMargin(waits=waits(min_samples=3))
    for observed in (0.5, 0.6, 0.7):  # 0.2 s waits that took 2.5 to 3.5 times that
        _waited(margin, 0.2, observed)
    assert margin.waits.factor(0.2, BUDGET) == pytest.approx(3.5)
    # A wait of 1 s has not been seen: the prior, not the short waits' larger error.
    assert margin.waits.factor(1.0, BUDGET) == 2.0


def test_a_wait_for_a_seat_is_judged_by_how_seat_waits_fared() -> None:
    margin = cautious(prior=1.5, min_samples=3)
    for observed in (1.0, 1.05, 1.1):  # waits for the prefills ahead: well predicted
        _waited(margin, 1.0, observed)
    assert margin.waits.all.samples == 3 and margin.seats.all.samples == 0
    # The same wait, mostly for a seat, is not vouched for by them: the seat's prior, 2.
    assert margin.caution_s(1.0, 0.0) == pytest.approx(1.1 - 1.05)
    assert margin.caution_s(1.0, 0.0, seat_s=0.8) == pytest.approx(0.2 * 1.5 + 0.8 * 2.0 - 1.05)


def test_each_part_of_the_wait_teaches_its_own_factor() -> None:
    margin = cautious(min_samples=1)
    fixed, own = 0.01, 0.1

    def waited(wait: float, seat: float, observed_wait: float) -> None:
        observed = fixed + observed_wait + own
        margin.observe(fixed, wait, own, observed, budget_s=BUDGET, seat_s=seat)

    waited(1.0, 0.05, 1.2)  # a seat's share of 5 %: a wait for the compute ahead
    assert margin.waits.all.samples == 1 and margin.seats.all.samples == 0
    waited(1.0, 0.8, 1.4)  # mostly a seat's: the compute ahead taken as predicted
    assert margin.seats.all.samples == 1
    assert margin.seats.factor(0.8, BUDGET) == pytest.approx((1.4 - 0.2) / 0.8)
    waited(1.0, 0.3, 1.0)  # both: it teaches neither part, only the bias of every wait
    assert (margin.waits.all.samples, margin.seats.all.samples) == (1, 1)
    assert margin.every.samples == 3


def test_each_part_of_the_typical_wait_is_corrected_by_its_own_median() -> None:
    """Seat waits and compute waits err differently (a seat frees when the running outputs
    end; the prefills ahead are known sizes): once both parts are taught, the typical wait
    corrects each part by its own median ratio, not both by every wait's."""
    margin = cautious(min_samples=3)
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
    assert margin.seats.all.median == pytest.approx((0.6 - 0.2) / 0.8)
    # Now each part by its own: 0.4 s of compute at 1.2, 0.6 s of seat at 0.5.
    assert margin.typical(1.0, 0.1, 0.6) == pytest.approx((0.4 * 1.2 + 0.6 * 0.5, 0.1))
    assert margin.typical(1.0, 0.1) == pytest.approx((1.2, 0.1))  # no seat: the compute's
    # The every-wait median, 1.1 here, would have put both at 1.1.
    assert margin.every.median == pytest.approx(1.1)


def test_the_wait_and_the_own_prefill_cautions_add_as_independent_errors() -> None:
    """Both parts at their 99th percentile at once is far rarer than either: a request with
    0.9 s of caution on its wait and 0.4 s on its own prefill gets about 0.98 s, not 1.3 s."""
    margin = SafetyMargin(waits=WaitFactors(prior=1.9), own=WaitFactors(prior=1.4))
    assert margin.caution_s(1.0, 0.0) == pytest.approx(0.9)
    assert margin.caution_s(0.0, 1.0) == pytest.approx(0.4)
    assert margin.caution_s(1.0, 1.0) == pytest.approx((0.9**2 + 0.4**2) ** 0.5)
