"""Sampling parameters of a request and their per-row tensor form.

A request's sampling parameters enter the compiled step as tensors (one row per batch
slot), never as Python scalars baked into a trace: a compiled bucket therefore always
carries each request's real temperature and top_k (upstream write-up 001).

Conventions, shared by every sampler in the project:

* ``temperature == 0`` means greedy. It is rewritten to ``temperature = 1, top_k = 1``,
  so a greedy row is recognised by ``top_k <= 1`` alone.
* ``top_k = TOP_K_ALL`` (a large positive sentinel, never ``-1``) means "no top-k
  filter". User-facing ``top_k`` of ``-1`` or ``0`` maps to it. Padded batch slots carry
  ``TOP_K_ALL`` and temperature 1, so they can never read as greedy rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import numpy as np

# "No top-k filter". Larger than any vocabulary; a positive value so that a padded row
# can never satisfy the greedy test ``top_k <= 1``.
TOP_K_ALL = 1 << 30

# Largest number of top logprobs a request may ask for per token (vLLM's default cap).
MAX_LOGPROBS = 20

# The kinds of structured output a request may ask for (``StructuredOutput.kind``).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output: the grammar engine (``eagle_jax.grammar``)
    compiles it once per distinct value (the dataclass is its cache key).

    Attributes:
      kind: "json" (``spec`` a JSON schema, as JSON text), "json_object" (any JSON
        object; ``spec`` empty), "regex" (``spec`` a regular expression), "choice"
        (``choices``: the output is exactly one of them), "grammar" (``spec`` an EBNF
        grammar in xgrammar's GBNF dialect, its start rule ``root``).
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, "
                             f"got {self.kind!r}")
        if self.kind == "choice":
            if (isinstance(self.choices, str) or not self.choices
                    or not all(isinstance(c, str) and c for c in self.choices)):
                raise ValueError("structured output choice needs a non-empty list of "
                                 f"non-empty strings, got {self.choices!r}")
            object.__setattr__(self, "choices", tuple(self.choices))
        elif self.kind != "json_object" and not (isinstance(self.spec, str) and self.spec):
            raise ValueError(f"structured output {self.kind} needs a non-empty spec string, "
                             f"got {self.spec!r}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters (OpenAI / vLLM conventions).

    Attributes:
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_p: nucleus mass in (0, 1].
      top_k: keep the k most likely tokens; -1 or 0 disables the filter.
      min_p: drop tokens whose probability is below ``min_p * max_prob``; in [0, 1].
      seed: per-request PRNG seed; None draws one from the engine's generator.
      max_tokens: most tokens to generate (>= 1); None generates to the context limit.
      stop: strings that end generation; the stop string itself is not returned.
      stop_token_ids: token ids that end generation (returned, like EOS).
      ignore_eos: keep generating past EOS.
      logprobs: None, or how many top logprobs to return per generated token (0..20).
      include_stop_str_in_output: keep the matched stop string in the text.
      structured: None, or the constraint its output must satisfy (JSON schema, regex,
        choice, grammar); the grammar forbids EOS until the structure is complete.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None

    def __post_init__(self):
        # Normalise list inputs so the dataclass stays hashable and immutable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if not isinstance(ids, Sequence) or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids
        ):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the bad field and its allowed range."""

        def _number(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(float(value)):
                raise ValueError(f"{name} must be finite, got {value!r}")
            return float(value)

        if _number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        top_p = _number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        min_p = _number("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(
                self.max_tokens, (int, np.integer)
            ):
                raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
        ):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, (int, np.integer)):
                raise ValueError(f"logprobs must be an integer, got {self.logprobs!r}")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError("structured must be a StructuredOutput, got "
                                 f"{type(self.structured).__name__}")
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured output: the "
                                 "grammar ends the output with EOS once it is complete")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def kernel_values(self) -> tuple[float, int, float, float]:
        """(temperature, top_k, top_p, min_p) as the compiled step carries them.

        Temperature 0 becomes temperature 1 with top_k 1; a disabled top_k becomes
        TOP_K_ALL.
        """
        if self.temperature == 0.0:
            return 1.0, 1, 1.0, 0.0
        top_k = TOP_K_ALL if self.top_k <= 0 else int(self.top_k)
        return float(self.temperature), top_k, float(self.top_p), float(self.min_p)


class SamplingRows(NamedTuple):
    """Per-row sampling parameters: the one value every sampler of the step takes whole.

    Fields are [B] arrays (numpy on the host, jax inside a step; a NamedTuple is a pytree,
    so the value travels through jit and sits in ``DecodeState`` as one field). Padded
    rows hold temperature 1, top_k TOP_K_ALL, top_p 1, min_p 0: the identity filter,
    never greedy (a padded row can never read as ``top_k <= 1``, seed 001).
    """

    temperature: np.ndarray  # f32
    top_k: np.ndarray  # i32, TOP_K_ALL = no filter, <= 1 = greedy
    top_p: np.ndarray  # f32
    min_p: np.ndarray  # f32

    @classmethod
    def padded(cls, batch: int) -> "SamplingRows":
        """``batch`` padding rows (host arrays)."""
        return cls(temperature=np.ones((batch,), np.float32),
                   top_k=np.full((batch,), TOP_K_ALL, np.int32),
                   top_p=np.ones((batch,), np.float32),
                   min_p=np.zeros((batch,), np.float32))

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams | None] | SamplingParams,
                    batch: int | None = None) -> "SamplingRows":
        """Host rows from one SamplingParams or a list of them; None entries and rows past
        ``len(params)`` (up to ``batch``) are padding."""
        if isinstance(params, SamplingParams):
            params = [params]
        batch = len(params) if batch is None else batch
        if batch < len(params):
            raise ValueError(f"{len(params)} sampling params do not fit {batch} rows")
        rows = cls.padded(batch)
        for i, p in enumerate(params):
            if p is not None:
                rows.temperature[i], rows.top_k[i], rows.top_p[i], rows.min_p[i] = (
                    p.kernel_values())
        return rows

    @property
    def is_greedy(self):
        """[B] bool: the rows that decode greedily (top_k <= 1; temperature 0 was
        rewritten to temperature 1, top_k 1)."""
        return self.top_k <= 1

    def rows(self, batch: int) -> "SamplingRows":
        """The first ``batch`` rows (a step for batch bucket ``batch``)."""
        return SamplingRows(*(x[:batch] for x in self))
