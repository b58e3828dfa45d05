"""Output lengths: learned per route and max_tokens bucket, with decode correction."""

from __future__ import annotations

import pytest

from narwhal.scheduling.lengths import OutputLengths


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
    census = lengths.census([("chat", None, 300)] * 100)
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
    census = lengths.census([("chat", 2048, 1500)])
    assert census.remaining("chat", 2048, generated=1500).bound(0) >= 1
    assert census.remaining("chat", 2048, generated=1500).bound(8) <= 2048 - 1500
