"""What the simulated model generates and when (pure).

An :class:`Answer` is dialect-neutral: a list of output tokens (each with an ID, a text piece, a
kind and the output step that produces it), grouped into the chunks the engine will send (the
groups are made as they are read, so a long stream groups its tokens as it is played), plus the
finish. :mod:`narwhal.sim._shapes` dresses it in a dialect.

Tool calls: a ``tool_calls`` directive, or a ``tool_choice`` that forces one (``"required"``
or a named function: one call unless the directive says how many). A forced call opens with a
``tool_name`` token (the chunk that announces the call's name) and ends with the end-of-sequence
token, as vLLM's structured-output tool calls do; otherwise (hermes) the name travels with the
first argument fragment and a ``</tool_call>`` token ends the calls.

Silent tokens show no text in a delta: ``tool_end`` (``</tool_call>``, which the tool parser
strips), and, in the vLLM dialect, ``marker`` (``<tool_call>`` before each hermes call and
``</think>`` after the reasoning, which vLLM's parsers strip), ``eos`` (the end-of-sequence
token that ends every natural answer, its text skipped as a special token) and ``hidden`` (a
token whose text the detokenizer holds back, such as the first bytes of a character split across
tokens; the ``hidden_tokens`` directive).
They are generated and counted like any other token; vLLM sends their IDs and logprobs.

Identity: ``id`` and tool-call IDs come from their own generator (``ids``), so that they differ
per request while the text stays a function of the seed and the body; vLLM's ``id`` is the
``X-Request-Id`` header (or the body's ``request_id``) when the request has one.

Time is counted in the request's output steps, not seconds: step 1 ends the prefill and produces
token 0, step ``k`` produces token ``k - 1`` (a request with no output still has step 1). The
engine turns steps into seconds: through a per-request clock, or by waiting for the step loop.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from typing import Literal

import attrs

from narwhal.sim import _text
from narwhal.sim._request import VLLM_VERSION, Dialect, SimRequest

__all__ = ["SILENT", "Answer", "Group", "Kind", "Token", "ToolCall", "generate"]

Kind = Literal[
    "reasoning", "content", "refusal", "tool_name", "tool", "tool_end", "eos", "hidden", "marker"
]
SILENT: frozenset[str] = frozenset({"tool_end", "eos", "hidden", "marker"})
"""The kinds of token that show no text in a delta."""

_TOOL_END_PIECE = "</tool_call>"
_TOOL_END_ID = 151658
_MARKER_IDS = {"<tool_call>": 151657, "</think>": 151668}
_CITIES = ("Paris", "Lyon", "Oslo", "Lima", "Kyoto", "Accra", "Quito", "Perth")
_DEFAULT_TOOL = "get_weather"
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@attrs.frozen
class Token:
    """One output token.

    Attributes:
        position: its index in the output (0 is the first output token).
        id: its token ID (>= 0).
        text: its text piece.
        kind: what it carries; ``tool_name`` announces a forced tool call's name (its text),
            ``tool_end`` closes the tool calls; the :data:`SILENT` kinds show no text (``text``
            is what a logprob entry names them).
        step: the output step that produces it (``position + 1``).
        call: the tool call it belongs to (kinds ``tool_name`` and ``tool``), else -1.
        opens_call: it is the first token of its tool call.
    """

    position: int
    id: int
    text: str
    kind: Kind
    step: int
    call: int = -1
    opens_call: bool = False

    @property
    def shown(self) -> str:
        """The text a delta shows for it ("" for a silent token)."""
        return "" if self.kind in SILENT else self.text


@attrs.frozen
class ToolCall:
    """A tool call's identity."""

    index: int
    id: str
    name: str


