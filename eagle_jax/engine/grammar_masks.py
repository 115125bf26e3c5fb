"""Structured output inside a step: the grammar masks a constrained step asks the host
for while it runs, and their application to the draft's logits.

A constrained step (``StepKey.constrained``) calls ``grammar(drafted [B, n])`` once
before each draft token and once for the last verify position (``step.py``): an
``io_callback`` to the host, where ``grammar.fill_masks`` reads each constrained row's
matcher (the runner's ``grammar_rows``, set from the plan before the step is
dispatched) after the row's n tentative tokens. The engine collects a constrained step
before it dispatches the next one, so the matchers the callbacks read are those of the
step's own start, advanced by every token committed before it.

The callbacks are unordered: each depends on the tokens it is given, which the step
computed before it (and the next step's on this step's state), so data fixes their
order; an ordered callback's effect token would also need a single device, and the
tensor-parallel step runs on a mesh.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from eagle_jax.kernels.filters import apply_token_bitmask

Array = jax.Array


def drafted(tokens: list[Array], batch: int) -> Array:
    """The tokens a step drafted so far, [B, n] (n may be 0)."""
    return jnp.stack(tokens, axis=1) if tokens else jnp.zeros((batch, 0), jnp.int32)


def masked_draft_logits(logits: Array, bitmask: Array, d2t: Array | None,
                        target_vocab: int) -> Array:
    """The draft's logits [B, V_draft] with the tokens the grammar's ``bitmask`` [B, W]
    (over target ids) forbids at -inf; a reduced draft vocabulary's column j is target
    id j + d2t[j]."""
    if d2t is None:
        return apply_token_bitmask(logits, bitmask)
    allowed = jnp.isfinite(apply_token_bitmask(
        jnp.zeros(bitmask.shape[:1] + (target_vocab,), jnp.float32), bitmask))
    ids = jnp.arange(logits.shape[-1]) + d2t
    return jnp.where(jnp.take(allowed, ids, axis=-1), logits, -jnp.inf)


def host_masks(fill: Callable[[np.ndarray], np.ndarray], num_words: int
               ) -> Callable[[Array], Array]:
    """The step's ``grammar``: drafted [B, n] -> bitmask [B, num_words] int32, computed by
    ``fill`` (host tokens [B, n] -> host bitmasks) through an ``io_callback``."""

    def grammar(tokens: Array) -> Array:
        batch, n = tokens.shape
        # A zero-width operand is passed as one padding column, cut on the host.
        operand = tokens if n else jnp.zeros((batch, 1), jnp.int32)
        return io_callback(functools.partial(_call, fill, n),
                           jax.ShapeDtypeStruct((batch, num_words), jnp.int32), operand,
                           ordered=False)

    return grammar


def _call(fill, n: int, tokens) -> np.ndarray:
    return np.asarray(fill(np.asarray(tokens)[:, :n]), np.int32)
