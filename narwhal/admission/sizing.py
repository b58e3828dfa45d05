"""Workload sizing: how many tokens a prompt is (pure).

Without a tokenizer, the prompt's size is estimated from its characters. Engines report the
truth afterwards (``prompt_token_ids``, usage), which later work uses to learn the ratio per
engine; until then the estimate is the usual four characters per token of English text.
"""

from __future__ import annotations

from narwhal.protocol.requests import CompletionRequest

__all__ = ["DEFAULT_CHARS_PER_TOKEN", "estimate_prompt_tokens"]

DEFAULT_CHARS_PER_TOKEN = 4.0


def estimate_prompt_tokens(
    request: CompletionRequest, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
) -> int:
    """Prompt tokens: exact for token-ID prompts, else estimated from the characters."""
    if request.prompt_token_count is not None:
        return request.prompt_token_count
    return max(1, round(request.prompt_chars / chars_per_token))
