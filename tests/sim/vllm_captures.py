"""The real vLLM 0.32 answers in ``tests/sim/captures/``, parsed (see its README)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import attrs
import orjson

__all__ = ["Capture", "capture", "names", "same", "shape"]

_DIRECTORY = Path(__file__).with_name("captures")


@attrs.frozen
class Capture:
    """One captured HTTP answer.

    Attributes:
        status: the HTTP status.
        headers: the response headers, names lower-cased, in order.
        body: the raw body.
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (None when absent)."""
        return next((value for key, value in self.headers if key == name), None)

    def json(self) -> Any:
        """The body as JSON."""
        return orjson.loads(self.body)

    def events(self) -> list[Any]:
        """The ``data:`` payloads of an SSE body, decoded (``[DONE]`` stays a string)."""
        result: list[Any] = []
        for block in self.body.split(b"\n\n"):
            if not block:
                continue
            payload = block.removeprefix(b"data: ")
            result.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
        return result


@cache
def capture(name: str) -> Capture:
    """The capture ``name`` (the file name without ``.txt``)."""
    raw = (_DIRECTORY / f"{name}.txt").read_bytes()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = []
    for line in lines:
        key, _, value = line.partition(":")
        headers.append((key.strip().lower(), value.strip()))
    return Capture(int(status_line.split()[1]), tuple(headers), body)


def names() -> list[str]:
    """Every capture's name."""
    return sorted(path.stem for path in _DIRECTORY.glob("*.txt"))


def shape(value: Any, key: str | None = None) -> Any:
    """What must match: keys in order, nulls, value types; not the values.

    A list's shape is that of its first and last elements (an empty list matches any list); a
    map keyed by token IDs (``prompt_logprobs``) or by token texts (completions
    ``top_logprobs``) is the shape of its values.
    """
    if isinstance(value, dict):
        if value and (all(k.isdigit() for k in value) or (key == "top_logprobs")):
            if "token" not in value:
                return ("map", shape(next(iter(value.values()))))
        return [(k, shape(v, k)) for k, v in value.items()]
    if isinstance(value, list):
        return ("list", shape(value[0], key), shape(value[-1], key)) if value else ("list",)
    if value is None:
        return None
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def same(ours: Any, theirs: Any) -> bool:
    """Shapes agree, an empty list agreeing with any list."""
    if isinstance(ours, tuple) and isinstance(theirs, tuple):
        return len(ours) == 1 or len(theirs) == 1 or all(map(same, ours, theirs))
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(
            a[0] == b[0] and same(a[1], b[1]) for a, b in zip(ours, theirs, strict=True)
        )
    return bool(ours == theirs)