@attrs.frozen
class Group:
    """Consecutive tokens that travel in one chunk.

    Its visible tokens share one kind (and one tool call); silent tokens may travel with them.
    """

    tokens: tuple[Token, ...]
    lead: Token = attrs.field(init=False, eq=False, repr=False)
    """The first visible token (the first token when all are silent)."""
    kind: Kind = attrs.field(init=False, eq=False, repr=False)
    """The kind of its visible tokens (of the first token when all are silent)."""

    def __attrs_post_init__(self) -> None:
        # Read for every chunk a dialect shapes, several times: found once, not per read (a
        # plain loop: a generator per group cost a fifth of a long answer's generation).
        lead = self.tokens[0]
        for token in self.tokens:
            if token.kind not in SILENT:
                lead = token
                break
        object.__setattr__(self, "lead", lead)
        object.__setattr__(self, "kind", lead.kind)

    @property
    def step(self) -> int:
        """When the chunk can go: the step that produces its last token."""
        return self.tokens[-1].step

    @property
    def first(self) -> int:
        """Position of the group's first token."""
        return self.tokens[0].position

    @property
    def last(self) -> int:
        """Position of the group's last token."""
        return self.tokens[-1].position

    @property
    def text(self) -> str:
        """The text the group shows (silent tokens show none)."""
        return "".join(token.shown for token in self.tokens)

    @property
    def ids(self) -> list[int]:
        """The group's token IDs."""
        return [token.id for token in self.tokens]

    @property
    def call(self) -> int:
        """The tool call of the group (kinds ``tool_name`` and ``tool``), else -1."""
        return self.lead.call

    @property
    def opens_call(self) -> bool:
        """The group starts its tool call."""
        return self.lead.opens_call


@attrs.frozen
class Answer:
    """A generated answer, before any dialect shapes it.

    Attributes:
        request: what was asked.
        response_id: the response's ``id``.
        created: the response's ``created``.
        model: the model name answered with.
        fingerprint: the ``system_fingerprint``.
        prompt_tokens: the prompt's size.
        tokens: the output tokens in order.
        chunk_size: at most this many tokens travel in one chunk.
        first_alone: the first token travels alone (vLLM's ``stream_interval`` above 1).
        calls: the tool calls that got at least one token.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        stop_reason: vLLM's ``stop_reason`` (the stop string), else None.
        end_step: the step that produces the last token (the finish); 1 when there is none.
    """

    request: SimRequest
    response_id: str
    created: int
    model: str
    fingerprint: str
    prompt_tokens: int
    tokens: tuple[Token, ...]
    chunk_size: int
    first_alone: bool
    calls: tuple[ToolCall, ...]
    finish_reason: str
    stop_reason: str | None
    end_step: int

    def iter_groups(self) -> Iterator[Group]:
        """The tokens grouped into chunks, in order, each group made when it is asked for."""
        return _group(self.tokens, self.chunk_size, self.first_alone)

    @property
    def output_tokens(self) -> int:
        """Completion tokens, reasoning and silent tokens included."""
        return len(self.tokens)

    @property
    def reasoning_tokens(self) -> int:
        """How many output tokens are reasoning."""
        return sum(1 for token in self.tokens if token.kind == "reasoning")

    def text_of(self, kind: Kind) -> str:
        """The concatenated text of every token of ``kind``."""
        return "".join(token.text for token in self.tokens if token.kind == kind)

    @property
    def ids(self) -> list[int]:
        """Every output token ID."""
        return [token.id for token in self.tokens]

    def call_arguments(self, index: int) -> str:
        """The arguments string of tool call ``index`` (as far as it was generated)."""
        return "".join(t.text for t in self.tokens if t.kind == "tool" and t.call == index)


def _words(rng: random.Random, count: int, *, strip_first: bool = True) -> list[str]:
    """``count`` pieces of text: a word first (its space stripped), no doubled punctuation."""
    pieces: list[str] = []
    while len(pieces) < count:
        piece = rng.choice(_text.WORDS)
        punctuation = piece in (",", ".")
        if punctuation and (not pieces or pieces[-1] in (",", ".")):
            continue
        pieces.append(piece.lstrip() if strip_first and not pieces else piece)
    return pieces


def _hex(rng: random.Random, digits: int) -> str:
    return f"{rng.getrandbits(4 * digits):0{digits}x}"


def _tool_id(rng: random.Random, dialect: Dialect) -> str:
    if dialect == "vllm":
        return f"chatcmpl-tool-{_hex(rng, 16)}"
    if dialect == "sglang":
        return f"call_{_hex(rng, 24)}"
    return "call_" + "".join(rng.choice(_ALNUM) for _ in range(24))


def _response_id(
    rng: random.Random, dialect: Dialect, request: SimRequest, request_id: str | None
) -> str:
    prefix = "chatcmpl-" if request.route == "chat" else "cmpl-"
    if dialect == "sglang":
        return _hex(rng, 32)
    if dialect == "openai":
        return prefix + "".join(rng.choice(_ALNUM) for _ in range(29))
    # vLLM: the X-Request-Id header, else the body's request_id, else 16 random hex digits.
    chosen = request_id if request_id is not None else request.request_id
    return prefix + (chosen if chosen is not None else _hex(rng, 16))


