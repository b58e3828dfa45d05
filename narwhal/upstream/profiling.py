"""Engine profiling: probe requests of known size fit an engine's forecast before it serves.

An engine is profiled when it joins (after its token-ID probe, before it is eligible) and when
its drift asks for it (:mod:`narwhal.scheduling.drift`). The measurement, on an idle engine:

* **prefill**: one ``/v1/completions`` request per prompt size in :data:`PROMPT_SIZES` (clipped
  to the engine's ``max_model_len`` and to one step's ``max_num_batched_tokens``), twice each,
  with token-ID prompts (so that the size is exact whatever the tokenizer) of fresh random IDs
  (so that no prefix cache serves them) and ``max_tokens: 1``. The time to the first output
  event, the fastest of the two, is the observed time to first token.
* **decode**: at each batch size of :data:`DECODE_BATCHES` (clipped to the profile's
  ``max_num_seqs``), that many streamed requests at once, of :data:`DECODE_TOKENS` tokens each
  (``ignore_eos`` for the vLLM and SGLang dialects, which the simulator honours too), whose
  inter-token gaps are measured per token. The batches run one after the other, so each
  times a decode step over that many sequences. An engine that streams several tokens a chunk
  whatever the request asks gives too few gaps: the batch is asked again for enough tokens
  (:func:`coalesced_tokens`), and so are the batches after it.

The fit: ``observed = latency + scale * compute`` by least squares over the prompt sizes
(``compute`` is the profile's time for the prompt alone on an idle engine, what the forecast
itself computes), with the latency at least 0. The decode step is fitted the same way, per
batch size, on the median gap per token: ``observed = decode_scale * (a_d + decode_slope *
grows)``, where ``a_d`` is the profile's fixed decode cost and ``grows`` what its step adds for
that batch and context (``s_d * B + k_d * K``), so that an engine whose step grows faster with
the batch than its profile's is predicted right at a full batch as well as at one sequence
(:meth:`~narwhal.scheduling.forecast.PrefillForecast.decode_step_s`). The result goes to
:meth:`~narwhal.scheduling.forecast.PrefillForecast.calibrate`.

A probe that errs, times out or returns invalid token IDs (where the engine provides them;
also a ``prompt_token_ids`` of another length than the prompt sent) fails the profiling:
:class:`ProfilingFailed` carries a short detail, safe for ``/ready``.

Probes go straight to the engine's client: the router's books (offered, completed) never see
them. They run only while the engine holds no placed request, and the engine is held out of
placement while they run (reason ``profiling``), so they neither meet live traffic nor need a
correction for it: an engine that drifts while busy is penalised in placement until it is idle
enough to be re-profiled, or taken out of placement by severe drift, which drains it.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Mapping, Sequence

import attrs
import orjson
import trio

from narwhal.errors import EngineRejectedRequest, NarwhalError
from narwhal.scheduling.engines import Engine
from narwhal.scheduling.profiles import EngineProfile
from narwhal.upstream.client import ChunkEvent, DoneEvent, EngineClient, ErrorFrameEvent

__all__ = [
    "DECODE_BATCHES",
    "DECODE_TOKENS",
    "PROBE_USER",
    "PROMPT_SIZES",
    "ProfileFit",
    "ProfilingFailed",
    "coalesced_tokens",
    "fit_decode",
    "fit_prefill",
    "probe_sizes",
    "profile_engine",
]

log = logging.getLogger(__name__)

PROMPT_SIZES = (64, 512, 2048)
"""The prompt sizes of the prefill probes, in tokens."""

DECODE_TOKENS = 8
"""The output tokens asked of the decode probe."""

DECODE_BATCHES = (1, 8, 32)
"""The batch sizes of the decode probes: that many requests at once, each batch in turn."""

PROBE_USER = "narwhal-profiling"
"""The ``user`` field of every profiling probe, which tells them apart in an engine's logs."""

_DECODE_PROMPT = 64
_ROUNDS = 2  # probes per prompt size; the fastest counts
_MIN_GAPS = 3
_MOST_DECODE_TOKENS = 256  # a decode probe of an engine that coalesces its stream asks at most
_NOISE_RISE = 3  # the decode step's rise over the batches, in its gaps' deviations, to fit
# Token IDs every vocabulary holds, past the special tokens that lead most of them: a small
# model's vocabulary may be only a few thousand (the real-engine tier's has 2,048), and vLLM
# refuses an ID outside it with a 400.
_ID_RANGE = (100, 1000)


