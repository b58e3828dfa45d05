"""Output lengths: learned per route, max_tokens bucket and prompt band, with decode
correction."""

from __future__ import annotations

import random

import pytest

from narwhal.scheduling.lengths import (
    BAND_LEAST,
    SEGMENTS,
    OutputLengths,
    _Distribution,
    prompt_band,
)


def test_without_data_a_prior_capped_by_max_tokens() -> None:
    lengths = OutputLengths()
    assert lengths.expected_total("chat", None) == 256
    assert lengths.expected_total("chat", 64) == 64


def test_a_conservative_quantile_of_what_was_seen() -> None:
    lengths = OutputLengths(quantile=0.75)
    for tokens in range(1, 101):
        lengths.learn("chat", None, tokens)
    assert 74 <= lengths.expected_total("chat", None) <= 77


def test_decode_correction_expects_more_than_already_produced() -> None:
    lengths = OutputLengths(quantile=0.5)
    for tokens in [10] * 50 + [200] * 50:
        lengths.learn("chat", None, tokens)
    assert lengths.expected_total("chat", None, generated=0) in (10, 200)
    assert lengths.expected_total("chat", None, generated=50) == 200
    assert lengths.expected_total("chat", None, generated=500) > 500


def test_routes_and_buckets_are_separate() -> None:
    lengths = OutputLengths()
    for _ in range(20):
        lengths.learn("chat", 16, 16)
        lengths.learn("completions", None, 900)
    assert lengths.expected_total("chat", 16) == 16
    assert lengths.expected_total("completions", None) == 900
    assert lengths.expected_total("chat", None) == 256  # nothing learned for that bucket


def test_the_window_forgets_old_lengths() -> None:
    lengths = OutputLengths()
    for _ in range(600):
        lengths.learn("chat", None, 10)
    for _ in range(600):
        lengths.learn("chat", None, 300)
    assert lengths.expected_total("chat", None) == 300


def test_remaining_bounds_split_the_conditional_distribution_in_equal_shares() -> None:
    lengths = OutputLengths(prior=False)
    for tokens in range(1, 801):
        lengths.learn("chat", None, tokens)
    bounds = lengths.remaining("chat", None, generated=400).bounds()
    assert bounds == sorted(bounds) and len(bounds) == 9
    assert bounds[0] == 1 and bounds[-1] == 400
    assert bounds[4] == pytest.approx(200, abs=2)  # half of what is left: 400 more at most


def test_running_requests_lengthen_what_completions_alone_suggest() -> None:
    # Under a sudden load the short requests complete first: 100 of 10 tokens are done,
    # while 100 others already ran 300 tokens and go on. Completions alone say "10".
    lengths = OutputLengths(prior=False)
    for _ in range(100):
        lengths.learn("chat", None, 10)
    alone = lengths.remaining("chat", None, generated=0).bounds()
    census = lengths.census([("chat", None, 300, None)] * 100)
    counted = census.remaining("chat", None, generated=0).bounds()
    assert alone[-1] == 10
    assert counted[:4] == [10.0] * 4  # half of the mass ended at 10 tokens
    assert counted[-1] > 300  # the other half runs past 300
    assert census.remaining("chat", None, generated=300).bound(0) >= 1


def test_outputs_may_be_longer_than_any_seen_until_one_runs_past() -> None:
    # The first completions are short ones; the bucket's prior, pseudo-completions spread up
    # to its max_tokens, keeps the long tail in view past the longest output seen, with less
    # weight as real completions arrive.
    lengths = OutputLengths()
    for _ in range(100):
        lengths.learn("chat", 2048, 10)
    early = lengths.remaining("chat", 2048).bounds()
    assert early[:6] == [10.0] * 6  # most of the mass: what was seen
    assert early[-1] > 1000  # and the tail the prior keeps: up to max_tokens
    for _ in range(500):
        lengths.learn("chat", 2048, 10)
    late = lengths.remaining("chat", 2048).bounds()
    assert late[:8] == [10.0] * 8 and late[-1] > 1000  # 8 of 520: the tail's weight is small
    # A running request that has generated 1,500 tokens is past most of the prior: what is
    # left of it is beyond 1,500.
    census = lengths.census([("chat", 2048, 1500, None)])
    assert census.remaining("chat", 2048, generated=1500).bound(0) >= 1
    assert census.remaining("chat", 2048, generated=1500).bound(8) <= 2048 - 1500


