"""Workload sizing: how many tokens a prompt is (pure).

Without a tokenizer, the prompt's size is estimated from its characters. Engines report the
truth afterwards (the usage Narwhal asks every engine for), and the ratio of characters to
tokens is learned from it, per engine and overall; the overall ratio sizes new requests, since
sizing comes before placement. An optional local ``tokenizer.json`` (``serving.tokenizer``,
read with the ``tokenizers`` library, never fetched from a hub) makes the count exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import attrs

from narwhal.protocol.requests import CompletionRequest

__all__ = [
    "DEFAULT_CHARS_PER_TOKEN",
    "Sizer",
    "SizerStatistics",
    "TokenCounter",
    "estimate_prompt_tokens",
    "prompt_text",
]

DEFAULT_CHARS_PER_TOKEN = 4.0
_LEARNING_RATE = 0.05
_RATIO_BOUNDS = (0.5, 20.0)
# Chat templates add a few tokens per message (role markers, separators).
_TOKENS_PER_MESSAGE = 4


class TokenCounter(Protocol):
    """Counts the tokens of a text (a ``tokenizers.Tokenizer`` adapter, in practice)."""

    def count(self, text: str) -> int: ...


def estimate_prompt_tokens(
    request: CompletionRequest, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
) -> int:
    """Prompt tokens: exact for token-ID prompts, else estimated from the characters."""
    if request.prompt_token_count is not None:
        return request.prompt_token_count
    return max(1, round(request.prompt_chars / chars_per_token))


def prompt_text(request: CompletionRequest) -> Iterator[str]:
    """The prompt's text pieces (message contents, text parts, completion prompts)."""
    body = request.body
    if request.route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            yield prompt
        elif isinstance(prompt, list):
            yield from (item for item in prompt if isinstance(item, str))
        return
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


@attrs.frozen
class SizerStatistics:
    """The learned ratios."""

    chars_per_token: float
    per_engine: dict[str, float]
    observations: int
    tokenizer: bool


class Sizer:
    """Sizes prompts, learning the characters-per-token ratio from engine reports."""

    def __init__(self, counter: TokenCounter | None = None) -> None:
        self.counter = counter
        self.chars_per_token = DEFAULT_CHARS_PER_TOKEN
        self._per_engine: dict[str, float] = {}
        self._observations = 0

    def prompt_tokens(self, request: CompletionRequest) -> int:
        """The prompt's size in tokens."""
        if request.prompt_token_count is not None:
            return request.prompt_token_count
        if self.counter is not None:
            count = sum(self.counter.count(text) for text in prompt_text(request))
            if request.route == "chat":
                count += _TOKENS_PER_MESSAGE * len(request.body.get("messages") or ())
            return max(1, count)
        return estimate_prompt_tokens(request, self.chars_per_token)

    def learn(self, engine: str, request: CompletionRequest, reported_tokens: int) -> None:
        """An engine reported the true prompt size of ``request``."""
        if request.prompt_token_count is not None or request.prompt_chars <= 0:
            return
        ratio = request.prompt_chars / reported_tokens
        if not _RATIO_BOUNDS[0] <= ratio <= _RATIO_BOUNDS[1]:
            return
        self._observations += 1
        self.chars_per_token += _LEARNING_RATE * (ratio - self.chars_per_token)
        previous = self._per_engine.get(engine, DEFAULT_CHARS_PER_TOKEN)
        self._per_engine[engine] = previous + _LEARNING_RATE * (ratio - previous)

    def statistics(self) -> SizerStatistics:
        """A frozen snapshot."""
        return SizerStatistics(
            self.chars_per_token,
            dict(self._per_engine),
            self._observations,
            self.counter is not None,
        )


@attrs.frozen
class TokenizerCounter:
    """Counts tokens with a local ``tokenizer.json`` (the ``tokenizers`` library)."""

    tokenizer: Any

    @classmethod
    def from_file(cls, path: str) -> TokenizerCounter:
        """Load ``path``.

        Raises:
            RuntimeError: the ``tokenizers`` library is not installed, or the file is unusable.
        """
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "serving.tokenizer needs the `tokenizers` package: pip install 'narwhal[tokenizer]'"
            ) from exc
        try:
            return cls(Tokenizer.from_file(path))
        except Exception as exc:
            raise RuntimeError(f"cannot load tokenizer {path!r}: {exc}") from exc

    def count(self, text: str) -> int:
        """Tokens of ``text``, without special tokens."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
