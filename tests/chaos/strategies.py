"""Hypothesis strategies for hostile completion bodies, as raw bytes.

Every field the router reads (and a sample of those it passes through) is set to a value of any
JSON type, deleted, or replaced by something JSON can barely say: numbers past 64 bits, lone
surrogates in ``\\u`` escapes, NaN-like strings, deep nesting, duplicate keys. Bodies are built as
bytes so that what no serialiser would write (``NaN``, a BOM, invalid UTF-8, a truncated object)
is in reach too.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from tests.conftest import MODEL

__all__ = [
    "Body",
    "chat_bodies",
    "completion_bodies",
    "deep_bodies",
    "hostile_bodies",
    "raw_bodies",
]


class Body(bytes):
    """A generated body; its repr (what a failing example prints) stays short."""

    def __repr__(self) -> str:
        head = bytes(self[:160])
        return f"Body({head!r}{'...' if len(self) > 160 else ''}, {len(self)} bytes)"


SPECIAL_STRINGS = (
    "",
    "NaN",
    "-NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-0",
    "0x10",
    "null",
    "true",
    "\x00",
    "\ud800",  # lone high surrogate: json.dumps writes the \ud800 escape
    "\udfff",
    "a\ud83d",
    "\ud83d\ude00",
    "\u202e\u0645\u0631\u062d\u0628\u0627",
    "\U0001f600" * 8,
    "e\u0301" * 4,
    "\ufeff",
    "<script>",
    "%s%n{0}",
    "\\",
    '"',
    "llama-3.1-8b-instruct\x00",
    MODEL.upper(),
    " " + MODEL,
)
SPECIAL_NUMBERS = (
    0,
    -1,
    1,
    2,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**100,
    -(2**63) - 1,
    0.5,
    -0.0,
    1e308,
    5e-324,
    True,
    False,
)

text = st.one_of(
    st.text(max_size=24),
    st.sampled_from(SPECIAL_STRINGS),
    st.lists(st.sampled_from(SPECIAL_STRINGS), min_size=1, max_size=4).map("".join),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(SPECIAL_NUMBERS),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(text, children, max_size=4),
    ),
    max_leaves=10,
)


def _chat_base() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        ],
        "max_tokens": 4,
    }


def _completion_base() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}


CHAT_PATHS = (
    ("model",),
    ("messages",),
    ("messages", 0),
    ("messages", 0, "role"),
    ("messages", 0, "content"),
    ("messages", 1, "content"),
    ("messages", 1, "content", 0),
    ("messages", 1, "content", 0, "type"),
    ("messages", 1, "content", 0, "text"),
    ("messages", 1, "tool_calls"),
    ("messages", 1, "name"),
    ("stream",),
    ("stream_options",),
    ("stream_options", "include_usage"),
    ("stream_options", "continuous_usage_stats"),
    ("n",),
    ("best_of",),
    ("max_tokens",),
    ("max_completion_tokens",),
    ("return_token_ids",),
    ("modalities",),
    ("tools",),
    ("tools", 0),
    ("tools", 0, "type"),
    ("tools", 0, "function"),
    ("tool_choice",),
    ("audio",),
    ("temperature",),
    ("top_p",),
    ("stop",),
    ("seed",),
    ("logprobs",),
    ("top_logprobs",),
    ("response_format",),
    ("user",),
    ("chaos_extra",),
)
COMPLETION_PATHS = (
    ("model",),
    ("prompt",),
    ("prompt", 0),
    ("prompt", 1),
    ("stream",),
    ("stream_options",),
    ("stream_options", "include_usage"),
    ("n",),
    ("best_of",),
    ("max_tokens",),
    ("return_token_ids",),
    ("echo",),
    ("suffix",),
    ("logprobs",),
    ("stop",),
    ("temperature",),
    ("chaos_extra",),
)
_DELETE = object()


def _set(body: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set ``path`` in ``body``, building containers on the way (wrong-typed parents replaced)."""
    node = body
    for depth, key in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(key, int):
            if not isinstance(node, list):
                return  # the parent was replaced by a scalar: nothing to set
            while len(node) <= key:
                node.append({})
        elif not isinstance(node, dict):
            return
        if last:
            if value is _DELETE:
                if isinstance(node, dict):
                    node.pop(key, None)
                elif key < len(node):
                    node.pop(key)
            else:
                node[key] = value
            return
        child = (
            node[key] if (isinstance(node, dict) and key in node) or isinstance(key, int) else None
        )
        if not isinstance(child, dict | list):
            child = [] if isinstance(path[depth + 1], int) else {}
            node[key] = child
        node = child


def _encode(body: Any, ascii_only: bool, stream: bool | None) -> bytes:
    if stream is not None and isinstance(body, dict) and "stream" not in body:
        body["stream"] = stream
        if stream and "stream_options" not in body:
            body["stream_options"] = {"include_usage": True}
    text = json.dumps(body, ensure_ascii=ascii_only)  # NaN/Infinity as JavaScript literals
    return text.encode("utf-8", "surrogatepass")  # lone surrogates become invalid UTF-8


