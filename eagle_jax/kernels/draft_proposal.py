"""Draft proposal sampler: one draft token per row, and the q it was drawn from.

Per row b: q_b = sampling_probs(draft_logits_b, row params) (XLA, shared with every
other sampler), then

* greedy rows (top_k <= 1) propose argmax q_b, the first index of the maximum: greedy
  is recognised by top_k, never by temperature, because temperature 0 has been
  rewritten to temperature 1, top_k 1 (seed 001). Their q is one-hot (sampling_probs
  makes it so), which is what the verifier's accept test expects.
* other rows propose an inverse-CDF draw from q_b with ``uniform[b]``.

With EAGLE-3's reduced draft vocabulary (``d2t``: target_id = draft_id +
d2t[draft_id]) the token and q are mapped into the target vocabulary of width
``target_vocab_size``; ``d2t`` must be injective (it is, by construction of the
published draft heads).

What the Pallas kernel does, and why only that: the filters are row reductions XLA
already fuses well. The part that is worth a kernel is everything after them, which in
XLA is a cumsum, an argmax, a compare-and-argmax for the draw and a scatter into a
zeroed [B, V_target] buffer (five passes and a materialised CDF). The kernel reads q
once for the mass, once for the running-cumsum draw (fused with the argmax), and
scatters q into the target vocabulary in the first pass; the zeroed output buffer is
an XLA memset aliased into the kernel (so every element is written exactly once
without a cross-thread ordering question between a zero-fill and the scatter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common
from eagle_jax.kernels.filters import sample_from_probs, sampling_probs

_NO_INDEX = 1 << 30


def _block_size(draft_vocab: int, block_v: int | None) -> tuple[int, int]:
  """(BLOCK, num_warps): 2048 float32 columns per masked load at 8 warps (8 per thread).

  One program per row walks the (small: 32000 for EAGLE-3 heads) draft vocabulary; the
  batch supplies the parallelism.
  """
  block = block_v or min(2048, max(32, _common.next_power_of_2(draft_vocab)))
  return block, 8 if block >= 1024 else 4


def _propose_kernel(flags_ref, u_ref, q_ref, *rest, draft_vocab, block, has_d2t):
  if has_d2t:
    d2t_ref, _, tok_ref, q_out_ref = rest
  else:
    d2t_ref = None
    _, tok_ref, q_out_ref = rest
  b = pl.program_id(0)
  greedy = flags_ref[b] != 0
  num_blocks = pl.cdiv(draft_vocab, block)

  def mass_and_scatter(k, total):
    cols = k * block + jnp.arange(block, dtype=jnp.int32)
    in_vocab = cols < draft_vocab
    # Lanes past the vocabulary re-read and re-store the last column, unmasked: a
    # duplicate store of the same value is well defined on a GPU and in interpret
    # mode alike, whereas a masked lane's scatter index would collide with a real one.
    cols = jnp.minimum(cols, draft_vocab - 1)
    q = plgpu.load(q_ref.at[b, cols])
    q = jnp.where((q > 0.0) & (q <= 1.0), q, 0.0)
    targets = cols if d2t_ref is None else cols + plgpu.load(d2t_ref.at[cols])
    plgpu.store(q_out_ref.at[b, targets], q)
    return total + jnp.sum(jnp.where(in_vocab, q, 0.0))

  total = lax.fori_loop(0, num_blocks, mass_and_scatter, jnp.float32(0.0))
  target = u_ref[b] * total

  def draw(k, carry):
    running, found, last_pos, best, best_idx = carry
    cols = k * block + jnp.arange(block, dtype=jnp.int32)
    in_vocab = cols < draft_vocab
    q = plgpu.load(q_ref.at[b, cols], mask=in_vocab, other=0.0)
    q = jnp.where((q > 0.0) & (q <= 1.0), q, 0.0)
    csum = running + jnp.cumsum(q)
    first = jnp.min(jnp.where((csum > target) & (q > 0.0), cols, _NO_INDEX))
    found = jnp.where(found == _NO_INDEX, first, found)
    last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(q > 0.0, cols, -1)))
    q_for_max = jnp.where(in_vocab, q, -1.0)
    blk_best = jnp.max(q_for_max)
    blk_idx = k * block + jnp.argmax(q_for_max).astype(jnp.int32)
    better = blk_best > best  # strict: the earlier block keeps ties (first index)
    return (running + jnp.sum(q), found, last_pos,
            jnp.where(better, blk_best, best), jnp.where(better, blk_idx, best_idx))

  init = (jnp.float32(0.0), jnp.int32(_NO_INDEX), jnp.int32(-1), jnp.float32(-2.0),
          jnp.int32(0))
  _, found, last_pos, _, best_idx = lax.fori_loop(0, num_blocks, draw, init)
  sampled = jnp.where(found != _NO_INDEX, found, jnp.maximum(last_pos, 0))
  token = jnp.where(greedy, best_idx, sampled).astype(jnp.int32)
  if d2t_ref is not None:
    token = token + d2t_ref[token]
  tok_ref[b] = token


def _propose_pallas(flags, uniform, q, d2t, target_width, *, block, num_warps, interpret):
  batch, draft_vocab = q.shape
  has_d2t = d2t is not None
  operands = (flags, uniform, q) + ((d2t,) if has_d2t else ())
  zeros = jnp.zeros((batch, target_width), jnp.float32)
  q_out_index = len(operands)
  tokens, q_target = pl.pallas_call(
      functools.partial(_propose_kernel, draft_vocab=draft_vocab, block=block,
                        has_d2t=has_d2t),
      out_shape=(jax.ShapeDtypeStruct((batch,), jnp.int32),
                 jax.ShapeDtypeStruct((batch, target_width), jnp.float32)),
      grid=(batch,),
      input_output_aliases={q_out_index: 1},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="draft_proposal",
  )(*operands, zeros)
  return tokens, q_target


def _filtered_q(draft_logits, temperature, top_k, top_p, min_p, vocab_size):
  return sampling_probs(draft_logits, temperature, top_k, top_p, min_p, vocab_size)


def propose_draft_tokens_reference(
    draft_logits, temperature, top_k, top_p, min_p, uniform, *, d2t=None,
    target_vocab_size=None, vocab_size=None):
  """Pure-jnp reference of :func:`propose_draft_tokens`."""
  q = _filtered_q(draft_logits, temperature, top_k, top_p, min_p, vocab_size)
  greedy = jnp.asarray(top_k) <= 1
  tokens = jnp.where(greedy, jnp.argmax(q, axis=-1).astype(jnp.int32),
                     sample_from_probs(q, uniform)).astype(jnp.int32)
  if d2t is None:
    return tokens, q
  d2t = jnp.asarray(d2t, jnp.int32)
  draft_ids = jnp.arange(q.shape[-1], dtype=jnp.int32)
  q_target = jnp.zeros((q.shape[0], target_vocab_size), jnp.float32)
  q_target = q_target.at[:, draft_ids + d2t].set(q)
  return tokens + d2t[tokens], q_target


def propose_draft_tokens(
    draft_logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
    min_p: jax.Array, uniform: jax.Array, *, d2t: jax.Array | None = None,
    target_vocab_size: int | None = None, vocab_size: int | None = None,
    interpret: bool | None = None, block_v: int | None = None):
  """Propose one draft token per row.

  Args:
    draft_logits: [B, V_draft] float.
    temperature, top_k, top_p, min_p: [B] row parameters (greedy iff top_k <= 1).
    uniform: [B] float32 in [0, 1).
    d2t: [V_draft] int32 offsets into the target vocabulary, or None.
    target_vocab_size: width of the returned q when d2t is given (required then).
    vocab_size: real size of the draft vocabulary (<= V_draft); None means V_draft.
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
  Returns:
    (tokens [B] int32 target ids, q [B, V_target] float32), V_target =
    target_vocab_size with d2t, else V_draft.
  """
  if d2t is not None and target_vocab_size is None:
    raise ValueError("target_vocab_size is required with d2t")
  q = _filtered_q(draft_logits, temperature, top_k, top_p, min_p, vocab_size)
  supported = (
      _common.kernel_backend_ok(interpret)
      and draft_logits.ndim == 2
      and (d2t is None or d2t.shape == draft_logits.shape[-1:])
  )
  if not supported:
    return propose_draft_tokens_reference(
        draft_logits, temperature, top_k, top_p, min_p, uniform, d2t=d2t,
        target_vocab_size=target_vocab_size, vocab_size=vocab_size)
  block, num_warps = _block_size(q.shape[-1], block_v)
  flags = (jnp.asarray(top_k) <= 1).astype(jnp.int32)
  width = q.shape[-1] if d2t is None else int(target_vocab_size)
  return _propose_pallas(
      flags, jnp.asarray(uniform, jnp.float32), q,
      None if d2t is None else jnp.asarray(d2t, jnp.int32), width,
      block=block, num_warps=num_warps, interpret=_common.resolve_interpret(interpret))
