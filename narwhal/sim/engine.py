"""The simulated inference engine: pure planning, and the small async part that paces a plan.

:meth:`SimEngine.plan` turns a completion request into a :class:`SimPlan`: an immediate error
in the dialect's shape, or timed frames (``(delay_s, bytes)``) that make the SSE stream, or, when
``stream`` is false, one JSON body in the dialect's shape sent when the generation is over. The
plan is deterministic from the engine's seed and the request body. :class:`SimStream` plays a plan
in Trio time (virtual under ``trio.testing.MockClock``); the in-process transport
(:mod:`narwhal.sim.transport`) and the HTTP server (:mod:`narwhal.sim.server`) both use it.

Dialects (``reference/vllm-0.33-captures/``): ``vllm`` (0.33: finish on the last token's chunk,
``token_ids`` and ``prompt_token_ids`` with ``return_token_ids``, ``reasoning`` deltas, hermes
tool calls with two fragments in the first delta, nested errors with an int ``code``),
``sglang`` (0.5.23: explicit nulls, ``matched_stop``, ``usage: null`` on every chunk,
``reasoning_content``, flat errors, ``return_token_ids`` refused on streaming chat) and
``openai`` (finish in a separate empty-delta chunk, no token IDs, hidden reasoning).

Request fields honoured: ``model`` (another name is a 404), ``messages`` / ``prompt`` (sized at
about four characters per token; ID prompts count exactly), ``stream``, ``stream_options``
(``include_usage``, ``continuous_usage_stats``), ``max_tokens`` / ``max_completion_tokens``
(completions default to 16, as vLLM and OpenAI do), ``return_token_ids``, ``stream_interval``
(vLLM: first token alone, then ``k`` tokens a chunk), ``logprobs`` / ``top_logprobs``, ``n``
(only 1), ``stop`` (a natural end reports the first stop string as ``stop_reason`` /
``matched_stop``), ``tools`` (names for the tool calls).

Test directives: a body field ``"narwhal_sim": {...}`` (absent: normal behaviour), merged over the
engine's own defaults (:meth:`SimEngine.set_directives`). Unknown keys or bad values are a 400
whose ``param`` is ``narwhal_sim.<key>``.

``output_tokens: int``
    Exact number of generated tokens (``usage.completion_tokens``; reasoning included). Default:
    the reasoning tokens plus a seeded 8..48. ``max_tokens`` still cuts (finish ``length``).
``reasoning_tokens: int``
    Reasoning tokens before the content (chat): ``reasoning`` deltas (vLLM),
    ``reasoning_content`` (SGLang), hidden but timed and counted (OpenAI).
``tool_calls: int``
    Tool calls instead of content (chat): four argument tokens each, then one end token that
    shows no text (vLLM sends it in an empty-delta finish chunk). Finish ``tool_calls``. Names
    come from the request's ``tools``, else ``get_weather``.
``refusal: str``
    Refusal deltas instead of content (chat), one per word. Meant for the ``openai`` dialect; the
    others send them too if told.
``tokens_per_chunk: int``
    Tokens per chunk from the first one on (any dialect), overriding ``stream_interval``.
``ttft_s: float``, ``itl_s: float``
    Override the timing model's first-token delay and inter-token gap for this request (still
    multiplied by the time scale).
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
    * ``stall``: wait ``stall_s`` more before that chunk.
    * ``drop``: the connection breaks there (the transport raises
      ``httpx.RemoteProtocolError``; the server aborts the connection).
    * ``unsupported_field``: the chunk's delta (completions: choice) carries
      ``"audio": {"id": "x"}``; ``annotations``: it carries non-null ``annotations``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import attrs
import orjson
import trio

from narwhal.sim import _shapes
from narwhal.sim._answer import Answer, generate
from narwhal.sim._request import (
    Dialect,
    Route,
    SimFailure,
    parse_directives,
    parse_request,
    validation_error,
)
from narwhal.sim.timing import PROFILES, TimingModel

__all__ = [
    "DEFAULT_CREATED",
    "Frame",
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
_INFO_ROUTES = frozenset({"/health", "/v1/models", "/metrics"})
_SSE_HEADERS = (("content-type", "text/event-stream; charset=utf-8"),)
_JSON_HEADERS = (("content-type", "application/json"),)
_METRICS_HEADERS = (("content-type", "text/plain; version=0.0.4; charset=utf-8"),)
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
_INTERNAL_ERROR = SimFailure(500, "Internal server error", "InternalServerError", None)
_BUSY = SimFailure(
    503,
    "The engine is currently busy and cannot accept new requests. Please try again later or on "
    "a different instance.",
    "Service Unavailable",
    None,
)


class Frame(NamedTuple):
    """A piece of a response body and the time to wait before sending it."""

    delay_s: float
    data: bytes


@attrs.frozen
class SimPlan:
    """Everything the shells need to answer one HTTP request.

    Attributes:
        status: the HTTP status.
        headers: the response headers.
        frames: the body, in timed pieces (each delay counts from the previous piece, the first
            from the response head). A frame with empty data only carries time.
        head_delay_s: the wait before the response head (a non-streaming answer waits for the
            whole generation; streams and errors start at once).
        drop: after the frames, the connection breaks instead of ending.
        completion: it answers a completion route (counted as a stream by the shells).
        prompt_tokens: the prompt's size (0 for errors and info routes).
        output_tokens: the tokens generated (0 for errors and info routes).
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    frames: tuple[Frame, ...]
    head_delay_s: float = 0.0
    drop: bool = False
    completion: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0

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
        """Head delay plus every frame delay: when the last byte goes (inf for a stall)."""
        return self.head_delay_s + sum(frame.delay_s for frame in self.frames)


