"""Workload sizing: the estimate, learning from engine reports, and a local tokenizer."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import trio

from narwhal.admission.sizing import Sizer, TokenizerCounter
from narwhal.config import ServingConfig
from narwhal.protocol.requests import parse_request
from tests.conftest import MODEL, StartFleet


def chat(text: str) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})


def test_estimate_is_four_characters_per_token_until_engines_report() -> None:
    sizer = Sizer()
    request = parse_request(chat("x" * 400), "chat", MODEL)
    assert sizer.prompt_tokens(request) == 100


def test_token_id_prompts_are_exact() -> None:
    body = orjson.dumps({"model": MODEL, "prompt": [1, 2, 3, 4, 5]})
    assert Sizer().prompt_tokens(parse_request(body, "completions", MODEL)) == 5


def test_the_ratio_is_learned_from_reported_usage() -> None:
    sizer = Sizer()
    request = parse_request(chat("x" * 600), "chat", MODEL)
    for _ in range(200):
        sizer.learn("engine-a", request, 200)  # 3 characters per token
    assert sizer.chars_per_token == pytest.approx(3.0, rel=0.01)
    assert sizer.prompt_tokens(request) == 200
    assert sizer.statistics().per_engine["engine-a"] == pytest.approx(3.0, rel=0.01)


def test_absurd_reports_are_ignored() -> None:
    sizer = Sizer()
    request = parse_request(chat("x" * 10), "chat", MODEL)
    sizer.learn("engine-a", request, 10_000)
    assert sizer.chars_per_token == 4.0 and sizer.statistics().observations == 0


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))


def test_a_local_tokenizer_makes_the_count_exact(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    write_tokenizer(path)
    sizer = Sizer(TokenizerCounter.from_file(str(path)))
    request = parse_request(chat("hello world hello unknown"), "chat", MODEL)
    assert sizer.prompt_tokens(request) == 4 + 4  # four words, plus the per-message overhead


def test_an_unusable_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(RuntimeError, match="cannot load tokenizer"):
        TokenizerCounter.from_file(str(path))


async def test_the_router_learns_from_the_usage_engines_report(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = await start_fleet()
    for _ in range(20):
        response = await fleet.chat(
            messages=[{"role": "user", "content": "y" * 800}],
            narwhal_sim={"output_tokens": 1, "prompt_tokens": 100},
        )
        assert response.status_code == 200
    assert fleet.router.sizer.statistics().observations == 20
    assert fleet.router.sizer.chars_per_token > 4.5  # learning towards 8 per token


async def test_the_router_uses_the_configured_tokenizer(
    start_fleet: StartFleet, autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    path = tmp_path / "tokenizer.json"
    write_tokenizer(path)
    fleet = await start_fleet(serving=ServingConfig(model=MODEL, tokenizer=str(path)))
    assert fleet.router.sizer.statistics().tokenizer
    assert (await fleet.chat()).status_code == 200