class ProfilingFailed(Exception):
    """A profiling measurement failed; ``detail`` is safe to show in ``/ready``."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@attrs.frozen
class ProfileFit:
    """What a profiling measured and fitted.

    Attributes:
        scale: observed over profiled prefill compute.
        latency_s: time to first token that does not depend on the prompt.
        decode_scale: observed over profiled decode step.
        decode_slope: how much steeper than the profile's the decode step grows with the batch.
        prefill: ``(prompt tokens, observed time to first token)`` per size.
        gaps: the inter-token gaps the decode fit used.
        decode: ``(batch size, median gap per token)`` per decode batch measured.
    """

    scale: float
    latency_s: float
    decode_scale: float
    decode_slope: float
    prefill: tuple[tuple[int, float], ...]
    gaps: int
    decode: tuple[tuple[int, float], ...] = ()


def probe_sizes(profile: EngineProfile, max_model_len: int | None) -> tuple[int, ...]:
    """The prompt sizes to probe: :data:`PROMPT_SIZES` clipped to what one step and the
    engine's context hold (leaving room for the output token), without duplicates."""
    room = profile.max_num_batched_tokens
    if max_model_len is not None:
        room = min(room, max_model_len - DECODE_TOKENS - 1)
    room = max(1, room)
    return tuple(sorted({min(size, room) for size in PROMPT_SIZES}))


