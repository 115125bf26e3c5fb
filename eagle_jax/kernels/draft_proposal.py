"""Draft proposal sampler: one draft token per row, and the q it was drawn from.

Per row b: q_b = sampling_probs(draft_logits_b, row params) (XLA, shared with every
other sampler), then

* greedy rows (top_k <= 1) propose argmax q_b, the first index of the maximum: greedy
  is recognised by top_k, never by temperature, because temperature 0 has been
  rewritten to temperature 1, top_k 1 (seed 001). Their q is one-hot (sampling_probs
  makes it so), which is what the verifier's accept test expects.
* other rows propose an inverse-CDF draw from q_b with ``uniform[b]``.

Row check (seed 004). The proposal is where q is made, so it is where q is checked: a
row is well formed iff every entry is a probability in [0, 1] (no NaN, no +-inf) and
the row sums to 1 within ``ROW_SUM_TOLERANCE``. The verdict ``probs_ok`` travels with q
into the verify sampler, which never accepts a draft token drawn from a malformed row
(its residual would be biased even where q(d) itself looks valid) and counts it.

With EAGLE-3's reduced draft vocabulary (``d2t``: target_id = draft_id +
d2t[draft_id]) the token and q are mapped into the target vocabulary of width
``target_vocab_size``; ``d2t`` must be injective (it is, by construction of the
published draft heads).

What the Pallas kernel does, and why only that: the filters are row reductions XLA
already fuses well. The part that is worth a kernel is everything after them, which in
XLA is a cumsum, an argmax, a compare-and-argmax for the draw and a scatter into a
zeroed [B, V_target] buffer (five passes and a materialised CDF). The kernel reads q
once for the mass and the row check, once for the running-cumsum draw (fused with the
argmax), and scatters q into the target vocabulary in the first pass; the zeroed output
buffer is an XLA memset aliased into the kernel (so every element is written exactly
once without a cross-thread ordering question between a zero-fill and the scatter).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common
from eagle_jax.kernels.filters import sample_from_probs, sampling_probs
from eagle_jax.sampling import SamplingRows

_NO_INDEX = 1 << 30

# |sum(q) - 1| allowed for a well-formed row: float32 sums of a 152k-wide row drift by
# ~1e-5; a row off by more than 1e-3 did not come from a softmax.
ROW_SUM_TOLERANCE = 1e-3


class DraftProposal(NamedTuple):
  """One proposed token per row and the distribution it was drawn from."""

  tokens: jax.Array  # [B] int32 target ids
  probs: jax.Array  # [B, V_target] float32 q in the target vocabulary
  probs_ok: jax.Array  # [B] bool: q is a well-formed distribution (the 004 row check)


def probs_row_ok(q: jax.Array) -> jax.Array:
  """[..., V] -> [...] bool: entries in [0, 1] (no NaN / inf) and sum within tolerance."""
  entries_ok = jnp.all((q >= 0.0) & (q <= 1.0), axis=-1)
  total = jnp.sum(jnp.where((q >= 0.0) & (q <= 1.0), q, 0.0), axis=-1)
  return entries_ok & (jnp.abs(total - 1.0) <= ROW_SUM_TOLERANCE)


def _block_size(draft_vocab: int, gpu: _common.GpuTarget,
                block_v: int | None = None) -> tuple[int, int]:
  """(BLOCK, num_warps): 2048 float32 columns per masked load at 8 warps (8 per thread).

  One program per row walks the (small: 32000 for EAGLE-3 heads) draft vocabulary; the
  batch supplies the parallelism. The same on every target: B <= 128 programs is fewer
  than an MI300X's or MI355X's CUs, so each CU runs one workgroup, and its 8 wavefronts
  (2 per SIMD, 4 columns per lane) are all that hide the loop's latency; 4 would halve
  the loads in flight. Compiled for gfx942 / gfx950 (docs/ROCM.md): 40-41 VGPRs and
  16 KiB of LDS (the scan), no spills, 8 waves per SIMD allowed.
  """
  del gpu  # the same choice on every target (above)
  block = block_v or min(2048, max(32, _common.next_power_of_2(draft_vocab)))
  return block, 8 if block >= 1024 else 4


def _propose_kernel(flags_ref, u_ref, q_ref, *rest, draft_vocab, block, has_d2t):
  if has_d2t:
    d2t_ref, _, tok_ref, q_out_ref, ok_ref = rest
  else:
    d2t_ref = None
    _, tok_ref, q_out_ref, ok_ref = rest
  b = pl.program_id(0)
  greedy = flags_ref[b] != 0
  num_blocks = pl.cdiv(draft_vocab, block)

  def mass_and_scatter(k, carry):
    total, num_bad = carry
    cols = k * block + jnp.arange(block, dtype=jnp.int32)
    in_vocab = cols < draft_vocab
    # Lanes past the vocabulary re-read and re-store the last column, unmasked: a
    # duplicate store of the same value is well defined on a GPU and in interpret
    # mode alike, whereas a masked lane's scatter index would collide with a real one.
    cols = jnp.minimum(cols, draft_vocab - 1)
    q_raw = plgpu.load(q_ref.at[b, cols])
    is_prob = (q_raw >= 0.0) & (q_raw <= 1.0)  # False for NaN
    q = jnp.where(is_prob & (q_raw > 0.0), q_raw, 0.0)
    targets = cols if d2t_ref is None else cols + plgpu.load(d2t_ref.at[cols])
    plgpu.store(q_out_ref.at[b, targets], q)
    return (total + jnp.sum(jnp.where(in_vocab, q, 0.0)),
            num_bad + jnp.sum((in_vocab & ~is_prob).astype(jnp.int32)))

  total, num_bad = lax.fori_loop(
      0, num_blocks, mass_and_scatter, (jnp.float32(0.0), jnp.int32(0)))
  row_ok = (num_bad == 0) & (jnp.abs(total - 1.0) <= ROW_SUM_TOLERANCE)
  ok_ref[b] = jnp.where(row_ok, jnp.int32(1), jnp.int32(0))
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
  tokens, q_target, ok = pl.pallas_call(
      functools.partial(_propose_kernel, draft_vocab=draft_vocab, block=block,
                        has_d2t=has_d2t),
      out_shape=(jax.ShapeDtypeStruct((batch,), jnp.int32),
                 jax.ShapeDtypeStruct((batch, target_width), jnp.float32),
                 jax.ShapeDtypeStruct((batch,), jnp.int32)),
      grid=(batch,),
      input_output_aliases={q_out_index: 1},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="draft_proposal",
  )(*operands, zeros)
  return DraftProposal(tokens, q_target, ok != 0)


def propose_from_probs_reference(q, greedy, uniform, *, d2t=None, target_vocab_size=None):
  """Pure-jnp reference of :func:`propose_from_probs`."""
  ok = probs_row_ok(q)
  q = jnp.where((q > 0.0) & (q <= 1.0), q, 0.0)
  tokens = jnp.where(greedy, jnp.argmax(q, axis=-1).astype(jnp.int32),
                     sample_from_probs(q, uniform)).astype(jnp.int32)
  if d2t is None:
    return DraftProposal(tokens, q, ok)
  d2t = jnp.asarray(d2t, jnp.int32)
  draft_ids = jnp.arange(q.shape[-1], dtype=jnp.int32)
  q_target = jnp.zeros((q.shape[0], target_vocab_size), jnp.float32)
  q_target = q_target.at[:, draft_ids + d2t].set(q)
  return DraftProposal(tokens + d2t[tokens], q_target, ok)


def propose_from_probs(
    q: jax.Array, greedy: jax.Array, uniform: jax.Array, *, d2t: jax.Array | None = None,
    target_vocab_size: int | None = None, interpret: bool | None = None,
    target: str | None = None, block_v: int | None = None) -> DraftProposal:
  """Propose one draft token per row from its draft distribution q.

  Args:
    q: [B, V_draft] float32 probabilities (as sampling_probs makes them; malformed rows
      are flagged in ``probs_ok``, and their entries outside (0, 1] count as 0).
    greedy: [B] bool rows that propose their argmax (top_k <= 1, seed 001).
    uniform: [B] float32 in [0, 1).
    d2t: [V_draft] int32 offsets into the target vocabulary, or None.
    target_vocab_size: width of the returned q when d2t is given (required then).
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
    target: the GPU to pick block sizes for (a key of ``_common.GPU_TARGETS``); None =
      automatic (``_common.resolve_target``).
    block_v: override the block-size heuristic (tests).
  Returns:
    DraftProposal: tokens [B] int32 target ids, probs [B, V_target] float32 (V_target =
    target_vocab_size with d2t, else V_draft), probs_ok [B] bool.
  """
  if d2t is not None and target_vocab_size is None:
    raise ValueError("target_vocab_size is required with d2t")
  supported = (
      _common.kernel_backend_ok(interpret, q)
      and q.ndim == 2
      and (d2t is None or d2t.shape == q.shape[-1:])
  )
  if not supported:
    return propose_from_probs_reference(q, greedy, uniform, d2t=d2t,
                                        target_vocab_size=target_vocab_size)
  block, num_warps = _block_size(q.shape[-1], _common.resolve_target(target), block_v)
  width = q.shape[-1] if d2t is None else int(target_vocab_size)
  return _propose_pallas(
      jnp.asarray(greedy).astype(jnp.int32), jnp.asarray(uniform, jnp.float32),
      q.astype(jnp.float32), None if d2t is None else jnp.asarray(d2t, jnp.int32), width,
      block=block, num_warps=num_warps, interpret=_common.resolve_interpret(interpret))


def propose_draft_tokens(
    draft_logits: jax.Array, rows: SamplingRows, uniform: jax.Array, *,
    d2t: jax.Array | None = None, target_vocab_size: int | None = None,
    vocab_size: int | None = None, interpret: bool | None = None,
    target: str | None = None, block_v: int | None = None) -> DraftProposal:
  """Propose one draft token per row from the draft's logits.

  Args:
    draft_logits: [B, V_draft] float.
    rows: the rows' sampling parameters ([B] each; greedy iff top_k <= 1).
    uniform: [B] float32 in [0, 1).
    d2t, target_vocab_size, interpret, target, block_v: as in :func:`propose_from_probs`.
    vocab_size: real size of the draft vocabulary (<= V_draft); None means V_draft.
  Returns:
    DraftProposal (see :func:`propose_from_probs`).
  """
  q = sampling_probs(draft_logits, rows, vocab_size)
  return propose_from_probs(q, rows.is_greedy, uniform, d2t=d2t,
                            target_vocab_size=target_vocab_size, interpret=interpret,
                            target=target, block_v=block_v)


def propose_draft_tokens_reference(draft_logits, rows: SamplingRows, uniform, *, d2t=None,
                                   target_vocab_size=None, vocab_size=None) -> DraftProposal:
  """Pure-jnp reference of :func:`propose_draft_tokens`."""
  q = sampling_probs(draft_logits, rows, vocab_size)
  return propose_from_probs_reference(q, rows.is_greedy, uniform, d2t=d2t,
                                      target_vocab_size=target_vocab_size)
