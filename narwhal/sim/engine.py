"""The simulated inference engine: pure planning, and the small async part that paces a plan.

:meth:`SimEngine.plan` turns a completion request into a :class:`SimPlan`: an immediate error
in the dialect's shape, or frames that make the SSE stream, or, when ``stream`` is false, one
JSON body in the dialect's shape sent when the generation is over. The plan is deterministic from
the engine's seed and the request body. It generates the answer's tokens; a stream's chunks are
shaped, serialised and timed as the stream is played (:class:`LazyFrames`), so that a long
answer does not hold the Trio loop the in-process engines share with everything else.
:class:`SimStream` plays a plan in Trio time (virtual under ``trio.testing.MockClock``); the
in-process transport (:mod:`narwhal.sim.transport`) and the HTTP server
(:mod:`narwhal.sim.server`) both use it.

When things happen. Each frame goes out after an *output step* of its request (step 1 ends the
prefill and yields the first token, step ``k`` yields token ``k - 1``; :attr:`Frame.step`), and
the engine's timing model decides when steps end:

* Under a :class:`~narwhal.sim.timing.StepTiming` (the GPU profiles), the engine runs a
  continuous-batching step loop (:mod:`narwhal.sim.batching` has the rules): a request joins the
  FCFS waiting queue when its stream starts, is admitted into the running batch (at most
  ``max_num_seqs``) when its prompt plus its whole output fits in the free KV, is prefilled in
  chunks sharing each step's ``max_num_batched_tokens`` with the decodes (one token each), then
  decodes one token a step. A step costs ``decode_step_ms(B, K)`` plus ``prefill_chunk_ms`` for
  each chunk, plus ``prefill_base_ms`` when it prefills and nothing decodes, times the time
  scale, the seeded jitter and the run-time slowdown (:meth:`SimEngine.set_slowdown`). A
  request's first token comes out at the end of the step that completes its prefill, each later
  token at the end of each following step; its frames go out then. A stream that ends early
  leaves the batch and frees its KV at once. The loop is a Trio system task started on the first
  request of each Trio run; with nothing to do it waits on an event, so the autojump clock can
  jump.
* Under a per-request model (:class:`~narwhal.sim.timing.LinearTiming`, e.g. ``zero``), and for
  any request with a ``ttft_s`` or ``itl_s`` directive, the plan fixes each step's time when it
  is made (:attr:`Frame.delay_s`), whatever else runs; the slowdown multiplies those delays as
  they are played. Such requests do not enter the batch (they count as running while their
  stream is open).

:attr:`Frame.delay_s` is always filled, from the per-request clock (for a step-model request,
the one of a request alone on an idle engine), so :attr:`SimPlan.duration_s` reads the same.

Run-time switches, as methods and as routes of every shell: ``POST /sim/directives`` (a JSON
object: the engine-wide directives, :meth:`SimEngine.set_directives`), ``POST /sim/slowdown``
(``{"factor": 2.0}``: step and frame times are multiplied by 2 from now on,
:meth:`SimEngine.set_slowdown`; with ``"after_s": 30``, from 30 seconds on,
:meth:`SimEngine.schedule_slowdown`), ``GET /sim/state`` (:meth:`SimEngine.statistics` as JSON)
and ``GET /sim/ledger`` (the engine's step ledger, :class:`narwhal.sim.ledger.SimLedger`, when one
is set on its step loop, as ``narwhal sim --ledger`` does; otherwise a 404 in the dialect's error
shape saying to start it with ``--ledger``).

Dialects: ``vllm`` (0.32, from real answers in ``tests/sim/captures/`` and vLLM's source: finish
on the last token's chunk, ``token_ids`` and ``prompt_token_ids`` with ``return_token_ids``,
every natural answer ending with the end-of-sequence token, which shows no text, tokens whose
text is held back sent only for their IDs or logprobs, ``reasoning`` deltas, hermes tool calls
with two fragments in the first delta, nested errors with an int ``code``, errors found while
generating a stream sent in band, ``X-Request-Id`` as the ``id``, ``max_model_len`` and
``--api-key`` enforced), ``sglang`` (0.5.23, ``reference/vllm-0.33-captures/``: explicit nulls,
``matched_stop``, ``usage: null`` on every chunk,
``reasoning_content``, flat errors, ``return_token_ids`` refused on streaming chat) and
``openai`` (finish in a separate empty-delta chunk, no token IDs, hidden reasoning).

Request fields honoured: ``model`` (another name is a 404), ``messages`` / ``prompt`` (sized at
about four characters per token; ID prompts count exactly), ``stream``, ``stream_options``
(``include_usage``, ``continuous_usage_stats``), ``max_tokens`` / ``max_completion_tokens``
(completions default to 16, as vLLM and OpenAI do), ``return_token_ids``, ``stream_interval``
(vLLM: first token alone, then ``k`` tokens a chunk), ``logprobs`` / ``top_logprobs`` (vLLM: at
most 20), ``prompt_logprobs``, ``echo``, ``request_id`` and ``add_generation_prompt`` (vLLM),
``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty`` (checked as vLLM does),
``n`` (only 1), ``stop`` (a natural end reports the first stop string as ``stop_reason`` /
``matched_stop``), ``tools`` (names for the tool calls), ``tool_choice`` (``"required"`` or a
named function force one tool call in the dialect's shape: for vLLM, the name alone in a first
delta, then argument deltas with ``content: null``, and the finish ``tool_calls`` for
``required``, ``stop`` for a named function, as OpenAI; a name that is not among the ``tools``
is vLLM's 400; ``auto`` answers in text).

Engine-side admission (vLLM's ``--max-num-queued-tokens``, :attr:`SimEngine.max_num_queued_tokens`),
as vLLM 0.32's ``AsyncLLM.check_admission`` does it: the API server counts the whole prompt of
every request it holds that has not produced its first token yet (waiting, or prefilling however
far: progress inside the prefill is not counted, nor prefix-cache hits), *not* counting the new
request; when that count has reached the limit (``>=``), the request is refused with a 503 and
vLLM's ``MaxQueuedTokensError`` body, ``{"error": {"message": "The engine has reached its prefill
token backlog limit. Please try again later or on a different instance.", "type": "Service
Unavailable", "param": null, "code": 503}}``, with no ``Retry-After``. The check comes after the
model check (a wrong model is still a 404) and before tokenization (a too-long prompt is still a
503 then); below the limit, a request of any size is admitted. Refusals count in
``vllm:admission_rejections_total{reason="max_num_queued_tokens"}`` (``/metrics``) and in
:attr:`SimEngineStatistics.rejected_queued_tokens`. A per-request-timed response counts until its
first token's time on its own clock.

Identity: ``created`` is the real time in the shells (the server and the in-process transport);
:meth:`SimEngine.plan` called directly uses :data:`DEFAULT_CREATED` unless told.

Test directives: a body field ``"narwhal_sim": {...}`` (absent: normal behaviour), merged over the
engine's own defaults (:meth:`SimEngine.set_directives`). Unknown keys or bad values are a 400
whose ``param`` is ``narwhal_sim.<key>``.

``output_tokens: int``
    Exact number of generated tokens (``usage.completion_tokens``; reasoning and the vLLM
    dialect's silent tokens included, so an answer of 3 that ends naturally is two words and the
    end of sequence). Default: the reasoning tokens plus a seeded 8..48. ``max_tokens`` still
    cuts (finish ``length``).
``reasoning_tokens: int``
    Reasoning tokens before the content (chat): ``reasoning`` deltas (vLLM),
    ``reasoning_content`` (SGLang), hidden but timed and counted (OpenAI).
``tool_calls: int``
    Tool calls instead of content (chat): four argument tokens each, then one end token that
    shows no text (vLLM: each call opens with ``<tool_call>``, and ``</tool_call>`` and the end
    of sequence close them, all three without text). Finish ``tool_calls``. Names come from the
    request's ``tools``, else ``get_weather``.
``hidden_tokens: int``
    vLLM dialect: this many tokens whose text vLLM holds back (a character split across
    tokens), one after each of the first visible tokens. They count, and travel in
    ``{"delta": {}, "token_ids": [...]}`` chunks with ``return_token_ids`` (with logprobs when
    asked, ``text: ""`` in completions); otherwise vLLM sends nothing for them.
``refusal: str``
    Refusal deltas instead of content (chat), one per word. Meant for the ``openai`` dialect; the
    others send them too if told.
``tokens_per_chunk: int``
    Tokens per chunk from the first one on (any dialect), overriding ``stream_interval``.
``ttft_s: float``, ``itl_s: float``
    Override the timing model's first-token delay and inter-token gap for this request (still
    multiplied by the time scale). Either one takes the request out of the step loop: its timing
    is fixed per request, the other gap coming from the model's answer for an idle engine.
``prompt_tokens: int``
    Force the prompt's size (usage, prefill time and ``prompt_token_ids``).
``ignore_token_ids: bool``
    vLLM before 0.10.2: ``return_token_ids`` is ignored and no ``token_ids`` /
    ``prompt_token_ids`` keys exist at all.
``fault: str`` with ``fault_at: int`` (default 0) and ``stall_s: float`` (default forever)
    ``fault_at`` is the output position where the fault strikes: just before the chunk carrying
    that token (or the finish, when past the end); 0 is before the first output, role chunk
    included. Faults:

    * ``http_500``, ``http_503``, ``http_400``: an immediate error response in the dialect's
      shape (the vLLM 400 is the pydantic ``body.messages`` / ``body.prompt`` kind).
    * ``error_frame``: an in-band ``data: {"error": {...}}`` then ``data: [DONE]``
      (non-streaming: a 500 after the delay).
    * ``malformed_token_ids`` (a Boolean in ``token_ids``), ``missing_token_ids`` (``null``),
      ``negative_token_id`` (-1): on the chunk carrying that token, in any dialect.
    * ``non_json``: a ``data:`` line that is not JSON before that chunk (the stream goes on).
    * ``truncate``: the stream ends there, no finish and no ``[DONE]``.
    * ``no_done``: everything but the ``[DONE]``.
    * ``stall``: wait ``stall_s`` more before that chunk (the engine goes on generating: in the
      step loop, the request's tokens are made on time and only its delivery waits).
    * ``drop``: the connection breaks there (the transport raises
      ``httpx.RemoteProtocolError``; the server aborts the connection).
    * ``unsupported_field``: the chunk's delta (completions: choice) carries
      ``"audio": {"id": "x"}``; ``annotations``: it carries non-null ``annotations``.
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import islice
from typing import Any, Literal, NamedTuple, overload

import attrs
import orjson
import trio

from narwhal.sim import _shapes
from narwhal.sim._answer import Answer, generate
from narwhal.sim._request import (
    DEFAULT_MAX_MODEL_LEN,
    VLLM_VERSION,
    Dialect,
    Route,
    SimFailure,
    parse_directives,
    parse_request,
    validation_error,
)
from narwhal.sim._steps import StepLedger, StepLoop
from narwhal.sim.ledger import SimLedger
from narwhal.sim.timing import PROFILES, StepTiming, TimingModel

__all__ = [
    "DEFAULT_CREATED",
    "Frame",
    "LazyFrames",
    "SimConnectionDropped",
    "SimEngine",
    "SimEngineStatistics",
    "SimPlan",
    "SimStream",
    "StreamState",
]

DEFAULT_CREATED = 1767225600
"""The ``created`` of plans made without a clock (2026-01-01T00:00:00Z)."""

_ROUTES: Mapping[str, Route] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_INFO_ROUTES = frozenset({"/health", "/v1/models", "/metrics", "/version"})
_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""The paths vLLM's ``--api-key`` guards (``/health``, ``/metrics``, ``/version`` stay open)."""
_UNAUTHORIZED = b'{"error":"Unauthorized"}'
"""vLLM's 401 body: not the error envelope of its other answers."""
_ADMIN_ROUTES: Mapping[str, str] = {
    "/sim/directives": "POST",
    "/sim/slowdown": "POST",
    "/sim/state": "GET",
    "/sim/ledger": "GET",
}
_SSE_HEADERS = (("content-type", "text/event-stream; charset=utf-8"),)
_JSON_HEADERS = (("content-type", "application/json"),)
_METRICS_HEADERS = (("content-type", "text/plain; version=1.0.0; charset=utf-8"),)
_DONE = b"data: [DONE]\n\n"
_NOT_JSON = b"data: {this is not json\n\n"
_AUDIO = {"id": "x"}
_ANNOTATIONS = [
    {
        "type": "url_citation",
        "url_citation": {
            "url": "https://example.com",
            "title": "x",
            "start_index": 0,
            "end_index": 1,
        },
    }
]
_TOKEN_FAULTS = frozenset({"malformed_token_ids", "missing_token_ids", "negative_token_id"})
_FIELD_FAULTS = frozenset({"unsupported_field", "annotations"})
_LAZY_FAULTS: frozenset[str | None] = frozenset({None, "no_done"})
"""The faults (None: none) whose stream plans are shaped as they are played; the others strike
at a chunk's index, so their plans shape every chunk up front."""
_BLOCK = 64
"""Chunks a lazy stream shapes, serialises and times at a time."""
_QUEUED_TOKENS_FULL = SimFailure(
    503,
    "The engine has reached its prefill token backlog limit. Please try again later or on a "
    "different instance.",
    "Service Unavailable",
    None,
)
_INTERNAL_ERROR = SimFailure(500, "Internal server error", "InternalServerError", None)
_BUSY = SimFailure(
    503,
    "The engine is currently busy and cannot accept new requests. Please try again later or on "
    "a different instance.",
    "Service Unavailable",
    None,
)