@st.composite
def _mutated(draw: st.DrawFn, base: Any, paths: tuple[tuple[Any, ...], ...]) -> bytes:
    body = base()
    for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
        value = draw(st.one_of(json_values, st.just(_DELETE), st.floats()))
        _set(body, path, value)
    stream = draw(st.sampled_from((None, True, False)))
    return _encode(body, draw(st.booleans()), stream)


def chat_bodies() -> st.SearchStrategy[bytes]:
    """Chat bodies with one to three fields set to anything, or deleted."""
    return _mutated(_chat_base, CHAT_PATHS).map(Body)


def completion_bodies() -> st.SearchStrategy[bytes]:
    """Completion bodies with one to three fields set to anything, or deleted."""
    return _mutated(_completion_base, COMPLETION_PATHS).map(Body)


@st.composite
def deep_bodies(draw: st.DrawFn, chat: bool = True) -> bytes:
    """A valid body with one field holding ``depth`` nested arrays or objects (issue item 2)."""
    depth = draw(st.sampled_from((64, 127, 128, 200, 253, 254, 255, 256, 300, 512, 1024, 5000)))
    opener, closer, leaf = draw(
        st.sampled_from(((b"[", b"]", b"1"), (b'{"a":', b"}", b"null"), (b"[", b"]", b"")))
    )
    nested = opener * depth + leaf + closer * depth
    body = _chat_base() if chat else _completion_base()
    where = draw(
        st.sampled_from(
            ("chaos_extra", "stop", "response_format", "tool_choice", "logit_bias", "user")
        )
    )
    body[where] = "__NESTED__"
    body["stream"] = draw(st.booleans())
    raw = json.dumps(body).encode()
    return Body(raw.replace(b'"__NESTED__"', nested))


def raw_bodies() -> st.SearchStrategy[bytes]:
    """Bytes no serialiser writes: duplicate keys, literals, BOMs, truncation, bad UTF-8."""
    return _raw_bodies().map(Body)


@st.composite
def _raw_bodies(draw: st.DrawFn) -> bytes:
    """Bytes no serialiser writes: duplicate keys, literals, BOMs, truncation, bad UTF-8."""
    valid = json.dumps(_chat_base()).encode()
    kind = draw(
        st.sampled_from(
            (
                "duplicate_model",
                "duplicate_messages",
                "duplicate_stream",
                "nan",
                "infinity",
                "huge_exponent",
                "huge_integer",
                "bom",
                "truncated",
                "trailing",
                "invalid_utf8",
                "surrogate_escape",
                "empty",
                "whitespace",
                "not_object",
                "nul",
                "comment",
            )
        )
    )
    inner = valid[1:-1]
    if kind == "duplicate_model":
        other = draw(st.sampled_from((b'"gpt-4o"', b"null", b"7", json.dumps(MODEL).encode())))
        first = draw(st.booleans())
        pair = b'"model": ' + other
        return b"{" + (pair + b", " + inner if first else inner + b", " + pair) + b"}"
    if kind == "duplicate_messages":
        return (
            b"{" + inner + b', "messages": ' + draw(st.sampled_from((b"[]", b'"x"', b"{}"))) + b"}"
        )
    if kind == "duplicate_stream":
        return (
            b'{"stream": true, '
            + inner
            + b', "stream": '
            + draw(st.sampled_from((b"1", b"false", b"true")))
            + b"}"
        )
    if kind in ("nan", "infinity", "huge_exponent", "huge_integer"):
        literal = {
            "nan": b"NaN",
            "infinity": b"-Infinity",
            "huge_exponent": b"1e99999",
            "huge_integer": b"9" * draw(st.integers(min_value=19, max_value=5000)),
        }[kind]
        field = draw(
            st.sampled_from((b"max_tokens", b"temperature", b"n", b"chaos_extra", b"seed"))
        )
        return b"{" + inner + b', "' + field + b'": ' + literal + b"}"
    if kind == "bom":
        return b"\xef\xbb\xbf" + valid
    if kind == "truncated":
        return valid[: draw(st.integers(min_value=0, max_value=len(valid) - 1))]
    if kind == "trailing":
        return valid + draw(st.sampled_from((b"x", b"{}", b"\x00", b" ]")))
    if kind == "invalid_utf8":
        bad = draw(st.sampled_from((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80")))
        return valid.replace(b"Hello", b"Hel" + bad + b"lo")
    if kind == "surrogate_escape":
        escape = draw(
            st.sampled_from((b"\\ud800", b"\\udc00", b"\\ud800\\ud800", b"\\ud83d\\ude00"))
        )
        return valid.replace(b"Hello", b"Hel" + escape + b"lo")
    if kind == "empty":
        return b""
    if kind == "whitespace":
        return b" \r\n\t"
    if kind == "not_object":
        return draw(st.sampled_from((b"[]", b"null", b"0", b'"x"', b"[" + valid + b"]")))
    if kind == "nul":
        return valid.replace(b"Hello", b"Hel\x00lo")
    return b"/* hi */" + valid


def hostile_bodies(chat: bool = True) -> st.SearchStrategy[bytes]:
    """Any of the above for one route."""
    if chat:
        return st.one_of(chat_bodies(), deep_bodies(True), raw_bodies())
    return st.one_of(completion_bodies(), deep_bodies(False))
