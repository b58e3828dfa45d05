"""The simulator's tiny language: vocabulary, token IDs, prompt sizing, logprobs (pure).

Token IDs are a function of the token's text (CRC-32), so the same piece always has the same ID
and every ID is a non-negative integer. Prompt IDs are derived from four-character slices of the
prompt text, the same granularity as the size estimate.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "EOS_TEXT",
    "EOS_TOKEN_ID",
    "VOCAB_SIZE",
    "WORDS",
    "alternatives",
    "chat_prompt_text",
    "estimate_tokens",
    "held_token_id",
    "logprob",
    "prompt_ids",
    "prompt_logprobs",
    "prompt_pieces",
    "token_id",
]

CHARS_PER_TOKEN = 4
EOS_TOKEN_ID = 151645
EOS_TEXT = "<|im_end|>"
"""The end-of-sequence token's text, as a logprob entry shows it (its delta shows nothing)."""
VOCAB_SIZE = 151936
"""The simulated vocabulary's size (Qwen's, whose special-token IDs the simulator borrows): what
vLLM's ``-1`` ("every token") means for ``logprobs`` and ``prompt_logprobs``."""
_ID_SPACE = 150000

WORDS: tuple[str, ...] = (
    " the", " engine", " router", " token", " stream", " model", " queue", " budget",
    " prefill", " decode", " batch", " cache", " latency", " request", " answer", " time",
    " first", " next", " simple", " quick", " steady", " narwhal", " ocean", " signal",
    " measure", " admit", " refuse", " place", " learn", " predict", " of", " and",
    " to", " in", " is", " a", " we", " it", " every", " each",
    ",", ",", ".", ".", " fast", " slow", " careful", " honest",
)  # fmt: skip
"""Output pieces; commas and full stops appear twice to make them more frequent."""

_ALTERNATIVES: tuple[str, ...] = tuple(dict.fromkeys(w for w in WORDS if w.strip(",.")))


def token_id(piece: str) -> int:
    """The ID of an output piece: a stable non-negative integer."""
    return zlib.crc32(piece.encode()) % _ID_SPACE + 100


def estimate_tokens(chars: int) -> int:
    """Prompt size from its character count: about four characters per token, at least 1."""
    return max(1, -(-chars // CHARS_PER_TOKEN))


def prompt_ids(text: str, count: int) -> list[int]:
    """``count`` deterministic IDs for a prompt: one per four-character slice, then padding."""
    return [token for token, _ in prompt_pieces(text, count)]


def prompt_pieces(text: str, count: int) -> list[tuple[int, str]]:
    """The prompt's ``count`` tokens as ``(id, text)``: four-character slices, then padding.

    Padding tokens (a size forced beyond the text) decode to nothing.
    """
    pieces = []
    for index in range(count):
        piece = text[index * CHARS_PER_TOKEN : (index + 1) * CHARS_PER_TOKEN]
        key = piece or f"<{index}>"
        pieces.append((zlib.crc32(key.encode()) % _ID_SPACE + 100, piece))
    return pieces


def held_token_id(number: int) -> int:
    """The ID of the ``number``-th token whose text is held back (a UTF-8 continuation byte)."""
    return token_id(f"<0x{0x80 + number % 64:02X}>")


def _texts(value: Any) -> Iterable[str]:
    """The strings of one message's content (plain text or a list of parts)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for part in value:
            if isinstance(part, str):
                yield part
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]


def chat_prompt_text(messages: Sequence[Any]) -> str:
    """The text a chat prompt is sized from: contents and tool-call arguments, in order."""
    pieces: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        pieces.extend(_texts(message.get("content")))
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    pieces.append(function["arguments"])
    return "\n".join(pieces)


def logprob(position: int, piece: str) -> float:
    """The sampled token's log-probability: deterministic, in [-2.5, -0.001]."""
    return -((zlib.crc32(f"{position}:{piece}".encode()) % 2500) + 1) / 1000


def prompt_logprobs(
    pieces: Sequence[tuple[int, str]], top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` for a prompt: null for the first token, then per token a map
    from token ID (a string) to ``logprob``, ``rank`` and ``decoded_token``: the prompt's own
    token first (with its rank), then the ``top`` most likely tokens.
    """
    result: list[dict[str, dict[str, Any]] | None] = [None] if pieces else []
    for position, (token, piece) in enumerate(pieces[1:], start=1):
        value = logprob(-position, piece)
        rank = 1 + zlib.crc32(f"rank:{position}:{token}".encode()) % 40
        entry = {str(token): {"logprob": value, "rank": rank, "decoded_token": piece}}
        ranks = [r for r in range(1, top + 1) if r != rank][: top - 1 if rank <= top else top]
        start = zlib.crc32(f"palt:{position}".encode()) % len(_ALTERNATIVES)
        for offset, other in enumerate(ranks):
            word = _ALTERNATIVES[(start + offset) % len(_ALTERNATIVES)]
            entry.setdefault(
                str(token_id(word)),
                {"logprob": round(value * other / rank, 6), "rank": other, "decoded_token": word},
            )
        result.append(entry)
    return result


def alternatives(position: int, piece: str, count: int) -> list[tuple[str, float]]:
    """``count`` runner-up tokens for a position, each distinct and less likely than ``piece``."""
    chosen = logprob(position, piece)
    start = zlib.crc32(f"alt:{position}".encode()) % len(_ALTERNATIVES)
    result: list[tuple[str, float]] = []
    offset = 0
    while len(result) < count and offset < len(_ALTERNATIVES):
        candidate = _ALTERNATIVES[(start + offset) % len(_ALTERNATIVES)]
        offset += 1
        if candidate != piece:
            result.append((candidate, round(chosen - 1.5 * (len(result) + 1), 3)))
    return result