def _fingerprint(dialect: Dialect, model: str) -> str:
    digest = _text.token_id(model) * 2654435761 % (1 << 40)
    if dialect == "openai":
        return f"fp_{digest:010x}"
    return f"vllm-{VLLM_VERSION}-{digest & 0xFFFFFFFF:08x}"


_Piece = tuple[str, Kind, int, bool]  # text, kind, tool call, opens the call
_EOS: _Piece = (_text.EOS_TEXT, "eos", -1, False)


def _body_pieces(
    rng: random.Random, ids: random.Random, request: SimRequest, dialect: Dialect, reasoning: int
) -> tuple[list[_Piece], list[ToolCall], int]:
    """The pieces after the reasoning, the tool calls, and the natural length of the answer.

    vLLM's answers end with the end-of-sequence token (an answer that ends on a stop string
    has none), mark the end of the reasoning and each hermes call's start, and carry the
    ``hidden_tokens`` directive's tokens; the natural length counts them all.
    """
    directives = request.directives
    chat = request.route == "chat"
    forced = request.forced_tools is not None
    vllm = dialect == "vllm"
    hidden = directives.hidden_tokens if vllm else 0
    end: list[_Piece] = [_EOS] if vllm and request.stop is None else []
    think: list[_Piece] = [("</think>", "marker", -1, False)] if vllm and reasoning else []
    count = directives.tool_calls or (1 if forced else 0)
    if chat and count:
        calls: list[ToolCall] = []
        pieces: list[_Piece] = list(think)
        names = request.tool_names or (_DEFAULT_TOOL,)
        for index in range(count):
            name = names[index % len(names)]
            calls.append(ToolCall(index, _tool_id(ids, dialect), name))
            city, days = rng.choice(_CITIES), rng.randint(1, 7)
            if forced:
                pieces.append((name, "tool_name", index, True))
            elif vllm:
                pieces.append(("<tool_call>", "marker", -1, False))
            fragments = ('{"city": "', city, '", "days": ', f"{days}}}")
            for number, fragment in enumerate(fragments):
                pieces.append((fragment, "tool", index, number == 0 and not forced))
        if vllm:
            # hermes: </tool_call>, then the end of the answer; a forced call: the end alone.
            pieces += [] if forced else [(_TOOL_END_PIECE, "tool_end", -1, False)]
            pieces.append(_EOS)
        else:
            pieces.append(("" if forced else _TOOL_END_PIECE, "tool_end", -1, False))
        return pieces, calls, reasoning + len(pieces) + hidden
    if chat and directives.refusal is not None:
        refusal = re.findall(r"\s*\S+", directives.refusal) or [directives.refusal]
        pieces = think + [(piece, "refusal", -1, False) for piece in refusal] + end
        return pieces, [], reasoning + len(pieces) + hidden
    if directives.output_tokens is not None:
        natural = directives.output_tokens
    else:
        natural = reasoning + rng.randint(8, 48)
        if request.ignore_eos and request.max_tokens is not None:
            # The end-of-sequence token does not end it: the cap does (finish "length").
            natural = max(natural, request.max_tokens + 1)
    # A completion continues the prompt, so its first word keeps its space (" Paris").
    room = natural - reasoning - hidden - len(think) - len(end)
    words = _words(rng, max(0, room), strip_first=chat)
    return think + [(word, "content", -1, False) for word in words] + end, [], natural


def _with_hidden(pieces: list[_Piece], count: int) -> list[_Piece]:
    """``count`` held-back tokens, one after each of the first visible pieces (any left over
    before the silent pieces that end the answer)."""
    if not count:
        return pieces
    tail = len(pieces)
    while tail and pieces[tail - 1][1] in SILENT:
        tail -= 1
    hidden: _Piece = ("", "hidden", -1, False)
    result: list[_Piece] = []
    left = count
    for piece in pieces[:tail]:
        result.append(piece)
        if piece[1] not in SILENT and left:
            result.append(hidden)
            left -= 1
    return result + [hidden] * left + pieces[tail:]


