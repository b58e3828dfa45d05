"""The real vLLM 0.32 answers in ``tests/sim/captures/``, parsed (see its README)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import attrs
import orjson

__all__ = ["Capture", "capture", "names"]

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