def compute_s(profile: EngineProfile, tokens: int) -> float:
    """A prompt's profiled compute alone on an idle engine, as the forecast counts it."""
    budget = max(1, profile.max_num_batched_tokens)
    steps = -(-tokens // budget)
    return (profile.prefill_chunk_ms(0, tokens) + steps * profile.prefill_base_ms) / 1000


def fit_prefill(
    profile: EngineProfile, samples: Sequence[tuple[int, float]]
) -> tuple[float, float]:
    """``(scale, latency_s)`` fitting ``observed = latency + scale * compute`` (least squares,
    latency at least 0) over ``(prompt tokens, observed seconds)`` samples."""
    xs = [compute_s(profile, tokens) for tokens, _ in samples]
    ys = [observed for _, observed in samples]
    if not xs:
        raise ValueError("no prefill sample")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread > 0:
        scale = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
        latency = mean_y - scale * mean_x
        if latency >= 0 and scale > 0:
            return scale, latency
    # One size only, or a negative intercept: all of it is compute.
    scale = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return max(scale, 0.0), 0.0


def decode_batches(profile: EngineProfile) -> tuple[int, ...]:
    """The decode probes' batch sizes: :data:`DECODE_BATCHES` clipped to ``max_num_seqs``."""
    return tuple(sorted({max(1, min(size, profile.max_num_seqs)) for size in DECODE_BATCHES}))


def fit_decode(
    profile: EngineProfile,
    prompt_tokens: int,
    batches: Mapping[int, Sequence[Sequence[tuple[float, int]]]],
) -> tuple[float, float]:
    """``(decode_scale, decode_slope)`` from each batch size's probes, each probe's gaps as
    ``(gap seconds, tokens)``, every probe with a ``prompt_tokens`` prompt (the context grows by
    each gap's tokens): ``observed = decode_scale * (a_d + decode_slope * grows)`` (see the
    module doc) by least squares over the batches' median gap per token and median ``grows``.
    A probe's first gap counts only when it ran alone: beside others, its sequence may have
    waited for their prefill.

    With one batch size, a rise from the smallest batch to the largest within three times the
    gaps' median absolute deviation (noise), or a fit that is not positive, the slope is the
    profile's (1.0) and the scale the median of each gap per token over the profile's step."""
    points = []  # (what the batch adds, observed) per batch, ms
    ratios = []
    noise = 0.0  # the largest batch's median absolute deviation of its steps, ms
    base = profile.decode_base_ms
    for batch, probes in sorted(batches.items()):
        steps, grows = [], []
        for gaps in probes:
            at = 0  # output tokens before the gap, past the first (it came with the prefill)
            for index, (gap_s, tokens) in enumerate(gaps):
                context = batch * (prompt_tokens + 1 + at)
                at += tokens
                if index == 0 and len(probes) > 1:
                    continue
                expected = profile.decode_step_ms(batch, context)
                steps.append(gap_s * 1000 / tokens)
                grows.append(expected - base)
                ratios.append(gap_s * 1000 / tokens / expected)
        if steps:
            middle = statistics.median(steps)
            points.append((statistics.median(grows), middle))
            noise = max(noise, statistics.median(abs(step - middle) for step in steps))
    if not ratios:
        raise ValueError("no gap")
    # The slope is fitted only where the step grows with the batch well beyond the gaps' own
    # scatter: a profile's batch terms are small beside its fixed cost, and a noisy engine (a
    # loaded host) would otherwise read as a steep one.
    if len(points) >= 2 and base > 0 and points[-1][1] - points[0][1] > _NOISE_RISE * noise:
        xs = [grows for grows, _ in points]
        ys = [observed for _, observed in points]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        if spread > 0:
            per_grow = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
            per_grow /= spread
            fixed = mean_y - per_grow * mean_x
            if fixed > 0 and per_grow >= 0:
                return fixed / base, per_grow / (fixed / base)
    return statistics.median(ratios), 1.0


async def profile_engine(
    engine: Engine, client: EngineClient, model: str, *, timeout_s: float, attempt: int = 0
) -> ProfileFit:
    """Measure ``engine`` (idle, out of placement) and fit its model; each probe waits at most
    ``timeout_s``.

    Raises:
        ProfilingFailed: a probe erred, timed out or returned invalid token IDs.
    """
    profile = engine.forecast.profile
    ids = random.Random(f"{engine.name}:{attempt}")
    samples = []
    for size in probe_sizes(profile, engine.max_model_len):
        times = []
        for _ in range(_ROUNDS):
            prompt = [ids.randrange(*_ID_RANGE) for _ in range(size)]
            ttft_s, _ = await _probe(engine, client, model, prompt, 1, timeout_s)
            times.append(ttft_s)
        samples.append((size, min(times)))
    prompt_tokens = min(_DECODE_PROMPT, samples[0][0])
    batches: dict[int, list[list[tuple[float, int]]]] = {}
    max_tokens = DECODE_TOKENS
    for batch in decode_batches(profile):
        prompts = [[ids.randrange(*_ID_RANGE) for _ in range(prompt_tokens)] for _ in range(batch)]
        probes = await _probe_batch(engine, client, model, prompts, max_tokens, timeout_s)
        while (longer := coalesced_tokens(probes, max_tokens)) is not None:
            # The engine streams several tokens a chunk whatever the request asks (a vLLM
            # started with --stream-interval): too few gaps to time its steps. Ask for enough
            # tokens, for this batch and the next ones (each time more, to a cap).
            max_tokens = longer
            probes = await _probe_batch(engine, client, model, prompts, max_tokens, timeout_s)
        # A batch whose answers the engine ended early is left out.
        if all(len(gaps) >= _MIN_GAPS for gaps in probes):
            batches[batch] = probes
    if not batches:
        log.warning(
            "engine %s: no decode probe had %d inter-token gaps; its decode model is left as "
            "it was (its time per output token is learned from live traffic only)",
            engine.name,
            _MIN_GAPS,
        )
    scale, latency_s = fit_prefill(profile, samples)
    decode_scale, decode_slope = engine.forecast.decode_scale, engine.forecast.decode_slope
    if batches:
        decode_scale, decode_slope = fit_decode(profile, prompt_tokens, batches)
    decode = tuple(
        (batch, statistics.median(gap / tokens for gaps in probes for gap, tokens in gaps))
        for batch, probes in batches.items()
    )
    gaps = sum(len(gaps) for probes in batches.values() for gaps in probes)
    return ProfileFit(scale, latency_s, decode_scale, decode_slope, tuple(samples), gaps, decode)


def coalesced_tokens(probes: Sequence[Sequence[tuple[float, int]]], max_tokens: int) -> int | None:
    """The ``max_tokens`` that gives every probe enough gaps where the engine streams several
    tokens a chunk and ``max_tokens`` gave some probe too few (``None``: no need, or no help:
    the engine ended the answers early, or streams one token a chunk already).

    The first token travels alone; each later chunk carries the most tokens any gap carried,
    so ``1 + chunk * (_MIN_GAPS + 1)`` tokens give every probe a gap to spare (the first one,
    which a batch leaves out), at most :data:`_MOST_DECODE_TOKENS`.
    """
    if all(len(gaps) >= _MIN_GAPS for gaps in probes):
        return None
    chunk = max((tokens for gaps in probes for _, tokens in gaps), default=1)
    wanted = min(_MOST_DECODE_TOKENS, 1 + chunk * (_MIN_GAPS + 1))
    if chunk <= 1 or wanted <= max_tokens:
        return None
    return wanted


async def _probe_batch(
    engine: Engine,
    client: EngineClient,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float,
) -> list[list[tuple[float, int]]]:
    """Decode probes at once, one per prompt: each one's gaps (the first failure raised)."""
    gaps: list[list[tuple[float, int]]] = []
    failures: list[ProfilingFailed] = []

    async def one(prompt: list[int]) -> None:
        try:
            _, probe_gaps = await _probe(engine, client, model, prompt, max_tokens, timeout_s)
        except ProfilingFailed as failed:
            failures.append(failed)
            nursery.cancel_scope.cancel()
            return
        gaps.append(probe_gaps)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    if failures:
        raise failures[0]
    return gaps


async def _probe(
    engine: Engine,
    client: EngineClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float,
) -> tuple[float, list[tuple[float, int]]]:
    """One probe: its time to first token and its later gaps as ``(seconds, tokens)``."""
    with trio.move_on_after(timeout_s) as scope:
        result = await _measure(engine, client, model, prompt, max_tokens)
    if scope.cancelled_caught:
        raise ProfilingFailed(f"no answer to a {len(prompt)}-token probe within {timeout_s:g} s")
    return result


async def _measure(
    engine: Engine, client: EngineClient, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[tuple[float, int]]]:
    with_ids = engine.provides_token_ids
    request: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "user": PROBE_USER,
    }
    if engine.config.dialect in ("vllm", "sglang") and max_tokens > 1:
        request["ignore_eos"] = True
    if with_ids:
        request["return_token_ids"] = True
        request["stream_interval"] = 1
    size = len(prompt)
    started = trio.current_time()
    first: float | None = None
    last = started
    gaps: list[tuple[float, int]] = []
    try:
        body = orjson.dumps(request)
        async with await client.open_stream("completions", body, ids_required=with_ids) as stream:
            while True:
                event = await stream.next_event()
                if isinstance(event, DoneEvent):
                    break
                if isinstance(event, ErrorFrameEvent):
                    log.info("engine %s: profiling probe error: %s", engine.name, event.message())
                    raise ProfilingFailed(f"the {size}-token probe got an error")
                assert isinstance(event, ChunkEvent)
                _check_prompt_ids(event, size)
                facts = event.facts
                tokens = facts.token_ids if with_ids else int(facts.output)
                if not tokens:
                    continue
                now = trio.current_time()
                if first is None:
                    first = now
                else:
                    gaps.append((now - last, tokens))
                last = now
    except EngineRejectedRequest as exc:
        log.info("engine %s refused a profiling probe: %s", engine.name, exc.message)
        raise ProfilingFailed(f"the engine refused the {size}-token probe") from exc
    except NarwhalError as exc:
        log.info("engine %s: profiling probe failed: %s", engine.name, exc)
        what = "invalid token IDs" if "token_ids" in (exc.param or "") else "failed"
        raise ProfilingFailed(f"the {size}-token probe: {what}") from exc
    if first is None:
        raise ProfilingFailed(f"the {size}-token probe got no token")
    return first - started, gaps


def _check_prompt_ids(event: ChunkEvent, size: int) -> None:
    for choice in event.chunk.get("choices") or ():
        ids = choice.get("prompt_token_ids") if isinstance(choice, dict) else None
        if ids is not None and (type(ids) is not list or len(ids) != size):
            raise ProfilingFailed(f"the {size}-token probe: invalid prompt token IDs")