class Frame(NamedTuple):
    """A piece of a response body and when it may be sent.

    Attributes:
        delay_s: the wait from the previous piece (the first: from the response head) on the
            plan's per-request clock; what a per-request plan sleeps.
        data: the bytes (empty: the frame only carries time).
        step: the request's output step after which it may go (0: none); what a batched plan
            waits for.
        hold_s: extra wait after that step (a stall), included in ``delay_s``.
    """

    delay_s: float
    data: bytes
    step: int = 0
    hold_s: float = 0.0


class LazyFrames(Sequence[Frame]):
    """A streamed plan's frames, made as they are read rather than when the plan is made.

    Iterating shapes, serialises and times the chunks as it goes, 64 chunks at a time, so a long
    answer costs its stream a little at each refill instead of its planner the whole answer at
    once (the in-process engines share one Trio loop with everything else). Each pass makes the
    same frames afresh (the plan is deterministic) and keeps none; ``len()``, indexing and
    ``==`` make them all once and keep them (for tests and whole-body readers).

    Attributes:
        shaped: chunks shaped so far, over every pass (what a test counts).
    """

    def __init__(self, dialect: Dialect, answer: Answer, clock: list[float], *, done: bool):
        self._dialect: Dialect = dialect
        self._answer = answer
        self._clock = clock
        self._done = done
        self._all: tuple[Frame, ...] | None = None
        self.shaped = 0

    def __iter__(self) -> Iterator[Frame]:
        if self._all is not None:
            return iter(self._all)
        return self._make()

    def __len__(self) -> int:
        return len(self._frames())

    @overload
    def __getitem__(self, index: int) -> Frame: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Frame, ...]: ...

    def __getitem__(self, index: int | slice) -> Frame | tuple[Frame, ...]:
        return self._frames()[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self._frames() == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LazyFrames({self._answer.output_tokens} tokens, {self.shaped} chunks shaped)"

    def _frames(self) -> tuple[Frame, ...]:
        if self._all is None:
            self._all = tuple(self._make())
        return self._all

    def _make(self) -> Iterator[Frame]:
        return _timed_frames(self._pairs(), self._clock, None, 0.0)

    def _pairs(self) -> Iterator[tuple[int, bytes]]:
        """``(step, data)`` for each chunk, then the ``[DONE]``, a block at a time."""
        chunks = _shapes.iter_stream_chunks(self._dialect, self._answer)
        step = 0
        while block := list(islice(chunks, _BLOCK)):
            self.shaped += len(block)
            pairs = [(chunk.step, _sse(chunk.obj)) for chunk in block]
            step = pairs[-1][0]
            yield from pairs
        if self._done:
            yield step, _DONE


@attrs.frozen
class SimPlan:
    """Everything the shells need to answer one HTTP request.

    Attributes:
        status: the HTTP status.
        headers: the response headers.
        frames: the body, in timed pieces (each delay counts from the previous piece, the first
            from the response head). A frame with empty data only carries time. A stream
            without a fault that strikes at a chunk has :class:`LazyFrames` (made as they are
            read); the others a tuple.
        head_delay_s: the wait before the response head (a non-streaming answer waits for the
            whole generation; streams and errors start at once).
        head_step: the output step the head waits for (0: none), as :attr:`Frame.step`.
        head_hold_s: extra wait after that step (a stall), included in ``head_delay_s``.
        batched: the engine's step loop times it (frames wait for steps, not delays).
        drop: after the frames, the connection breaks instead of ending.
        completion: it answers a completion route (counted as a stream by the shells).
        prompt_tokens: the prompt's size (0 for errors and info routes).
        output_tokens: the tokens generated (0 for errors and info routes).
        first_token_s: when the first token comes on the per-request clock (0 for errors).
        request_id: the ``X-Request-Id`` the request came with, which tags it in the step
            loop's ledger (``None``: none; errors and info routes have none).
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    frames: Sequence[Frame]
    head_delay_s: float = 0.0
    head_step: int = 0
    head_hold_s: float = 0.0
    batched: bool = False
    drop: bool = False
    completion: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token_s: float = 0.0
    request_id: str | None = None

    @property
    def body(self) -> bytes:
        """The whole body, frames joined (for tests and non-streaming callers)."""
        return b"".join(frame.data for frame in self.frames)

    @property
    def streaming(self) -> bool:
        """The body is an SSE stream."""
        return any(value.startswith("text/event-stream") for _, value in self.headers)

    @property
    def duration_s(self) -> float:
        """Head delay plus every frame delay: when the last byte goes (inf for a stall).

        For a batched plan, this is the time alone on an idle engine.
        """
        return self.head_delay_s + sum(frame.delay_s for frame in self.frames)


def _immediate(status: int, body: bytes, headers: tuple[tuple[str, str], ...]) -> SimPlan:
    return SimPlan(status=status, headers=headers, frames=(Frame(0.0, body),))


class SimConnectionDropped(Exception):
    """The plan says the connection breaks here; each shell translates it to its own form."""


StreamState = Literal["open", "completed", "closed_early", "dropped"]


class SimStream:
    """Plays a :class:`SimPlan` in Trio time; an async iterator over body pieces.

    A batched plan's frames wait for the request's output steps (``progress``, from the
    engine's step loop); the others sleep their delays, times ``pace()`` (the engine's
    slowdown). Zero delays are not slept (so a zero-delay engine costs no scheduler round trips).
    It reads the frames as it plays them, one ahead (so it knows when the last has gone). The
    stream ends exactly once, in one of the :data:`StreamState` outcomes: ``completed``
    (every piece was read), ``closed_early`` (closed with pieces unread), ``dropped`` (the plan
    broke the connection); each ``on_end`` callback then gets the outcome.
    """

    def __init__(
        self,
        plan: SimPlan,
        on_end: list[Callable[[StreamState], None]] | None = None,
        *,
        progress: Callable[[int], Awaitable[None]] | None = None,
        pace: Callable[[], float] | None = None,
    ) -> None:
        self.plan = plan
        self.state: StreamState = "open"
        self._on_end = on_end or []
        self._progress = progress
        self._pace = pace
        self._frames: Iterator[Frame] | None = None
        self._next: Frame | None = None
        """The next frame to play (read ahead by one, so the stream knows when it is over)."""

    async def wait_head(self) -> None:
        """Wait until the response head may go.

        Raises:
            SimConnectionDropped: the connection breaks before any response.
        """
        plan = self.plan
        try:
            await self._wait(plan.head_delay_s, plan.head_step, plan.head_hold_s)
        except BaseException:
            self.close()
            raise
        if plan.drop and self._peek() is None:
            self._end("dropped")
            raise SimConnectionDropped("the simulated engine broke the connection")

    def __aiter__(self) -> SimStream:
        return self

    async def __anext__(self) -> bytes:
        while self.state == "open" and (frame := self._peek()) is not None:
            await self._wait(frame.delay_s, frame.step, frame.hold_s)
            if self.state != "open":
                break
            self._next = None
            if frame.data:
                return frame.data
        if self.state != "open":
            raise StopAsyncIteration
        if self.plan.drop:
            self._end("dropped")
            raise SimConnectionDropped("the simulated engine broke the connection")
        self._end("completed")
        raise StopAsyncIteration

    def close(self) -> None:
        """Stop the stream.

        Closed before its last piece went out, it was closed early; after, it is complete (the
        reader need not wait for the end of the body once it has every byte), or dropped when the
        plan breaks the connection there.
        """
        if self.state != "open":
            return
        if self._peek() is not None:
            self._end("closed_early")
        else:
            self._end("dropped" if self.plan.drop else "completed")

    async def aclose(self) -> None:
        """Async form of :meth:`close` (what Quart and httpx call)."""
        self.close()

    def _peek(self) -> Frame | None:
        """The next frame to play (None: none left); a lazy plan makes it here."""
        if self._next is None:
            if self._frames is None:
                self._frames = iter(self.plan.frames)
            self._next = next(self._frames, None)
        return self._next

    async def _wait(self, delay_s: float, step: int, hold_s: float) -> None:
        if self._progress is not None:
            await self._progress(step)
            if hold_s > 0:
                await trio.sleep(hold_s)
        elif delay_s > 0:
            await trio.sleep(delay_s if self._pace is None else delay_s * self._pace())

    def _end(self, state: StreamState) -> None:
        self.state = state
        for callback in self._on_end:
            callback(state)


@attrs.frozen
class SimEngineStatistics:
    """A snapshot of a :class:`SimEngine`.

    Attributes:
        requests: completion requests planned.
        errors: of those, answered with an HTTP error.
        running: requests being generated (vLLM's ``num_requests_running``): in the step
            loop's batch, plus the per-request-timed responses being sent.
        waiting: requests queued for the batch (vLLM's ``num_requests_waiting``).
        prefilling: of the running requests in the batch, those still prefilling.
        kv_tokens: KV held: the batch's reservations (prompt plus whole output of each running
            request) plus the prompt and output tokens of the per-request-timed responses.
        kv_capacity_tokens: the KV capacity.
        kv_cache_usage: ``kv_tokens`` over the KV capacity, at most 1.
        steps: steps the step loop has run (0 without one).
        slowdown: the factor in force (:meth:`SimEngine.set_slowdown`,
            :meth:`SimEngine.schedule_slowdown`).
        completed: streams the reader received to the end.
        closed_early: streams the reader closed before the end.
        dropped: streams whose connection the plan broke.
        queued_prompt_tokens: what ``--max-num-queued-tokens`` counts: the whole prompts of the
            requests before their first token (see the module doc).
        rejected_queued_tokens: requests refused by :attr:`SimEngine.max_num_queued_tokens`.
    """

    requests: int
    errors: int
    running: int
    waiting: int
    prefilling: int
    kv_tokens: int
    kv_capacity_tokens: int
    kv_cache_usage: float
    steps: int
    slowdown: float
    completed: int
    closed_early: int
    dropped: int
    queued_prompt_tokens: int = 0
    rejected_queued_tokens: int = 0


_PER_REQUEST_KV_CAPACITY = 262144


def _admin_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        raise SimFailure(400, "the body must be a JSON object", "BadRequestError", None)
    return body


def _slowdown_factor(factor: float) -> float:
    number = isinstance(factor, int | float) and not isinstance(factor, bool)
    if not (number and 0 < factor < math.inf):
        raise ValueError(f"the slowdown factor must be a number > 0, got {factor!r}")
    return float(factor)


def _default_timing(timing: TimingModel | None) -> TimingModel:
    return PROFILES["h100-llama3-8b"] if timing is None else timing


def _seed_material(seed: int, path: str, body: Mapping[str, Any]) -> bytes:
    try:
        encoded = orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except TypeError:
        encoded = repr(body).encode()
    return f"{seed}|{path}|".encode() + encoded


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@attrs.define(eq=False)
class SimEngine:
    """A simulated inference engine serving one model in one dialect.

    Attributes:
        model: the model name it serves (another ``model`` in a request is a 404).
        dialect: ``vllm``, ``sglang`` or ``openai``: the response shapes.
        timing: how long things take; default the ``h100-llama3-8b`` profile (the simulator's
            calibrated type, :mod:`narwhal.sim.calibration`). A
            :class:`~narwhal.sim.timing.StepTiming` runs the continuous-batching step loop.
        seed: with the request body, decides every generated answer.
        name: a label for logs and tests.
        kv_capacity_tokens: KV-cache capacity in tokens; default the step profile's (262144
            for a per-request timing model, where it only scales ``vllm:kv_cache_usage_perc``).
        max_model_len: the context length (vLLM dialect): reported in ``/v1/models``; a longer
            prompt, or a larger ``max_tokens``, is vLLM's 400, and the output is capped at what
            the prompt leaves.
        api_key: as vLLM's ``--api-key``: every ``/v1`` route then wants
            ``Authorization: Bearer <key>`` and answers vLLM's 401 without it (None: open).
        reasoning_parser: as a vLLM started with ``--reasoning-parser`` (vLLM dialect): chat
            usage reports ``completion_tokens_details: {"reasoning_tokens": N}`` instead of null.
        max_num_queued_tokens: as vLLM's ``--max-num-queued-tokens`` (since 0.29): once the
            prompts of the requests before their first token add up to this many tokens, a new
            completion request is refused with vLLM's 503 (the module doc has the rule and the
            body; in any dialect, in that dialect's error shape). None: no limit. vLLM's
            documentation suggests about target TTFT x prefill throughput.
    """

    model: str
    dialect: Dialect = attrs.field(
        default="vllm", validator=attrs.validators.in_(("vllm", "sglang", "openai"))
    )
    timing: TimingModel = attrs.field(default=None, converter=_default_timing)
    seed: int = 0
    name: str = "sim"
    kv_capacity_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0))
    )
    max_model_len: int = attrs.field(
        default=DEFAULT_MAX_MODEL_LEN, validator=attrs.validators.gt(0)
    )
    api_key: str | None = None
    reasoning_parser: bool = False
    max_num_queued_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(0))
    )
    _directives: Mapping[str, Any] = attrs.field(init=False, factory=dict)
    _requests: int = attrs.field(init=False, default=0)
    _errors: int = attrs.field(init=False, default=0)
    _running: int = attrs.field(init=False, default=0)
    _kv_tokens: int = attrs.field(init=False, default=0)
    _outcomes: dict[str, int] = attrs.field(init=False, factory=dict)
    _slowdown: float = attrs.field(init=False, default=1.0)
    _schedule: list[tuple[float, float]] = attrs.field(init=False, factory=list)
    _steps: StepLoop | None = attrs.field(init=False, default=None)
    # Per-request-timed responses before their first token: key -> (Trio time of it, prompt).
    _unprefilled: dict[int, tuple[float, int]] = attrs.field(init=False, factory=dict)
    _stream_keys: int = attrs.field(init=False, default=0)
    _rejected_queued_tokens: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.timing, StepTiming):
            self._steps = StepLoop(
                self.timing,
                kv_capacity_tokens=self.kv_capacity_tokens,
                name=self.name,
                pace=self._pace,
            )

    # --- configuration ------------------------------------------------------------------------

    def set_directives(self, directives: Mapping[str, Any] | None) -> None:
        """Apply test directives to every request from now on (request directives still win).

        This switches faults at run time, including for requests the router makes itself.

        Raises:
            ValueError: an unknown directive or a bad value.
        """
        try:
            parse_directives(directives)
        except SimFailure as failure:
            raise ValueError(f"{failure.param}: {failure.message}") from None
        self._directives = dict(directives or {})

    @property
    def directives(self) -> Mapping[str, Any]:
        """The engine-wide directives (see :meth:`set_directives`)."""
        return dict(self._directives)

    def watch_steps(self, ledger: StepLedger | None) -> bool:
        """Tell ``ledger`` of every request the step loop takes and every step it runs (the
        benchmark's account of engine time; None: stop). ``False``, and nothing set, for a
        per-request timing model (no steps)."""
        if self._steps is None:
            return False
        self._steps.ledger = ledger
        return True

    def set_slowdown(self, factor: float) -> None:
        """Multiply simulated durations by ``factor`` from now on (1 restores the profile).

        In the step loop it multiplies each step's time from the next step on; for
        per-request-timed responses, each frame's delay as it is played (stalls included).
        Changes scheduled by :meth:`schedule_slowdown` and still to come are cancelled.

        Raises:
            ValueError: ``factor`` is not a finite number > 0.
        """
        self._slowdown = _slowdown_factor(factor)
        self._schedule.clear()

    def schedule_slowdown(self, at: float, factor: float) -> None:
        """From Trio time ``at`` on, multiply simulated durations by ``factor``.

        ``at`` is on the Trio clock (``trio.current_time()``: under ``MockClock``, virtual
        seconds since the run began). Changes take effect in time order, each as
        :meth:`set_slowdown` would at that instant (the step running then keeps its time); a
        later :meth:`set_slowdown` cancels the changes still to come. This is how an engine
        turns slower half way through a benchmark.

        Raises:
            ValueError: ``factor`` is not a finite number > 0, or ``at`` is not finite.
        """
        value = _slowdown_factor(factor)
        if not (isinstance(at, int | float) and math.isfinite(at)):
            raise ValueError(f"the slowdown time must be a finite number, got {at!r}")
        self._schedule.append((float(at), value))
        self._schedule.sort(key=lambda change: change[0])

    @property
    def slowdown(self) -> float:
        """The factor in force now (:meth:`set_slowdown`, :meth:`schedule_slowdown`)."""
        return self._pace()

    # --- pure planning ------------------------------------------------------------------------

    def respond(
        self,
        method: str,
        path: str,
        raw: bytes = b"",
        *,
        created: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> SimPlan:
        """Answer any HTTP request: the info, admin and completion routes, 404 and 405.

        ``headers`` are the request's, looked up by lower-case name (a case-insensitive mapping
        such as ``httpx.Headers`` does): ``authorization`` (with :attr:`api_key`) and
        ``x-request-id`` (vLLM's response ``id``). The admin routes (``/sim/...``, see the module
        doc) act on the engine at once.
        """
        headers = headers or {}
        if self.api_key is not None and not self._authorized(method, path, headers):
            return _immediate(401, _UNAUTHORIZED, _JSON_HEADERS)
        if path in _ADMIN_ROUTES:
            wanted = _ADMIN_ROUTES[path]
            if method != wanted and not (method == "HEAD" and wanted == "GET"):
                return self._not_found(method, path, 405)
            return self._admin(path, raw)
        if path in _ROUTES:
            if method != "POST":
                return self._not_found(method, path, 405)
            return self.plan_bytes(
                path, raw, created=created, request_id=headers.get("x-request-id")
            )
        if path in _INFO_ROUTES and (path != "/version" or self.dialect == "vllm"):
            if method not in ("GET", "HEAD"):
                return self._not_found(method, path, 405)
            if path == "/health":
                return _immediate(200, b"", ())
            if path == "/metrics":
                return _immediate(200, self.metrics_text().encode(), _METRICS_HEADERS)
            if path == "/version":
                return _immediate(200, orjson.dumps({"version": VLLM_VERSION}), _JSON_HEADERS)
            return _immediate(200, self.models_body(created=created), _JSON_HEADERS)
        return self._not_found(method, path, 404)

    def _authorized(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        """vLLM's check: a guarded path wants ``Authorization: Bearer <key>`` (OPTIONS passes)."""
        if method == "OPTIONS" or not path.startswith(_GUARDED_PREFIXES):
            return True
        scheme, _, key = (headers.get("authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            key.encode(), str(self.api_key).encode()
        )

    def plan_bytes(
        self,
        path: str,
        raw: bytes,
        *,
        created: int | None = None,
        request_id: str | None = None,
    ) -> SimPlan:
        """:meth:`plan` for a raw body: invalid JSON is the engine's 400."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._requests += 1
            failure = validation_error(
                "json_invalid",
                f"body.{exc.pos}",
                "JSON decode error",
                {},
                {"error": exc.msg},
            )
            return self._failure_plan(failure)
        if not isinstance(body, dict):
            self._requests += 1
            failure = validation_error(
                "model_attributes_type",
                "body",
                "Input should be a valid dictionary or object to extract fields from",
                body,
            )
            return self._failure_plan(failure)
        return self.plan(path, body, created=created, request_id=request_id)

    def plan(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        created: int | None = None,
        request_id: str | None = None,
    ) -> SimPlan:
        """Plan the answer to a completion request.

        The answer is a function of the seed and the body; its ``id`` and tool-call IDs also
        depend on the engine's name and on how many requests it has planned, so identical
        requests get distinct IDs (two engines with the same seed and name share the sequence).

        Args:
            path: ``/v1/chat/completions`` or ``/v1/completions`` (others are a 404 plan).
            body: the request's JSON object.
            created: the ``created`` timestamp to report; default :data:`DEFAULT_CREATED`.
            request_id: the ``X-Request-Id`` header: the vLLM dialect answers with
                ``chatcmpl-<it>`` (``cmpl-<it>``) as the ``id``, and it tags the request in
                the step loop's ledger (:attr:`SimPlan.request_id`).

        Returns:
            The plan: an error, a timed SSE stream, or a non-streaming JSON body.
        """
        route = _ROUTES.get(path)
        if route is None:
            return self._not_found("POST", path, 404)
        self._requests += 1
        try:
            request = parse_request(
                route,
                body,
                dialect=self.dialect,
                model=self.model,
                default_directives=self._directives,
                max_model_len=self.max_model_len,
                reasoning_parser=self.reasoning_parser,
                admit=None if self.max_num_queued_tokens is None else self._admit,
            )
        except SimFailure as failure:
            if failure.in_band:
                return self._in_band_plan(failure)
            return self._failure_plan(failure)
        directives = request.directives
        if directives.fault in ("http_500", "http_503", "http_400"):
            return self._failure_plan(self._fault_failure(directives.fault, route))
        answer = generate(
            request,
            dialect=self.dialect,
            model=self.model,
            rng=random.Random(_seed_material(self.seed, path, body)),
            # The IDs differ per request (a real engine's are random), still from the seed.
            ids=random.Random(f"{self.seed}|{self.name}|{self._requests}"),
            created=DEFAULT_CREATED if created is None else created,
            request_id=request_id,
        )
        overridden = directives.ttft_s is not None or directives.itl_s is not None
        batched = self._steps is not None and not overridden
        clock = self._clock(answer)
        if request.stream:
            return self._stream_plan(answer, clock, batched, request_id)
        return self._body_plan(answer, clock, batched, request_id)

    def models_body(self, *, created: int | None = None) -> bytes:
        """The ``/v1/models`` answer: an OpenAI list holding the one model.

        vLLM's model card adds ``root`` (the model's path; here its name), ``parent``,
        ``max_model_len`` and one ``permission`` object.
        """
        when = DEFAULT_CREATED if created is None else created
        entry: dict[str, Any] = {
            "id": self.model,
            "object": "model",
            "created": when,
            "owned_by": {"vllm": "vllm", "sglang": "sglang", "openai": "system"}[self.dialect],
        }
        if self.dialect == "vllm":
            digits = random.Random(f"{self.seed}|{self.name}|{when}").getrandbits(64)
            permission = {
                "id": f"modelperm-{digits:016x}",
                "object": "model_permission",
                "created": when,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
            entry.update(
                root=self.model,
                parent=None,
                max_model_len=self.max_model_len,
                permission=[permission],
            )
        return orjson.dumps({"object": "list", "data": [entry]})

    def metrics_text(self) -> str:
        """Prometheus text with vLLM's gauge names, from the current statistics."""
        stats = self.statistics()
        labels = f'{{engine="0",model_name="{_label(self.model)}"}}'
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             float(stats.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             float(stats.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             stats.kv_cache_usage),
        )  # fmt: skip
        lines = []
        for name, help_text, value in gauges:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} gauge",
                f"{name}{labels} {value!r}",
            ]
        # vLLM's frontend admission counter: labelled by model and reason, no engine label.
        name = "vllm:admission_rejections_total"
        lines += [
            f"# HELP {name} Number of admission attempts rejected by a queue limit, by reason.",
            f"# TYPE {name} counter",
        ]
        model = _label(self.model)
        for reason, count in (
            ("max_num_queued_reqs", 0),
            ("max_num_queued_tokens", stats.rejected_queued_tokens),
        ):
            lines.append(f'{name}{{model_name="{model}",reason="{reason}"}} {float(count)!r}')
        return "\n".join(lines) + "\n"

    # --- the async part -----------------------------------------------------------------------

    def stream(
        self, plan: SimPlan, on_end: Callable[[StreamState], None] | None = None
    ) -> SimStream:
        """A :class:`SimStream` playing ``plan``; a completion counts until it ends.

        A batched plan joins the step loop's queue now; its stream ending takes it out of the
        batch (if it is still there) and frees its KV.
        """
        callbacks: list[Callable[[StreamState], None]] = []
        progress: Callable[[int], Awaitable[None]] | None = None
        if plan.batched and self._steps is not None:
            steps = self._steps
            seq = steps.submit(plan.prompt_tokens, plan.output_tokens, plan.request_id)
            progress = partial(steps.wait_for, seq)

            def left(state: StreamState) -> None:
                steps.abort(seq)
                self._outcomes[state] = self._outcomes.get(state, 0) + 1

            callbacks.append(left)
        elif plan.completion:
            tokens = plan.prompt_tokens + plan.output_tokens
            self._running += 1
            self._kv_tokens += tokens
            key = self._stream_keys
            self._stream_keys += 1
            if plan.prompt_tokens and plan.status == 200:
                try:
                    first = trio.current_time() + plan.first_token_s * self._pace()
                except RuntimeError:  # outside Trio: no clock to count it on
                    pass
                else:
                    self._unprefilled[key] = (first, plan.prompt_tokens)

            def finished(state: StreamState) -> None:
                self._running -= 1
                self._kv_tokens -= tokens
                self._unprefilled.pop(key, None)
                self._outcomes[state] = self._outcomes.get(state, 0) + 1

            callbacks.append(finished)
        if on_end is not None:
            callbacks.append(on_end)
        return SimStream(plan, callbacks, progress=progress, pace=self._pace)

    def statistics(self) -> SimEngineStatistics:
        """A snapshot of the engine's counters and of its batch."""
        running, kv_tokens = self._running, self._kv_tokens
        waiting = prefilling = steps = 0
        capacity = self.kv_capacity_tokens or _PER_REQUEST_KV_CAPACITY
        if self._steps is not None:
            batch = self._steps.batcher.statistics()
            running += batch.running
            kv_tokens += batch.kv_tokens
            waiting, prefilling, steps = batch.waiting, batch.prefilling, batch.steps
            capacity = batch.kv_capacity_tokens
        return SimEngineStatistics(
            requests=self._requests,
            errors=self._errors,
            running=running,
            waiting=waiting,
            prefilling=prefilling,
            kv_tokens=kv_tokens,
            kv_capacity_tokens=capacity,
            kv_cache_usage=min(1.0, kv_tokens / capacity),
            steps=steps,
            slowdown=self._pace(),
            completed=self._outcomes.get("completed", 0),
            closed_early=self._outcomes.get("closed_early", 0),
            dropped=self._outcomes.get("dropped", 0),
            queued_prompt_tokens=self.queued_prompt_tokens(),
            rejected_queued_tokens=self._rejected_queued_tokens,
        )

    def queued_prompt_tokens(self) -> int:
        """What ``--max-num-queued-tokens`` counts now: the whole prompts of the requests that
        have not produced their first token (the step loop's waiting and prefilling requests,
        and the per-request-timed responses before their first token's time)."""
        total = 0 if self._steps is None else self._steps.batcher.prefill_tokens
        if self._unprefilled:
            try:
                now = trio.current_time()
            except RuntimeError:  # outside Trio: no time has passed
                now = -math.inf
            for key, (first, tokens) in list(self._unprefilled.items()):
                if first > now:
                    total += tokens
                else:
                    del self._unprefilled[key]
        return total

    def _admit(self) -> None:
        """vLLM's ``check_admission`` for ``max_num_queued_tokens`` (the module doc).

        Raises:
            SimFailure: vLLM's ``MaxQueuedTokensError`` 503.
        """
        limit = self.max_num_queued_tokens
        if limit is not None and self.queued_prompt_tokens() >= limit:
            self._rejected_queued_tokens += 1
            raise _QUEUED_TOKENS_FULL

    def _pace(self) -> float:
        """The slowdown in force, applying the scheduled changes whose time has come."""
        schedule = self._schedule
        if schedule:
            try:
                now = trio.current_time()
            except RuntimeError:  # outside Trio: no time has passed
                return self._slowdown
            while schedule and schedule[0][0] <= now:
                self._slowdown = schedule.pop(0)[1]
        return self._slowdown

    # --- admin routes -------------------------------------------------------------------------

    def _admin(self, path: str, raw: bytes) -> SimPlan:
        if path == "/sim/ledger":
            return self._ledger_plan()
        try:
            if path == "/sim/directives":
                self._set_directives_from(raw)
            elif path == "/sim/slowdown":
                self._set_slowdown_from(raw)
        except SimFailure as failure:
            return _immediate(400, _shapes.error_body(self.dialect, failure), _JSON_HEADERS)
        state = {
            "name": self.name,
            "model": self.model,
            **attrs.asdict(self.statistics()),
            "directives": dict(self._directives),
        }
        return _immediate(200, orjson.dumps(state), _JSON_HEADERS)

    def _ledger_plan(self) -> SimPlan:
        ledger = None if self._steps is None else self._steps.ledger
        if not isinstance(ledger, SimLedger):
            failure = SimFailure(
                404,
                "this engine keeps no ledger: start it with `narwhal sim --ledger` (a profile "
                "with a step loop)",
                "NotFoundError",
                None,
            )
            return _immediate(404, _shapes.error_body(self.dialect, failure), _JSON_HEADERS)
        return _immediate(200, orjson.dumps(ledger.as_json()), _JSON_HEADERS)

    def _set_directives_from(self, raw: bytes) -> None:
        body = _admin_body(raw)
        try:
            self.set_directives(body)
        except ValueError as exc:
            param, _, message = str(exc).partition(": ")
            raise SimFailure(400, message, "BadRequestError", param) from None

    def _set_slowdown_from(self, raw: bytes) -> None:
        body = _admin_body(raw)
        factor: Any = body.get("factor")  # any JSON value: set_slowdown checks it
        after: Any = body.get("after_s")
        try:
            if after is None:
                self.set_slowdown(factor)
            else:
                valid = isinstance(after, int | float) and not isinstance(after, bool)
                if not (valid and 0 <= after < math.inf):
                    raise SimFailure(
                        400,
                        f"after_s must be a number >= 0, got {after!r}",
                        "BadRequestError",
                        "after_s",
                    )
                self.schedule_slowdown(trio.current_time() + after, factor)
        except ValueError as exc:
            raise SimFailure(400, str(exc), "BadRequestError", "factor") from None

    # --- plans --------------------------------------------------------------------------------

    def _not_found(self, method: str, path: str, status: int) -> SimPlan:
        body = _shapes.route_not_found(self.dialect, method, path, status=status)
        return _immediate(status, body, _JSON_HEADERS)

    def _failure_plan(self, failure: SimFailure) -> SimPlan:
        self._errors += 1
        body = _shapes.error_body(self.dialect, failure)
        return attrs.evolve(_immediate(failure.status, body, _JSON_HEADERS), completion=True)

    def _in_band_plan(self, failure: SimFailure) -> SimPlan:
        """vLLM's answer to a stream that fails once generating: 200, an error frame, [DONE]."""
        self._errors += 1
        frames = (Frame(0.0, _shapes.error_frame(self.dialect, failure)), Frame(0.0, _DONE))
        return SimPlan(status=200, headers=_SSE_HEADERS, frames=frames, completion=True)

    def _fault_failure(self, fault: str, route: Route) -> SimFailure:
        if fault == "http_500":
            return _INTERNAL_ERROR
        if fault == "http_503":
            return _BUSY
        if self.dialect == "vllm":
            field = "messages" if route == "chat" else "prompt"
            return validation_error("missing", f"body.{field}", "Field required", {"": None})
        return SimFailure(400, "bad request (narwhal_sim fault http_400)", "BadRequestError", None)

    def _clock(self, answer: Answer) -> list[float]:
        """When each output step ends on the per-request clock (``clock[0]`` is the arrival)."""
        directives = answer.request.directives
        timing = self.timing
        scale = timing.time_scale
        prompt = answer.prompt_tokens
        if directives.ttft_s is not None:
            now = directives.ttft_s * scale
        else:
            now = timing.first_token_delay_s(prompt)
        clock = [0.0, now]
        for position in range(1, answer.end_step):
            if directives.itl_s is not None:
                now += directives.itl_s * scale
            else:
                now += timing.inter_token_delay_s(position, prompt_tokens=prompt)
            clock.append(now)
        return clock

    def _stream_plan(
        self, answer: Answer, clock: list[float], batched: bool, request_id: str | None
    ) -> SimPlan:
        directives = answer.request.directives
        fault = directives.fault
        if fault in _LAZY_FAULTS:
            # Nothing strikes at a chunk: the stream shapes its chunks as it plays them.
            return SimPlan(
                status=200,
                headers=_SSE_HEADERS,
                frames=LazyFrames(self.dialect, answer, clock, done=fault != "no_done"),
                batched=batched,
                completion=True,
                prompt_tokens=answer.prompt_tokens,
                output_tokens=answer.output_tokens,
                first_token_s=clock[1],
                request_id=request_id,
            )
        chunks = _shapes.stream_chunks(self.dialect, answer)
        if fault in _TOKEN_FAULTS or fault in _FIELD_FAULTS:
            _modify_chunk(chunks[_modified_index(chunks, directives.fault_at)], fault)
        timed = [(chunk.step, _sse(chunk.obj)) for chunk in chunks]
        point = _fault_index(chunks, directives.fault_at)
        at = chunks[min(point, len(chunks) - 1)].step
        done, drop = True, False
        if fault == "error_frame":
            timed = [*timed[:point], (at, _shapes.error_frame(self.dialect, _INTERNAL_ERROR))]
        elif fault in ("truncate", "drop"):
            timed = [*timed[:point], (at, b"")]
            done, drop = False, fault == "drop"
        elif fault == "non_json":
            timed.insert(point, (at, _NOT_JSON))
        elif fault == "no_done":
            done = False
        if done:
            timed.append((timed[-1][0], _DONE))
        stall = point if fault == "stall" else None
        return SimPlan(
            status=200,
            headers=_SSE_HEADERS,
            frames=tuple(_timed_frames(timed, clock, stall, directives.stall_s)),
            batched=batched,
            drop=drop,
            completion=True,
            prompt_tokens=answer.prompt_tokens,
            output_tokens=answer.output_tokens,
            first_token_s=clock[1],
            request_id=request_id,
        )

    def _body_plan(
        self, answer: Answer, clock: list[float], batched: bool, request_id: str | None
    ) -> SimPlan:
        directives = answer.request.directives
        fault = directives.fault
        body = _shapes.response_body(self.dialect, answer)
        head_step, hold = answer.end_step, 0.0
        status = 200
        if fault in _TOKEN_FAULTS or fault in _FIELD_FAULTS:
            _modify_body(body, fault, answer, self.dialect)
        data = orjson.dumps(body)
        drop = False
        if fault in ("error_frame", "truncate", "drop"):
            head_step = _step_at(answer, directives.fault_at)
            if fault == "error_frame":
                status, data = 500, _shapes.error_body(self.dialect, _INTERNAL_ERROR)
            elif fault == "truncate":
                data = data[: len(data) // 2]
            else:
                drop = True
        elif fault == "non_json":
            data = b"{this is not json"
        elif fault == "stall":
            hold = directives.stall_s
        return SimPlan(
            status=status,
            headers=_JSON_HEADERS,
            frames=() if drop else (Frame(0.0, data, head_step),),
            head_delay_s=clock[head_step] + hold,
            head_step=head_step,
            head_hold_s=hold,
            batched=batched,
            drop=drop,
            completion=True,
            prompt_tokens=answer.prompt_tokens,
            output_tokens=answer.output_tokens,
            first_token_s=clock[1],
            request_id=request_id,
        )


# --- fault placement --------------------------------------------------------------------------


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _timed_frames(
    timed: Iterable[tuple[int, bytes]], clock: list[float], stall: int | None, stall_s: float
) -> Iterator[Frame]:
    """Frames from ``(step, data)`` pairs: delays from the clock, a stall before ``stall``."""
    previous = 0.0
    for index, (step, data) in enumerate(timed):
        at = clock[step]
        hold = stall_s if index == stall else 0.0
        yield Frame(max(0.0, at - previous) + hold, data, step, hold)
        previous = max(previous, at)


def _fault_index(chunks: list[_shapes.Chunk], fault_at: int) -> int:
    """Where a positional fault strikes: before the first chunk carrying ``fault_at``."""
    if fault_at == 0:
        return 0
    for index, chunk in enumerate(chunks):
        if chunk.last_position >= fault_at or chunk.finish:
            return index
    return len(chunks) - 1


def _modified_index(chunks: list[_shapes.Chunk], fault_at: int) -> int:
    """The chunk a modifying fault changes: the one carrying ``fault_at``, else the last output."""
    carrying = [i for i, chunk in enumerate(chunks) if chunk.last_position >= 0]
    for index in carrying:
        if chunks[index].last_position >= fault_at:
            return index
    if carrying:
        return carrying[-1]
    return next(i for i, chunk in enumerate(chunks) if chunk.finish)


def _bad_ids(fault: str, ids: list[int]) -> list[Any] | None:
    if fault == "missing_token_ids":
        return None
    return [True if fault == "malformed_token_ids" else -1, *ids[1:]]


def _modify_chunk(chunk: _shapes.Chunk, fault: str) -> None:
    choice = chunk.obj["choices"][0]
    if fault in _TOKEN_FAULTS:
        choice["token_ids"] = _bad_ids(fault, chunk.ids)
        return
    target = choice.get("delta", choice)
    if fault == "unsupported_field":
        target["audio"] = dict(_AUDIO)
    else:
        target["annotations"] = [dict(a) for a in _ANNOTATIONS]


def _modify_body(body: dict[str, Any], fault: str, answer: Answer, dialect: Dialect) -> None:
    choice = body["choices"][0]
    if fault in _TOKEN_FAULTS:
        chat = answer.request.route == "chat"
        key = "response_token_ids" if dialect == "sglang" and chat else "token_ids"
        choice[key] = _bad_ids(fault, answer.ids)
        return
    target = choice.get("message", choice)
    if fault == "unsupported_field":
        target["audio"] = dict(_AUDIO)
    else:
        target["annotations"] = [dict(a) for a in _ANNOTATIONS]


def _step_at(answer: Answer, fault_at: int) -> int:
    """The step a positional fault waits for: the one producing token ``fault_at``."""
    if fault_at == 0 or not answer.tokens:
        return 1
    if fault_at < len(answer.tokens):
        return answer.tokens[fault_at].step
    return answer.end_step
