"""Output lengths: learned per route and max_tokens bucket, with decode correction."""

from __future__ import annotations

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