def _piece_id(text: str, kind: Kind, position: int) -> int:
    if kind == "tool_end":
        return _TOOL_END_ID if text == _TOOL_END_PIECE else _text.EOS_TOKEN_ID
    if kind == "eos":
        return _text.EOS_TOKEN_ID
    if kind == "marker":
        return _MARKER_IDS[text]
    if kind == "hidden":
        return _text.held_token_id(position)
    return _text.token_id(text)


def _joins(token: Token, current: list[Token]) -> bool:
    """Whether ``token`` may travel in the chunk being filled (its size limit aside).

    ``</tool_call>`` starts a chunk; other silent tokens travel with anything; a visible token
    joins visible tokens of its kind and call (a call's first token starts a chunk), or tokens
    held back before it (their text would show with it).
    """
    if token.kind == "tool_end":
        return False
    if token.kind in SILENT:
        return True
    lead = next((t for t in current if t.kind not in SILENT), None)
    if lead is None:
        return all(t.kind == "hidden" for t in current)
    return token.kind == lead.kind and token.call == lead.call and not token.opens_call


def _group(tokens: Sequence[Token], size: int, first_alone: bool) -> Iterator[Group]:
    made = 0
    current: list[Token] = []
    for token in tokens:
        limit = 1 if first_alone and not made else size
        if current and (len(current) >= limit or not _joins(token, current)):
            yield Group(tuple(current))
            made += 1
            current = []
        current.append(token)
    if current:
        yield Group(tuple(current))


def generate(
    request: SimRequest,
    *,
    dialect: Dialect,
    model: str,
    rng: random.Random,
    ids: random.Random,
    created: int,
    request_id: str | None = None,
) -> Answer:
    """Generate the answer to ``request``: deterministic given the generators' seeds.

    ``rng`` decides the text, ``ids`` the response and tool-call IDs; ``request_id`` is the
    request's ``X-Request-Id`` header (vLLM answers with it as the ``id``).

    Length: ``output_tokens`` if given (reasoning and silent tokens included), else the
    reasoning plus a seeded 8..48 tokens, or with ``ignore_eos`` as many as ``max_tokens``
    allows; tool calls and refusals take the tokens they need. ``max_tokens`` cuts the answer
    (finish ``length``).
    """
    directives = request.directives
    response_id = _response_id(ids, dialect, request, request_id)
    prompt_tokens = request.prompt_tokens
    wanted_reasoning = directives.reasoning_tokens if request.route == "chat" else 0
    if directives.output_tokens is not None and not (directives.tool_calls or directives.refusal):
        wanted_reasoning = min(wanted_reasoning, directives.output_tokens)
    reasoning_pieces: list[_Piece] = [
        (word, "reasoning", -1, False) for word in _words(rng, wanted_reasoning)
    ]
    body, calls, natural = _body_pieces(rng, ids, request, dialect, wanted_reasoning)
    pieces = _with_hidden(
        reasoning_pieces + body, directives.hidden_tokens if dialect == "vllm" else 0
    )
    total = natural if request.max_tokens is None else min(natural, request.max_tokens)
    pieces = pieces[:total]

    tokens = [
        Token(
            position=position,
            id=_piece_id(text, kind, position),
            text=text,
            kind=kind,
            step=position + 1,
            call=call,
            opens_call=opens,
        )
        for position, (text, kind, call, opens) in enumerate(pieces)
    ]
    emitted_calls = {token.call for token in tokens if token.kind in ("tool_name", "tool")}

    if natural > total:
        finish, stop_reason = "length", None
    elif emitted_calls and request.forced_tools == "named" and dialect != "sglang":
        finish, stop_reason = "stop", None  # vLLM and OpenAI: a forced named tool ends "stop"
    elif emitted_calls:
        finish, stop_reason = "tool_calls", None
    else:
        finish, stop_reason = "stop", request.stop

    if directives.tokens_per_chunk is not None:
        size, first_alone = directives.tokens_per_chunk, False
    else:
        size, first_alone = request.stream_interval, request.stream_interval > 1
    return Answer(
        request=request,
        response_id=response_id,
        created=created,
        model=model,
        fingerprint=_fingerprint(dialect, model),
        prompt_tokens=prompt_tokens,
        tokens=tuple(tokens),
        chunk_size=size,
        first_alone=first_alone,
        calls=tuple(call for call in calls if call.index in emitted_calls),
        finish_reason=finish,
        stop_reason=stop_reason,
        end_step=max(1, len(tokens)),
    )
