"""Logits -> sampling probabilities (temperature, top-k, top-p, min-p) and draws.

The one place in the project that turns logits into the distribution a token is
drawn from: the plain decoder, the draft proposal and the speculative verifier all
call :func:`sampling_probs`, so the target distribution a speculative step samples
from is by construction the one the plain decoder samples from.

Pure jnp (XLA): the filters are a handful of row reductions that XLA fuses well; the
Pallas kernels of this package consume the probabilities this module produces.

Choice of the top-k / top-p method
----------------------------------
Sorting a [384, 152064] float32 array per step (B * (S+1) rows of a Qwen vocabulary)
is the expensive part of the usual sort + cumsum filters, and ``lax.top_k`` needs a
static k while our k is a per-row tensor. Both filters are instead threshold
searches: top-k keeps ``p >= t`` for the largest t with ``count(p >= t) >= k``, top-p
keeps ``p >= t`` for the largest t with ``sum(p[p >= t]) >= top_p * sum(p)``. For
non-negative float32 the int32 bit pattern is monotone in the value, so the search
runs over integer keys in [0, 2**30) (1.0 is 0x3F800000 < 2**30) and ends on the
*exact* threshold (no float tolerance). Each round tests 15 candidate thresholds at
once in one fused pass over the row (a 16-way radix select), so 30 bits take 8
passes (4+4+4+4+4+4+4+2 bits) instead of 30 bisection passes or a sort. Each filter
runs under a ``lax.cond`` and is skipped when no row asks for it (the common
``top_k = TOP_K_ALL, top_p = 1`` batch pays only the softmax).

Tie handling: every token tied with the k-th value is kept (so top-k may keep more
than k); top-p keeps all tokens tied with its threshold. A greedy row (top_k <= 1)
does not go through the search at all: it becomes one-hot on ``jnp.argmax`` of its
logits restricted to the real vocabulary, i.e. ties broken by the first index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from eagle_jax.sampling import SamplingRows

# Probability keys live in [0, 2**30): the bit pattern of float32 1.0 is 0x3F800000.
_KEY_BITS = 30
# Bits resolved per pass of the radix select: 2**4 - 1 = 15 candidate thresholds.
_BITS_PER_ROUND = 4
# Layout of the candidate axis in the radix-select reduction (see below; the
# benchmark times both).
_CANDIDATES_MINOR = True


def _largest_threshold_key(keys, weights, target):
  """Largest integer t in [0, 2**30) with ``sum(weights[keys >= t]) >= target``.

  Args:
    keys: [..., V] int32, non-negative (bit patterns of non-negative floats).
    weights: [..., V] float32, non-negative.
    target: [...] float32.
  Returns:
    [...] int32. t = 0 (keep everything) is assumed to satisfy the condition.
  """
  lo = jnp.zeros(keys.shape[:-1], jnp.int32)
  shift = _KEY_BITS
  while shift > 0:
    bits = min(_BITS_PER_ROUND, shift)
    shift -= bits
    steps = jnp.arange(1, 1 << bits, dtype=jnp.int32) << shift  # [n]
    candidates = lo[..., None] + steps  # [..., n]
    # [..., V, n] never materialises: XLA fuses the compare into the reduction. The
    # candidates sit on the minor axis so that each element of the row is loaded once
    # and compared with all n candidates (a candidate-major layout re-reads the row n
    # times from HBM: measured 8 ms instead of ~1 ms on an H200 at [384, 152064]).
    if _CANDIDATES_MINOR:
      mass = jnp.sum(
          jnp.where(keys[..., :, None] >= candidates[..., None, :], weights[..., :, None], 0.0),
          axis=-2,
      )
    else:
      mass = jnp.sum(
          jnp.where(keys[..., None, :] >= candidates[..., :, None], weights[..., None, :], 0.0),
          axis=-1,
      )
    # mass is non-increasing in the candidate, so the satisfied ones are a prefix.
    num_ok = jnp.sum(mass >= target[..., None], axis=-1).astype(jnp.int32)
    lo = lo + (num_ok << shift)
  return lo


def _prob_keys(p):
  return lax.bitcast_convert_type(jnp.maximum(p, 0.0), jnp.int32)


def _per_row(x, lead: tuple[int, ...], dtype) -> jax.Array:
  """A row parameter of shape [B] (or a scalar) broadcast over ``lead`` = (B, ...)."""
  x = jnp.asarray(x, dtype)
  return jnp.broadcast_to(jnp.reshape(x, x.shape + (1,) * (len(lead) - x.ndim)), lead)


def sampling_probs(
    logits: jax.Array,
    rows: SamplingRows,
    vocab_size: int | None = None,
) -> jax.Array:
  """Filtered, renormalised sampling probabilities.

  Args:
    logits: [B, ..., V] float (any float dtype; computed in float32). Columns
      ``>= vocab_size`` (padding of the embedding width) get probability 0. NaN
      logits count as -inf, +inf as the largest finite float.
    rows: the per-row parameters, each field [B] (or [B, ...] up to logits' leading
      shape, or a scalar), broadcast over the positions of a row:
      temperature > 0 (0 was rewritten to greedy upstream, see ``eagle_jax.sampling``;
      a non-positive value is treated as 1); top_k ``>= V`` (e.g. TOP_K_ALL) disables
      the filter, ``<= 1`` is a greedy row; top_p in (0, 1], 1 disables it; min_p in
      [0, 1], 0 disables it.
    vocab_size: real vocabulary size (<= V); None means V.
  Returns:
    [..., V] float32 probabilities, each row summing to 1; greedy rows are exactly
    one-hot on the first index of the maximum logit.
  """
  num_cols = logits.shape[-1]
  vocab_size = num_cols if vocab_size is None else int(vocab_size)
  if not 0 < vocab_size <= num_cols:
    raise ValueError(f"vocab_size {vocab_size} must be in (0, {num_cols}]")
  lead = logits.shape[:-1]
  temperature = _per_row(rows.temperature, lead, jnp.float32)
  top_k = _per_row(rows.top_k, lead, jnp.int32)
  top_p = _per_row(rows.top_p, lead, jnp.float32)
  min_p = _per_row(rows.min_p, lead, jnp.float32)

  x = logits.astype(jnp.float32)
  in_vocab = jnp.arange(num_cols) < vocab_size
  x = jnp.where(jnp.isnan(x), -jnp.inf, x)
  x = jnp.minimum(x, jnp.finfo(jnp.float32).max)
  x = jnp.where(in_vocab, x, -jnp.inf)

  # Greedy rows: one-hot on the first argmax, independent of temperature (seed 001).
  greedy = top_k <= 1
  greedy_probs = jax.nn.one_hot(jnp.argmax(x, axis=-1), num_cols, dtype=jnp.float32)

  t = jnp.where(temperature > 0, temperature, 1.0)
  z = x / t[..., None]
  z_max = jnp.max(z, axis=-1, keepdims=True)
  z_max = jnp.where(jnp.isfinite(z_max), z_max, 0.0)
  e = jnp.exp(z - z_max)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  # A row without a single finite logit becomes uniform over the vocabulary.
  uniform = in_vocab.astype(jnp.float32) / vocab_size
  p = jnp.where(denom > 0, e / jnp.where(denom > 0, denom, 1.0), uniform)

  keys = _prob_keys(p)

  # top-k: keep p >= the k-th largest p (exact threshold; ties kept).
  wants_top_k = (top_k > 1) & (top_k < vocab_size)

  def top_k_keep(_):
    k = jnp.where(wants_top_k, top_k, 1).astype(jnp.float32)
    t_k = _largest_threshold_key(keys, jnp.ones_like(p), k)
    return jnp.where(wants_top_k[..., None], keys >= t_k[..., None], True)

  keep = lax.cond(jnp.any(wants_top_k), top_k_keep, lambda _: jnp.ones(p.shape, bool), None)
  p = jnp.where(keep, p, 0.0)

  # top-p on the top-k survivors: the smallest head of the distribution whose mass
  # reaches top_p of what is left. The most likely token always survives (its key is
  # >= any threshold the search can return once the target is positive).
  wants_top_p = top_p < 1.0

  def top_p_keep(_):
    target = jnp.clip(top_p, 0.0, 1.0) * jnp.sum(p, axis=-1)
    t_p = _largest_threshold_key(keys, p, target)
    return jnp.where(wants_top_p[..., None], keys >= t_p[..., None], True)

  keep = lax.cond(jnp.any(wants_top_p), top_p_keep, lambda _: jnp.ones(p.shape, bool), None)
  p = jnp.where(keep, p, 0.0)

  # min-p relative to the most likely token (unchanged by the filters above).
  p_max = jnp.max(p, axis=-1, keepdims=True)
  p = jnp.where(p >= min_p[..., None] * p_max, p, 0.0)

  # Clamped to 1: XLA compiles a float32 division for NVIDIA GPUs to div.full.f32 (within
  # 2 ulp, not correctly rounded), so a row the filters cut to one token gets x / x =
  # 1 + 2**-23 there (exactly 1 on a CPU): no probability, and the draft's row check and
  # the verify sampler rightly refuse it (issue 61). A correctly rounded division never
  # exceeds 1 (each entry is at most the row's sum), so on a CPU the clamp changes nothing.
  p = jnp.minimum(p / jnp.sum(p, axis=-1, keepdims=True), 1.0)
  return jnp.where(greedy[..., None], greedy_probs, p)


def sample_from_probs(probs: jax.Array, uniform: jax.Array) -> jax.Array:
  """Inverse-CDF draw of one index per row.

  Args:
    probs: [..., V] non-negative weights (need not be normalised). Entries that are
      not finite and positive count as 0.
    uniform: [...] float in [0, 1).
  Returns:
    [...] int32 in [0, V): the first index whose running sum exceeds
    ``uniform * total``, restricted to positive entries. Float rounding at the top end
    (the running sum never exceeding the target) falls back to the last positive
    index, so an index of probability 0 is never returned. A row with no positive
    entry returns 0.
  """
  p = probs.astype(jnp.float32)
  p = jnp.where(jnp.isfinite(p) & (p > 0), p, 0.0)
  cdf = jnp.cumsum(p, axis=-1)
  total = jnp.sum(p, axis=-1)
  target = jnp.asarray(uniform, jnp.float32) * total
  positive = p > 0
  # A parallel scan need not give cdf[i] == cdf[i-1] where p[i] == 0, hence `& positive`.
  hit = (cdf > target[..., None]) & positive
  first_hit = jnp.argmax(hit, axis=-1).astype(jnp.int32)
  num_cols = p.shape[-1]
  last_positive = (num_cols - 1 - jnp.argmax(positive[..., ::-1], axis=-1)).astype(jnp.int32)
  fallback = jnp.where(jnp.any(positive, axis=-1), last_positive, 0)
  return jnp.where(jnp.any(hit, axis=-1), first_hit, fallback).astype(jnp.int32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
  """Structured output's mask on logits, before :func:`sampling_probs`.

  Args:
    logits: [..., V] float.
    bitmask: [..., W] int32 (``eagle_jax.grammar``'s token bitmask): token t is allowed
      where bit ``t % 32`` of word ``t // 32`` is set; columns past 32 W are not.
  Returns:
    logits with the disallowed tokens at -inf (so sampling_probs gives them 0 and
    renormalises over the allowed ones; a greedy row takes the allowed argmax).
  """
  num_cols = logits.shape[-1]
  cols = jnp.arange(num_cols)
  words = jnp.take(bitmask, jnp.minimum(cols // 32, bitmask.shape[-1] - 1), axis=-1)
  allowed = ((words >> (cols % 32)) & 1).astype(bool) & (cols < 32 * bitmask.shape[-1])
  return jnp.where(allowed, logits, -jnp.inf)
