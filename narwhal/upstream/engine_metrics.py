"""An engine's queue gauges from its Prometheus ``/metrics`` text (pure, no I/O).

vLLM publishes ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (a fraction: 1 means full), labelled ``engine`` and ``model_name``;
an engine started with data parallelism has one sample per ``engine`` label. SGLang names the
same gauges ``sglang:num_running_reqs``, ``sglang:num_queue_reqs`` and ``sglang:token_usage``.
Both sets are looked for whatever the dialect says (Narwhal's simulator speaks vLLM's names in
every dialect); the ``openai`` dialect has no such gauges and is not asked.

Samples of one gauge are added up (running and waiting requests) or the largest kept (KV-cache
usage: the fullest cache is the one that refuses first). The text is parsed with
``prometheus_client``'s parser; anything it cannot read, or a value that is not a finite number
0 or greater, is a :class:`MetricsUnreadable` (a failed poll), never a crash.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from narwhal.scheduling.engines import EngineMetrics

__all__ = ["GAUGES", "MetricsUnreadable", "parse_engine_metrics"]

GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "sglang:token_usage"),
}
"""For each reading, the gauge names that carry it (vLLM's first)."""

_READING = {name: reading for reading, names in GAUGES.items() for name in names}


class MetricsUnreadable(ValueError):
    """The text is not Prometheus text Narwhal can read; the message is safe to show."""


def parse_engine_metrics(text: str) -> EngineMetrics:
    """The queue gauges in ``text`` (Prometheus text exposition).

    Raises:
        MetricsUnreadable: the text cannot be parsed, or one of the gauges has a value that is
            not a finite number 0 or greater.
    """
    found: dict[str, list[float]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError... on bad input
        raise MetricsUnreadable("unreadable Prometheus text") from exc
    for family in families:
        for sample in family.samples:
            reading = _READING.get(sample.name)
            if reading is None:
                continue
            value = sample.value
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise MetricsUnreadable(f"{sample.name} has the value {value!r}")
            found.setdefault(reading, []).append(float(value))
    kv = found.get("kv_cache_usage")
    return EngineMetrics(
        running=_sum(found.get("running")),
        waiting=_sum(found.get("waiting")),
        kv_cache_usage=None if kv is None else max(kv),
    )


def _sum(values: list[float] | None) -> float | None:
    return None if values is None else math.fsum(values)
