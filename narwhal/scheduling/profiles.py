"""Engine performance profiles: the physics of prefill and decode steps (pure).

One table serves two masters: the simulator's continuous-batching engine runs on these numbers,
and the router uses the same numbers as its prior model of an engine until profiling and online
learning take over. Times are milliseconds of GPU work for Llama-3-8B (BF16, one GPU), from the
vidur-derived constants of the reference notes:

* prefill of ``n`` new tokens after a ``p``-token prefix:
  ``a_p + b_p * (n - p) + c_p * (n**2 - p**2)`` (the quadratic term is causal attention, so a
  prompt prefilled in chunks costs the same attention in total as in one step);
* a decode step over ``B`` running sequences holding ``K`` context tokens:
  ``a_d + s_d * B + k_d * K``;
* a mixed step (chunked prefill beside decodes) costs the decode step plus the prefill chunk's
  ``b_p`` and ``c_p`` terms; a step that prefills while nothing decodes also pays ``a_p`` once,
  so a lone prompt that fits one step costs exactly ``prefill_ms`` (the simulator's step loop,
  :mod:`narwhal.sim.batching`, applies these rules).

Calibration: prefill of 1k / 8k tokens on ``h100-llama3-8b`` is about 28 ms / 309 ms.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

__all__ = ["PROFILES", "EngineProfile", "get_profile"]


@attrs.frozen
class EngineProfile:
    """Step-cost constants and capacity limits of one engine type.

    Attributes:
        name: the profile's name.
        prefill_base_ms: ``a_p``, fixed cost of a step that prefills.
        prefill_per_token_ms: ``b_p``, per new prompt token.
        prefill_quadratic_ms: ``c_p``, attention per token squared.
        decode_base_ms: ``a_d``, fixed cost of a decode step (weights read).
        decode_per_seq_ms: ``s_d``, per running sequence.
        decode_per_kv_token_ms: ``k_d``, per context token held by the batch.
        max_num_seqs: the most sequences in the running batch.
        max_num_batched_tokens: the most tokens (prefill chunk plus one per decode) in a step.
        kv_capacity_tokens: KV cache capacity, in tokens.
    """

    name: str
    prefill_base_ms: float
    prefill_per_token_ms: float
    prefill_quadratic_ms: float
    decode_base_ms: float
    decode_per_seq_ms: float
    decode_per_kv_token_ms: float
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_capacity_tokens: int = 467_000

    def prefill_ms(self, tokens: int, prefix: int = 0) -> float:
        """GPU time to prefill positions ``prefix .. tokens`` alone in one step."""
        new = max(0, tokens - prefix)
        if new == 0:
            return 0.0
        return (
            self.prefill_base_ms
            + self.prefill_per_token_ms * new
            + self.prefill_quadratic_ms * (tokens * tokens - prefix * prefix)
        )

    def prefill_chunk_ms(self, start: int, end: int) -> float:
        """The variable cost of prefilling positions ``start .. end`` inside a step."""
        return self.prefill_per_token_ms * (end - start) + self.prefill_quadratic_ms * (
            end * end - start * start
        )

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """GPU time of one decode step (0 when nothing decodes)."""
        if batch == 0:
            return 0.0
        return (
            self.decode_base_ms
            + self.decode_per_seq_ms * batch
            + self.decode_per_kv_token_ms * context_tokens
        )


PROFILES: Mapping[str, EngineProfile] = MappingProxyType(
    {
        "h100-llama3-8b": EngineProfile(
            name="h100-llama3-8b",
            prefill_base_ms=3.5,
            prefill_per_token_ms=0.022,
            prefill_quadratic_ms=1.8e-6,
            decode_base_ms=6.2,
            decode_per_seq_ms=0.011,
            decode_per_kv_token_ms=4.9e-5,
            kv_capacity_tokens=467_000,
        ),
        "a100-llama3-8b": EngineProfile(
            name="a100-llama3-8b",
            prefill_base_ms=5.7,
            prefill_per_token_ms=0.069,
            prefill_quadratic_ms=3.7e-6,
            decode_base_ms=10.3,
            decode_per_seq_ms=0.030,
            decode_per_kv_token_ms=8.0e-5,
            kv_capacity_tokens=400_000,
        ),
    }
)
"""The named profiles (Llama-3-8B; H100 and A100 80 GB)."""


def get_profile(name: str) -> EngineProfile:
    """The named profile.

    Raises:
        KeyError: no such profile (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown engine profile {name!r} (known: {known})") from None
