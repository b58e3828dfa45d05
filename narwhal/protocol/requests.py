"""Parse and validate completion request bodies (pure, no I/O).

The router interprets a handful of fields (model, messages or prompt, stream, stream_options,
n, best_of, max_tokens, return_token_ids, and the unsupported options); everything else passes to
the engine untouched. Validation order, first failure wins (SPEC.md, Errors): invalid JSON /
shape / type (400), then model (404; a missing model is a 400), then sampling width, then
unsupported option. (413 is the shell's job: it never hands an oversized body to this module.)
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from narwhal.errors import InvalidRequest  # noqa: F401  (re-exported for callers' convenience)

__all__ = ["CompletionRequest", "Route", "parse_request"]

Route = Literal["chat", "completions"]


@attrs.frozen
class CompletionRequest:
    """A validated completion request.

    Attributes:
        route: ``"chat"`` for ``/v1/chat/completions``, ``"completions"`` for ``/v1/completions``.
        body: the client's JSON object exactly as sent (never mutated).
        stream: whether the client asked for a stream.
        include_usage: the client asked ``stream_options.include_usage``.
        continuous_usage: the client asked ``stream_options.continuous_usage_stats``.
        wants_token_ids: the client asked ``return_token_ids``.
        max_output_tokens: ``max_completion_tokens`` if given, else ``max_tokens``, else None.
        prompt_chars: characters of prompt text (for the characters-per-token estimate).
        prompt_token_ids: the prompt's length in tokens when the client sent token IDs, else None.
    """

    route: Route
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    wants_token_ids: bool
    max_output_tokens: int | None
    prompt_chars: int
    prompt_token_count: int | None = None


def parse_request(raw: bytes, route: Route, model: str) -> CompletionRequest:
    """Parse ``raw`` (a complete body within the size limit) and validate it.

    Raises:
        InvalidRequest: or one of its subclasses, the first failure in SPEC.md's order.
    """
    raise NotImplementedError