def _immediate(status: int, body: bytes, headers: tuple[tuple[str, str], ...]) -> SimPlan:
    return SimPlan(status=status, headers=headers, frames=(Frame(0.0, body),))


class SimConnectionDropped(Exception):
    """The plan says the connection breaks here; each shell translates it to its own form."""


StreamState = Literal["open", "completed", "closed_early", "dropped"]


class SimStream:
    """Plays a :class:`SimPlan` in Trio time; an async iterator over body pieces.

    Zero delays are not slept (so a zero-delay engine costs no scheduler round trips). The
    stream ends exactly once, in one of the :data:`StreamState` outcomes: ``completed`` (every
    piece was read), ``closed_early`` (closed with pieces unread), ``dropped`` (the plan broke the
    connection); each ``on_end`` callback then gets the outcome.
    """

    def __init__(
        self, plan: SimPlan, on_end: list[Callable[[StreamState], None]] | None = None
    ) -> None:
        self.plan = plan
        self.state: StreamState = "open"
        self._on_end = on_end or []
        self._index = 0

    async def wait_head(self) -> None:
        """Wait until the response head may go.

        Raises:
            SimConnectionDropped: the connection breaks before any response.
        """
        try:
            if self.plan.head_delay_s > 0:
                await trio.sleep(self.plan.head_delay_s)
        except BaseException:
            self.close()
            raise
        if self.plan.drop and not self.plan.frames:
            self._end("dropped")
            raise SimConnectionDropped("the simulated engine broke the connection")

    def __aiter__(self) -> SimStream:
        return self

    async def __anext__(self) -> bytes:
        frames = self.plan.frames
        while self.state == "open" and self._index < len(frames):
            delay, data = frames[self._index]
            if delay > 0:
                await trio.sleep(delay)
            self._index += 1
            if data:
                return data
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
        if self._index < len(self.plan.frames):
            self._end("closed_early")
        else:
            self._end("dropped" if self.plan.drop else "completed")

    async def aclose(self) -> None:
        """Async form of :meth:`close` (what Quart and httpx call)."""
        self.close()

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
        running: completion responses being sent now (vLLM's ``num_requests_running``).
        waiting: requests queued (always 0 for a timing model without a queue).
        kv_tokens: prompt and output tokens of the running requests.
        kv_cache_usage: ``kv_tokens`` over the KV capacity, at most 1.
        completed: streams the reader received to the end.
        closed_early: streams the reader closed before the end.
        dropped: streams whose connection the plan broke.
    """

    requests: int
    errors: int
    running: int
    waiting: int
    kv_tokens: int
    kv_cache_usage: float
    completed: int
    closed_early: int
    dropped: int


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
        timing: how long things take; default the ``h100-llama3-8b`` profile.
        seed: with the request body, decides every generated answer.
        name: a label for logs and tests.
        kv_capacity_tokens: KV-cache capacity in tokens, for ``vllm:kv_cache_usage_perc``.
    """

    model: str
    dialect: Dialect = attrs.field(
        default="vllm", validator=attrs.validators.in_(("vllm", "sglang", "openai"))
    )
    timing: TimingModel = attrs.field(default=None, converter=_default_timing)
    seed: int = 0
    name: str = "sim"
    kv_capacity_tokens: int = attrs.field(default=262144, validator=attrs.validators.gt(0))
    _directives: Mapping[str, Any] = attrs.field(init=False, factory=dict)
    _requests: int = attrs.field(init=False, default=0)
    _errors: int = attrs.field(init=False, default=0)
    _running: int = attrs.field(init=False, default=0)
    _kv_tokens: int = attrs.field(init=False, default=0)
    _outcomes: dict[str, int] = attrs.field(init=False, factory=dict)

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

    # --- pure planning ------------------------------------------------------------------------

    def respond(
        self, method: str, path: str, raw: bytes = b"", *, created: int | None = None
    ) -> SimPlan:
        """Answer any HTTP request: the info routes, the completion routes, 404 and 405."""
        if path in _ROUTES:
            if method != "POST":
                return self._not_found(method, path, 405)
            return self.plan_bytes(path, raw, created=created)
        if path in _INFO_ROUTES:
            if method not in ("GET", "HEAD"):
                return self._not_found(method, path, 405)
            if path == "/health":
                return _immediate(200, b"", ())
            if path == "/metrics":
                return _immediate(200, self.metrics_text().encode(), _METRICS_HEADERS)
            return _immediate(200, self.models_body(created=created), _JSON_HEADERS)
        return self._not_found(method, path, 404)

    def plan_bytes(self, path: str, raw: bytes, *, created: int | None = None) -> SimPlan:
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
        return self.plan(path, body, created=created)

    def plan(self, path: str, body: Mapping[str, Any], *, created: int | None = None) -> SimPlan:
        """Plan the answer to a completion request (deterministic from the seed and the body).

        Args:
            path: ``/v1/chat/completions`` or ``/v1/completions`` (others are a 404 plan).
            body: the request's JSON object.
            created: the ``created`` timestamp to report; default :data:`DEFAULT_CREATED`.

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
            )
        except SimFailure as failure:
            return self._failure_plan(failure)
        directives = request.directives
        if directives.fault in ("http_500", "http_503", "http_400"):
            return self._failure_plan(self._fault_failure(directives.fault, route))
        answer = generate(
            request,
            dialect=self.dialect,
            model=self.model,
            timing=self.timing,
            rng=random.Random(_seed_material(self.seed, path, body)),
            created=DEFAULT_CREATED if created is None else created,
        )
        if request.stream:
            return self._stream_plan(answer)
        return self._body_plan(answer)

    def models_body(self, *, created: int | None = None) -> bytes:
        """The ``/v1/models`` answer: an OpenAI list holding the one model."""
        entry: dict[str, Any] = {
            "id": self.model,
            "object": "model",
            "created": DEFAULT_CREATED if created is None else created,
            "owned_by": {"vllm": "vllm", "sglang": "sglang", "openai": "system"}[self.dialect],
        }
        if self.dialect == "vllm":
            entry.update(root=self.model, parent=None, max_model_len=131072)
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
        return "\n".join(lines) + "\n"

    # --- the async part -----------------------------------------------------------------------

    def stream(
        self, plan: SimPlan, on_end: Callable[[StreamState], None] | None = None
    ) -> SimStream:
        """A :class:`SimStream` playing ``plan``, counted as running until it ends."""
        callbacks: list[Callable[[StreamState], None]] = []
        if plan.completion:
            tokens = plan.prompt_tokens + plan.output_tokens
            self._running += 1
            self._kv_tokens += tokens

            def finished(state: StreamState) -> None:
                self._running -= 1
                self._kv_tokens -= tokens
                self._outcomes[state] = self._outcomes.get(state, 0) + 1

            callbacks.append(finished)
        if on_end is not None:
            callbacks.append(on_end)
        return SimStream(plan, callbacks)

    def statistics(self) -> SimEngineStatistics:
        """A snapshot of the engine's counters."""
        return SimEngineStatistics(
            requests=self._requests,
            errors=self._errors,
            running=self._running,
            waiting=0,
            kv_tokens=self._kv_tokens,
            kv_cache_usage=min(1.0, self._kv_tokens / self.kv_capacity_tokens),
            completed=self._outcomes.get("completed", 0),
            closed_early=self._outcomes.get("closed_early", 0),
            dropped=self._outcomes.get("dropped", 0),
        )

    # --- plans --------------------------------------------------------------------------------

    def _not_found(self, method: str, path: str, status: int) -> SimPlan:
        body = _shapes.route_not_found(self.dialect, method, path, status=status)
        return _immediate(status, body, _JSON_HEADERS)

    def _failure_plan(self, failure: SimFailure) -> SimPlan:
        self._errors += 1
        body = _shapes.error_body(self.dialect, failure)
        return attrs.evolve(_immediate(failure.status, body, _JSON_HEADERS), completion=True)

    def _fault_failure(self, fault: str, route: Route) -> SimFailure:
        if fault == "http_500":
            return _INTERNAL_ERROR
        if fault == "http_503":
            return _BUSY
        if self.dialect == "vllm":
            field = "messages" if route == "chat" else "prompt"
            return validation_error("missing", f"body.{field}", "Field required", {"": None})
        return SimFailure(400, "bad request (narwhal_sim fault http_400)", "BadRequestError", None)

    def _stream_plan(self, answer: Answer) -> SimPlan:
        chunks = _shapes.stream_chunks(self.dialect, answer)
        directives = answer.request.directives
        fault = directives.fault
        if fault in _TOKEN_FAULTS or fault in _FIELD_FAULTS:
            _modify_chunk(chunks[_modified_index(chunks, directives.fault_at)], fault)
        timed = [(chunk.at_s, _sse(chunk.obj)) for chunk in chunks]
        point = _fault_index(chunks, directives.fault_at)
        at = chunks[min(point, len(chunks) - 1)].at_s
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
        frames = _relative(timed)
        if fault == "stall":
            delay, data = frames[point]
            frames[point] = Frame(delay + directives.stall_s, data)
        return SimPlan(
            status=200,
            headers=_SSE_HEADERS,
            frames=tuple(frames),
            drop=drop,
            completion=True,
            prompt_tokens=answer.prompt_tokens,
            output_tokens=answer.output_tokens,
        )

    def _body_plan(self, answer: Answer) -> SimPlan:
        directives = answer.request.directives
        fault = directives.fault
        body = _shapes.response_body(self.dialect, answer)
        head_delay = answer.end_s
        status = 200
        if fault in _TOKEN_FAULTS or fault in _FIELD_FAULTS:
            _modify_body(body, fault, answer, self.dialect)
        data = orjson.dumps(body)
        drop = False
        if fault in ("error_frame", "truncate", "drop"):
            head_delay = _time_at(answer, directives.fault_at)
            if fault == "error_frame":
                status, data = 500, _shapes.error_body(self.dialect, _INTERNAL_ERROR)
            elif fault == "truncate":
                data = data[: len(data) // 2]
            else:
                drop = True
        elif fault == "non_json":
            data = b"{this is not json"
        elif fault == "stall":
            head_delay += directives.stall_s
        return SimPlan(
            status=status,
            headers=_JSON_HEADERS,
            frames=() if drop else (Frame(0.0, data),),
            head_delay_s=head_delay,
            drop=drop,
            completion=True,
            prompt_tokens=answer.prompt_tokens,
            output_tokens=answer.output_tokens,
        )


# --- fault placement --------------------------------------------------------------------------


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _relative(timed: list[tuple[float, bytes]]) -> list[Frame]:
    frames = []
    previous = 0.0
    for at, data in timed:
        frames.append(Frame(max(0.0, at - previous), data))
        previous = max(previous, at)
    return frames


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


def _time_at(answer: Answer, fault_at: int) -> float:
    if fault_at == 0 or not answer.tokens:
        return answer.first_token_s
    if fault_at < len(answer.tokens):
        return answer.tokens[fault_at].at_s
    return answer.end_s
