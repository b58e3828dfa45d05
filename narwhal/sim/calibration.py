"""The simulated engines' own physics: calibrated engine types, per-engine variation (pure).

The simulator's engines do not run on the router's cost model (:mod:`narwhal.scheduling.profiles`,
the router's *prior*): what an engine really costs is defined here, from the published
measurements collected in ``reference/slo-and-engine-models.md`` (section 2), so that what the
router predicts can be wrong, and the benchmark can measure how wrong.

An :class:`EngineType` has the cost form of section 2.1 ("Recommended form for the simulator"),
in milliseconds of engine time for Llama-3-8B (BF16, one GPU):

* a step that prefills positions ``start .. end`` of a prompt costs
  ``b_p * (end - start) + c_p * (end**2 - start**2)`` (causal attention against the prefix);
* a decode step over ``B`` sequences holding ``K`` context tokens costs ``a_d + s_d * B + k_d * K``;
* a step that prefills while nothing decodes pays ``a_p`` once (a mixed step pays ``a_d``).

Each fixed cost includes the engine's per-step overhead, which the GPU-kernel constants leave
out: section 2.1's ``engine_overhead ~ 1.2 ms/step``, from BLIS's trained-physics coefficients
``beta5 * L + beta7 = 32.1 us * 32 layers + 126 us = 1.153 ms`` (section 2.1 table).

Where each constant comes from:

=====================  ==========================  ===============================================
constant               ``h100-llama3-8b``          ``a100-llama3-8b``
=====================  ==========================  ===============================================
``a_p`` (ms)           3.5 + 1.153: section 2.2    5.7 + 1.153: section 2.2 table (vidur MLP
                       table (H100 scaled from     profile) plus the step overhead
                       vidur) plus the overhead
``b_p`` (ms/token)     0.0198: BLIS blackbox fit,  0.069: section 2.2 table, vidur's A100
                       llama-3.1-8b, vLLM 0.8.4,   ``mlp.csv`` (BLIS's A100 47.8 us/token is a
                       H100 TP1 (section 2.2       fit artefact there, ~94 % MFU)
                       cross-checks: measured,
                       where the table's 0.022 is
                       a scaled estimate)
``c_p`` (ms/token^2)   1.8e-6: section 2.2 table   3.7e-6: section 2.2 table (vidur attention.csv)
``a_d`` (ms)           6.2 + 1.153: section 2.2    10.3 + 1.153: section 2.2 table plus the
                       table plus the overhead     overhead
``s_d`` (ms/seq)       0.011: section 2.2 table    0.030: section 2.2 table
``k_d`` (ms/KV token)  4.9e-5: section 2.2 table   8.0e-5: section 2.2 table
KV capacity (tokens)   467,000: BLIS, 29,205 blocks x 16 on one 80 GB H100/A100 (section 1.5)
=====================  ==========================  ===============================================

Against the router's prior (the section 2.2 kernel times alone) an H100 engine prefills a little
faster (1k tokens in 26.8 ms against the prior's 27.9 ms) and decodes 8 to 18 % slower (the step
overhead; an A100 5 to 11 %): the prior is wrong the way a kernel-time model is wrong.

Per-engine variation. No two GPUs are the same: :meth:`EngineType.varied` multiplies each of
the six constants by ``1 + spread * u`` with ``u`` in [-1, 1) drawn from the seed and the
constant (deterministic: the same seed gives the same engine; :data:`VARIATION` is the spread
the benchmark uses, a few percent). :meth:`EngineType.scaled` multiplies every time by one
factor (an engine ``factor`` times slower than its type).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

__all__ = [
    "ALIASES",
    "ENGINE_TYPES",
    "STEP_OVERHEAD_MS",
    "VARIATION",
    "EngineType",
    "engine_type",
    "unit_noise",
]

_MASK64 = (1 << 64) - 1

STEP_OVERHEAD_MS = 0.0321 * 32 + 0.126
"""The engine's per-step overhead (ms): BLIS ``beta5 * L + beta7`` for a 32-layer model."""

VARIATION = 0.05
"""The relative spread of the per-engine variation the benchmark uses (each constant +-5 %)."""

_TIMES = (
    "prefill_base_ms",
    "prefill_per_token_ms",
    "prefill_quadratic_ms",
    "decode_base_ms",
    "decode_per_seq_ms",
    "decode_per_kv_token_ms",
)