def test_prompt_bands_are_quarter_octaves() -> None:
    assert prompt_band(1024) == prompt_band(1279) != prompt_band(1280)
    assert prompt_band(1023) != prompt_band(1024)
    assert prompt_band(1) == prompt_band(4)
    assert len({prompt_band(n) for n in range(1024, 2048)}) == 4


def test_a_prompt_band_answers_for_its_prompts_once_it_has_learned() -> None:
    # Templates tie the answer's length to the prompt's: prompts of about 1,100 tokens answer
    # with 400, the others with 50 (the Azure conversation trace's shape, simplified).
    lengths = OutputLengths(quantile=0.5, prior=False)
    for _ in range(BAND_LEAST - 1):
        lengths.learn("chat", None, 400, prompt_tokens=1100)
    for _ in range(200):
        lengths.learn("chat", None, 50, prompt_tokens=300)
    # One short of BAND_LEAST: the bucket answers, which the short answers dominate.
    assert lengths.expected_total("chat", None, prompt_tokens=1100) == 50
    lengths.learn("chat", None, 400, prompt_tokens=1100)
    assert lengths.expected_total("chat", None, prompt_tokens=1100) == 400
    assert lengths.expected_total("chat", None, prompt_tokens=300) == 50
    assert lengths.expected_total("chat", None, prompt_tokens=5000) == 50  # an empty band
    assert lengths.expected_total("chat", None) == 50  # no prompt size: the bucket
    assert lengths.remaining("chat", None, prompt_tokens=1100).bounds() == [400.0] * 9


def test_the_census_counts_a_running_request_in_its_band_and_its_bucket() -> None:
    lengths = OutputLengths(prior=False)
    for _ in range(BAND_LEAST):
        lengths.learn("chat", None, 100, prompt_tokens=1100)
    # A request of the band running past every completed length: the band's distribution
    # (and the bucket's) can no longer end everything at 100.
    census = lengths.census([("chat", None, 150, 1100)] * BAND_LEAST)
    assert census.remaining("chat", None, 150, 1100).bound(SEGMENTS) > 1
    assert census.remaining("chat", None, 150).bound(SEGMENTS) > 1
    assert lengths.census(()).remaining("chat", None, 0, 1100).bound(SEGMENTS) == 100


def _kaplan_meier(completed: list[int], running: list[int]) -> tuple[list[int], list[float]]:
    """The estimator as the textbook writes it: at each completed length in turn, the
    survival times one less the share of those at risk that ended there."""
    lengths: list[int] = []
    survival: list[float] = []
    current = 1.0
    for length in sorted(set(completed)):
        ended = completed.count(length)
        at_risk = sum(1 for c in completed if c >= length) + sum(1 for r in running if r >= length)
        current *= 1.0 - ended / at_risk
        lengths.append(length)
        survival.append(current)
    return lengths, survival


def test_the_census_survival_curve_is_kaplan_meiers() -> None:
    # Completed lengths are observed ends; a running request is censored at its count (it
    # is at risk at every length up to its count).
    rng = random.Random(7)
    for _ in range(200):
        completed = sorted(
            rng.randrange(1, rng.choice([4, 60, 900])) for _ in range(rng.randrange(0, 90))
        )
        running = [rng.randrange(0, 900) for _ in range(rng.randrange(0, 40))]
        distribution = _Distribution(completed, running)
        lengths, survival = _kaplan_meier(completed, running)
        assert distribution.lengths == lengths
        assert [-drop for drop in distribution.drops] == survival
        for generated in [0, *completed[:3], 899]:
            expected = next(
                (
                    s
                    for length, s in zip(reversed(lengths), reversed(survival), strict=True)
                    if length <= generated
                ),
                1.0,
            )
            assert distribution.survival(generated) == expected