def unit_noise(seed: int, key: int) -> float:
    """A deterministic value in [-1, 1) from ``(seed, key)`` (splitmix64; no global state)."""
    z = (seed * 0x9E3779B97F4A7C15 + key + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 52) - 1.0


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0.0:  # also rejects NaN
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class EngineType:
    """What one simulated engine really costs, and its limits (see the module doc).

    The attribute and method names are those the step loop (:mod:`narwhal.sim.batching`) asks
    for, so any object with them (the router's own profile, in tests that want the engines to
    match the prior exactly) can stand in.

    Attributes:
        name: the type's name.
        prefill_base_ms: ``a_p``, fixed cost of a step that prefills and does not decode.
        prefill_per_token_ms: ``b_p``, per new prompt token.
        prefill_quadratic_ms: ``c_p``, attention per token squared.
        decode_base_ms: ``a_d``, fixed cost of a step that decodes.
        decode_per_seq_ms: ``s_d``, per decoding sequence.
        decode_per_kv_token_ms: ``k_d``, per context token held by the decoding sequences.
        max_num_seqs: the most sequences in the running batch.
        max_num_batched_tokens: the most tokens (prefill chunks plus one per decode) in a step.
        kv_capacity_tokens: KV cache capacity, in tokens.
    """

    name: str
    prefill_base_ms: float = attrs.field(validator=_positive)
    prefill_per_token_ms: float = attrs.field(validator=_positive)
    prefill_quadratic_ms: float = attrs.field(validator=_positive)
    decode_base_ms: float = attrs.field(validator=_positive)
    decode_per_seq_ms: float = attrs.field(validator=_positive)
    decode_per_kv_token_ms: float = attrs.field(validator=_positive)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_capacity_tokens: int = 467_000

    def prefill_ms(self, tokens: int, prefix: int = 0) -> float:
        """Engine time to prefill positions ``prefix .. tokens`` alone in one step."""
        if tokens <= prefix:
            return 0.0
        return self.prefill_base_ms + self.prefill_chunk_ms(prefix, tokens)

    def prefill_chunk_ms(self, start: int, end: int) -> float:
        """The variable cost of prefilling positions ``start .. end`` inside a step."""
        return self.prefill_per_token_ms * (end - start) + self.prefill_quadratic_ms * (
            end * end - start * start
        )

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """Engine time of one decode step (0 when nothing decodes)."""
        if batch == 0:
            return 0.0
        return (
            self.decode_base_ms
            + self.decode_per_seq_ms * batch
            + self.decode_per_kv_token_ms * context_tokens
        )

    def scaled(self, factor: float) -> EngineType:
        """The same engine ``factor`` times slower (every time constant times ``factor``).

        Raises:
            ValueError: ``factor`` is not > 0.
        """
        if not factor > 0.0:
            raise ValueError(f"the scale must be > 0, got {factor!r}")
        return attrs.evolve(self, **{name: getattr(self, name) * factor for name in _TIMES})

    def varied(self, seed: int, spread: float = VARIATION) -> EngineType:
        """This type as the engine built with ``seed``: each constant off by up to ``spread``.

        Each constant is multiplied by ``1 + spread * u``, ``u`` in [-1, 1) from the seed and
        the constant's position; a spread of 0 is the type itself.

        Raises:
            ValueError: ``spread`` is not in [0, 1).
        """
        if not 0.0 <= spread < 1.0:
            raise ValueError(f"the spread must be in [0, 1), got {spread!r}")
        if spread == 0.0:
            return self
        changes = {
            name: getattr(self, name) * (1.0 + spread * unit_noise(seed, key))
            for key, name in enumerate(_TIMES)
        }
        return attrs.evolve(self, **changes)


ENGINE_TYPES: Mapping[str, EngineType] = MappingProxyType(
    {
        "h100-llama3-8b": EngineType(
            name="h100-llama3-8b",
            prefill_base_ms=3.5 + STEP_OVERHEAD_MS,
            prefill_per_token_ms=0.0198,
            prefill_quadratic_ms=1.8e-6,
            decode_base_ms=6.2 + STEP_OVERHEAD_MS,
            decode_per_seq_ms=0.011,
            decode_per_kv_token_ms=4.9e-5,
        ),
        "a100-llama3-8b": EngineType(
            name="a100-llama3-8b",
            prefill_base_ms=5.7 + STEP_OVERHEAD_MS,
            prefill_per_token_ms=0.069,
            prefill_quadratic_ms=3.7e-6,
            decode_base_ms=10.3 + STEP_OVERHEAD_MS,
            decode_per_seq_ms=0.030,
            decode_per_kv_token_ms=8.0e-5,
        ),
    }
)
"""The calibrated engine types (Llama-3-8B on one H100 / A100 80 GB)."""

ALIASES: Mapping[str, str] = MappingProxyType({"h100": "h100-llama3-8b", "a100": "a100-llama3-8b"})
"""Short names accepted by :func:`engine_type`."""


def engine_type(name: str) -> EngineType:
    """The named engine type (or its short alias: ``h100``, ``a100``).

    Raises:
        ValueError: no such type (the message lists the known ones).
    """
    found = ENGINE_TYPES.get(ALIASES.get(name, name))
    if found is None:
        known = ", ".join(sorted({*ENGINE_TYPES, *ALIASES}))
        raise ValueError(f"unknown engine type {name!r} (known: {known})")
    return found
