"""Speculative-decoding verify sampler (rejection sampling), Pallas / Triton.

Algorithm (Leviathan et al. 2023; Chen et al. 2023), per batch row b, with S draft
tokens d_0..d_{S-1} proposed from draft distributions q_0..q_{S-1} and target
distributions p_0..p_S (p_i = the target's filtered distribution at position i, as
produced by :func:`eagle_jax.kernels.filters.sampling_probs` in XLA, outside the
kernel):

* Accept rule (sampling rows). Draft token d_i is accepted when
  ``u_i * q_i(d_i) < p_i(d_i)``, i.e. with probability ``min(1, p_i(d_i) / q_i(d_i))``,
  for i = 0, 1, ... until the first rejection. ``u_i = uniforms[b, i]`` (columns
  0..S-1 are the accept coins).
* Residual. At the first rejected position j the emitted token is drawn from the
  normalised residual ``max(p_j - q_j, 0) / sum(max(p_j - q_j, 0))`` with
  ``uniforms[b, S]`` (the last column is reserved for this final draw).
* Bonus. When all S drafts are accepted, one more token is drawn from p_S with
  ``uniforms[b, S]``.
* Why unbiased: P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y)))
  * max(p(x) - q(x), 0) / sum_y max(p(y) - q(y), 0) = min(q, p)(x) + max(p - q, 0)(x)
  = p(x), because 1 - sum min(q, p) = sum max(p - q, 0). Each committed token, given
  the prefix, is therefore distributed exactly as the target's p.
* Greedy path (rows with top_k <= 1, seed 001): accept d_i while d_i == argmax p_i
  (first index of the maximum), then emit argmax p at the first mismatch, or argmax
  p_S as the bonus. This is exactly the plain argmax chain, so temperature-0 requests
  keep the accept length of greedy verification. (With p one-hot the sampling rule
  would give the same tokens; the explicit path needs no coin and no q.)
* ``draft_probs=None`` means q_i is one-hot on d_i (a greedy or deterministic draft):
  the accept test becomes ``u_i < p_i(d_i)`` and the residual is p_j with d_j removed.

Guards (seed 004: a recycled draft_probs buffer filled with -inf made ``p - q`` +inf,
the residual draw never fired and the kernel committed a fixed id past the tokenizer):

* A draft token is accepted only if its q row passed the proposal's row check
  (``draft_probs_ok``: entries in [0, 1], sum 1; see ``draft_proposal.py``): a row
  malformed anywhere would bias the residual even where q_i(d_i) looks valid. Such a
  position is rejected, counted in ``num_malformed_q``, and its residual is p_i itself.
* A draft token is accepted only if ``q_i(d_i)`` is a probability in (0, 1]: d_i was
  drawn from q_i, so q_i(d_i) > 0; a NaN, +-inf, 0, negative or > 1 entry rejects (it
  would otherwise accept unconditionally, ``u * -inf < p``), and is counted in
  ``num_malformed_q``.
* In the residual, a q entry outside [0, 1] counts as 0; a p entry that is not a finite
  probability in [0, 1] counts as 0 everywhere (p may come straight from the caller
  with ``target_is_probs=True``). A row whose residual at j holds such entries also
  counts in ``num_malformed_q``.
* A draft token outside [0, vocab_size) is always rejected.
* Columns >= vocab_size (embedding padding, e.g. 154880 vs 154856) are never read, so
  no emitted id can reach them.
* If the residual has zero mass the row falls back to sampling p_j itself and counts
  it in ``num_fallback``; if even p_j has no mass (only possible with malformed
  ``target_is_probs`` input) the token is drawn uniformly from the vocabulary. No path
  emits a fixed id, and every emitted id lies in [0, vocab_size).

Kernel design. Two pallas_calls, both memory bound:

1. ``_partials_kernel``, grid (B, S+1, C) over rows, positions and vocabulary chunks
   of CHUNK columns: each program recomputes the row's O(S) accept tests (gathers of
   p_i(d_i), q_i(d_i)), then streams its chunk in BLOCK-wide masked loads. Greedy
   rows: chunk argmax of p_i. Sampling rows, only at the rejected position j: the
   chunk's residual mass and p mass. Every other program exits after the gathers, so
   p and q are read once, and only where needed. Splitting V over C chunks is what
   fills the GPU: B = 64 rows alone would occupy half of an H200's SMs.
2. ``_finish_kernel``, grid (B,): combines the chunk partials (greedy argmax; the
   chunk where the residual CDF crosses ``u * mass``) and re-reads that one chunk with
   a running cumsum for the inverse CDF, then writes the row's tokens and counters.

JAX arrays are dense and row-major, so no contiguity guard is needed (unlike the
torch original); the public function falls back to the pure-jnp reference on
backends without a Triton lowering (TPU) and for unsupported dtypes / shapes.
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

PAD_TOKEN = -1

_NO_INDEX = _common.NO_INDEX

# The batch CHUNK is sized for (see _block_sizes): 64 sampling rows, 152064 columns.
_SIZING_ROWS = 64
_SIZING_VOCAB = 152064

# Row flags passed to the kernels (one int32 per row).
_ACTIVE = 1
_GREEDY = 2


class SamplerOutput(NamedTuple):
  """Result of one verify step. Shapes: tokens [B, S+1], the rest [B]."""

  tokens: jax.Array  # int32, committed ids then PAD_TOKEN
  num_tokens: jax.Array  # int32, accept_len + 1 (0 for inactive rows)
  accept_len: jax.Array  # int32
  num_malformed_q: jax.Array  # int32
  num_fallback: jax.Array  # int32


# --------------------------------------------------------------------------------------
# Block-size heuristic.
# --------------------------------------------------------------------------------------


class SamplerConfig(NamedTuple):
  """The launch of the two kernels (see ``_block_sizes``)."""

  block: int       # vocabulary columns per masked load
  chunk: int       # vocabulary columns one program of kernel 1 owns
  num_warps: int   # of both kernels
  num_stages: int  # software pipelining of kernel 1's vocabulary loop


def _block_sizes(vocab_size: int, gpu: _common.GpuTarget, block_v: int | None = None,
                 chunk_v: int | None = None, num_stages: int | None = None) -> SamplerConfig:
  """BLOCK and CHUNK: the load width and the columns one program of kernel 1 owns.

  BLOCK = 2048 float32 columns per masked load: with 8 warps that is 8 elements per
  thread per operand on NVIDIA (two 128-bit loads), 4 per lane of AMD's 64-wide
  wavefronts (one 128-bit load), enough in flight to hide HBM latency without spilling.
  CHUNK = 16384 columns (8 loads) on the H200: a 152064-wide vocabulary splits into 10
  chunks, so even a batch of 64 sampling rows, each needing one position, gives 640
  busy programs (about 5 per SM), while the finish kernel re-reads at most one 64 KiB
  chunk per row. On a GPU with more cores CHUNK halves (not below 4096) until that batch
  gives >= 4 busy programs per core: 8192 on MI300X (304 CUs) and MI355X (256), 1216
  busy programs. Compiled for gfx942 / gfx950 (docs/ROCM.md) both kernels take 18-56
  VGPRs and 32-64 bytes of LDS: 8 waves per SIMD, so a CU can hold 4 workgroups of 8
  wavefronts, which 16384-column chunks (1.7-2.5 busy programs per CU) left half empty.
  8 warps on AMD too: with so few busy programs per CU, a workgroup's 2 waves per SIMD
  are most of what hides its latency. Both BLOCK and CHUNK shrink to the next power of
  two above a small vocab.
  3 pipeline stages in the vocabulary loop: measured best on an H200 (0.069 ms against
  0.105 ms at 2 for 64 sampling rows, docs/history/2026-11-30-issue-03-kernels.md).
  """
  block = block_v or min(2048, _common.next_power_of_2(vocab_size))
  max_chunk = 16384
  while (max_chunk > 4096 and _SIZING_ROWS * _common.cdiv(_SIZING_VOCAB, max_chunk)
         < 4 * gpu.num_cores):
    max_chunk //= 2
  chunk = chunk_v or min(max_chunk, max(block, _common.next_power_of_2(vocab_size)))
  if block & (block - 1) or chunk & (chunk - 1) or chunk % block:
    raise ValueError(f"block {block} and chunk {chunk} must be powers of two, block | chunk")
  return SamplerConfig(block, chunk, 8, num_stages or 3)


# --------------------------------------------------------------------------------------
# Kernel bodies.
# --------------------------------------------------------------------------------------


def _as_prob(x):
  """An entry that is not a probability in [0, 1] (NaN, +-inf, < 0, > 1) counts as 0."""
  return jnp.where((x >= 0.0) & (x <= 1.0), x, 0.0)


def _count(flag):
  """A scalar bool as int32 0 / 1 (spelled as a select: the Triton lowering
  mishandles the weakly typed ``jnp.where(flag, 1, 0)`` on scalars)."""
  return jnp.where(flag, jnp.int32(1), jnp.int32(0))


def _accept_tests(b, tok_ref, u_ref, p_ref, q_refs, *, num_draft, num_pos_pad, vocab_size):
  """The sampling accept tests of row b: O(S) gathers.

  ``q_refs`` is (q [B, S, V], q_ok [B, S] i32 row verdicts) or None (one-hot q).
  Returns (draft [P] i32, accept_len i32, malformed i32, counted [P] bool) with P =
  num_pos_pad >= S+1; positions >= S are padding (never accepted). ``malformed`` counts
  the positions whose q(d) is not a probability or whose q row is flagged malformed;
  ``counted`` marks them.
  """
  pos = jnp.arange(num_pos_pad, dtype=jnp.int32)
  in_draft = pos < num_draft
  draft = plgpu.load(tok_ref.at[b, pos], mask=in_draft, other=-1)
  valid = in_draft & (draft >= 0) & (draft < vocab_size)
  safe = jnp.where(valid, draft, 0)
  p_d = _as_prob(plgpu.load(p_ref.at[b, pos, safe], mask=valid, other=0.0))
  if q_refs is None:
    q_d = jnp.where(valid, 1.0, 0.0)
    row_ok = in_draft
  else:
    q_ref, q_ok_ref = q_refs
    q_d = plgpu.load(q_ref.at[b, pos, safe], mask=valid, other=0.0)
    row_ok = plgpu.load(q_ok_ref.at[b, pos], mask=in_draft, other=0) != 0
  q_is_prob = (q_d > 0.0) & (q_d <= 1.0)  # False for NaN
  coin = plgpu.load(u_ref.at[b, pos], mask=in_draft, other=1.0)
  accept = valid & q_is_prob & row_ok & (coin * q_d < p_d)
  accept_len = jnp.min(jnp.where(accept, num_draft, pos)).astype(jnp.int32)
  counted = (valid & ~q_is_prob) | (in_draft & ~row_ok)
  return draft, accept_len, jnp.sum(counted.astype(jnp.int32)), counted


def _residual_block(b, j, cols, tok_ref, p_ref, q_refs, *, num_draft, vocab_size):
  """(residual, p, q-entry-invalid) for columns `cols` of row b at position j.

  The residual is max(p_j - q_j, 0); at j == S (the bonus) there is no q and it is p.
  A q row flagged malformed counts as q = 0: its draft token was rejected outright, so
  drawing from p_j itself keeps the emitted token distributed as p_j.
  """
  in_vocab = cols < vocab_size
  p = _as_prob(plgpu.load(p_ref.at[b, j, cols], mask=in_vocab, other=0.0))
  has_q = j < num_draft
  jq = jnp.minimum(j, num_draft - 1)
  if q_refs is None:
    d = plgpu.load(tok_ref.at[b, jq])
    q = jnp.where(has_q & (cols == d), 1.0, 0.0)
    bad = jnp.zeros(cols.shape, jnp.bool_)
  else:
    q_ref, q_ok_ref = q_refs
    row_ok = q_ok_ref[b, jq] != 0
    q_raw = plgpu.load(q_ref.at[b, jq, cols], mask=in_vocab & has_q, other=0.0)
    ok = (q_raw >= 0.0) & (q_raw <= 1.0)
    q = jnp.where(ok & row_ok, q_raw, 0.0)
    bad = in_vocab & has_q & ~ok
  return jnp.maximum(p - q, 0.0), p, bad


def _partials_kernel(
    flags_ref, tok_ref, u_ref, p_ref, *rest,
    num_draft, num_pos_pad, vocab_size, block, chunk, has_q,
):
  q_refs, rest = (rest[:2], rest[2:]) if has_q else (None, rest)
  max_ref, arg_ref, mass_r_ref, mass_p_ref, bad_ref = rest
  b, i, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  flags = flags_ref[b]
  active = (flags & _ACTIVE) != 0
  greedy = (flags & _GREEDY) != 0
  _, accept_len, _, _ = _accept_tests(
      b, tok_ref, u_ref, p_ref, q_refs,
      num_draft=num_draft, num_pos_pad=num_pos_pad, vocab_size=vocab_size)
  base = c * chunk
  num_blocks = chunk // block

  def store(best, best_idx, mass_r, mass_p, bad):
    max_ref[b, i, c] = best
    arg_ref[b, i, c] = best_idx
    mass_r_ref[b, i, c] = mass_r
    mass_p_ref[b, i, c] = mass_p
    bad_ref[b, i, c] = bad

  do_argmax = active & greedy
  do_masses = active & ~greedy & (i == accept_len)

  # pl.when rather than a value-returning lax.cond: the Triton lowering of cond cannot
  # yield constants, and idle programs should not even issue the loads.
  @pl.when(do_argmax)
  def _():
    def body(k, carry):
      best, best_idx = carry
      cols = base + k * block + jnp.arange(block, dtype=jnp.int32)
      in_vocab = cols < vocab_size
      p = _as_prob(plgpu.load(p_ref.at[b, i, cols], mask=in_vocab, other=0.0))
      p = jnp.where(in_vocab, p, -1.0)
      blk_best = jnp.max(p)
      blk_idx = base + k * block + jnp.argmax(p).astype(jnp.int32)
      better = blk_best > best  # strict: an earlier block wins ties (first index)
      return jnp.where(better, blk_best, best), jnp.where(better, blk_idx, best_idx)

    best, best_idx = lax.fori_loop(0, num_blocks, body, (jnp.float32(-2.0), base))
    store(best, best_idx, jnp.float32(0.0), jnp.float32(0.0), jnp.int32(0))

  @pl.when(do_masses)
  def _():
    def body(k, carry):
      mass_r, mass_p, bad = carry
      cols = base + k * block + jnp.arange(block, dtype=jnp.int32)
      r, p, bad_blk = _residual_block(
          b, i, cols, tok_ref, p_ref, q_refs, num_draft=num_draft, vocab_size=vocab_size)
      return (mass_r + jnp.sum(r), mass_p + jnp.sum(p),
              bad + jnp.sum(bad_blk.astype(jnp.int32)))

    mass_r, mass_p, bad = lax.fori_loop(
        0, num_blocks, body, (jnp.float32(0.0), jnp.float32(0.0), jnp.int32(0)))
    store(jnp.float32(-2.0), jnp.int32(_NO_INDEX), mass_r, mass_p, bad)

  @pl.when(~do_argmax & ~do_masses)
  def _():
    store(jnp.float32(-2.0), jnp.int32(_NO_INDEX), jnp.float32(0.0), jnp.float32(0.0),
          jnp.int32(0))


def _finish_kernel(
    flags_ref, tok_ref, u_ref, p_ref, *rest,
    num_draft, num_pos_pad, num_chunks, num_chunks_pad, vocab_size, block, chunk, has_q,
):
  q_refs, rest = (rest[:2], rest[2:]) if has_q else (None, rest)
  max_ref, arg_ref, mass_r_ref, mass_p_ref, bad_ref, out_tok_ref, stats_ref = rest
  b = pl.program_id(0)
  flags = flags_ref[b]
  active = (flags & _ACTIVE) != 0
  greedy = (flags & _GREEDY) != 0
  draft, accept_len_s, malformed_positions, counted = _accept_tests(
      b, tok_ref, u_ref, p_ref, q_refs,
      num_draft=num_draft, num_pos_pad=num_pos_pad, vocab_size=vocab_size)
  pos = jnp.arange(num_pos_pad, dtype=jnp.int32)
  chunk_ids = jnp.arange(num_chunks_pad, dtype=jnp.int32)
  real_chunk = chunk_ids < num_chunks

  # Greedy: combine chunk argmaxes (max value, then the smallest index holding it).
  pos2 = pos[:, None]
  chunk2 = chunk_ids[None, :]
  mask2 = (pos2 <= num_draft) & (chunk2 < num_chunks)
  part_max = plgpu.load(max_ref.at[b, pos2, chunk2], mask=mask2, other=-3.0)
  part_arg = plgpu.load(arg_ref.at[b, pos2, chunk2], mask=mask2, other=_NO_INDEX)
  best = jnp.max(part_max, axis=1)
  argmax_p = jnp.min(jnp.where(part_max == best[:, None], part_arg, _NO_INDEX), axis=1)
  matches = (pos < num_draft) & (draft == argmax_p)
  accept_len_g = jnp.min(jnp.where(matches, num_draft, pos)).astype(jnp.int32)
  token_g = jnp.sum(jnp.where(pos == accept_len_g, argmax_p, 0)).astype(jnp.int32)

  # Sampling: the final draw from the residual at j (or p_S), chunk by chunk.
  j = accept_len_s
  mass_r = plgpu.load(mass_r_ref.at[b, j, chunk_ids], mask=real_chunk, other=0.0)
  mass_p = plgpu.load(mass_p_ref.at[b, j, chunk_ids], mask=real_chunk, other=0.0)
  row_bad = jnp.sum(plgpu.load(bad_ref.at[b, j, chunk_ids], mask=real_chunk, other=0)) > 0
  fallback = ~(jnp.sum(mass_r) > 0.0)  # zero (or non-finite) residual mass
  mass = jnp.where(fallback, mass_p, mass_r)
  total = jnp.sum(mass)
  coin = u_ref[b, num_draft]
  target = coin * total
  cdf = jnp.cumsum(mass)
  hit = (cdf > target) & (mass > 0.0)
  last_nonempty = jnp.max(jnp.where(mass > 0.0, chunk_ids, -1))
  pick = jnp.min(jnp.where(hit, chunk_ids, num_chunks_pad))
  pick = jnp.where(pick < num_chunks_pad, pick, last_nonempty).astype(jnp.int32)
  local_target = target - jnp.sum(jnp.where(chunk_ids < pick, mass, 0.0))
  uniform_token = jnp.minimum((coin * vocab_size).astype(jnp.int32), vocab_size - 1)

  def draw():
    base = pick * chunk

    def body(k, carry):
      cols = base + k * block + jnp.arange(block, dtype=jnp.int32)
      r, p, _ = _residual_block(
          b, j, cols, tok_ref, p_ref, q_refs, num_draft=num_draft, vocab_size=vocab_size)
      return _common.inverse_cdf_block(carry, cols, jnp.where(fallback, p, r), local_target)

    return _common.inverse_cdf_token(
        lax.fori_loop(0, chunk // block, body, _common.inverse_cdf_init()))

  do_draw = active & ~greedy & (last_nonempty >= 0)
  token_s = lax.cond(do_draw, draw, lambda: uniform_token)

  accept_len = jnp.where(greedy, accept_len_g, accept_len_s)
  token = jnp.where(greedy, token_g, token_s)
  tokens = jnp.where(pos < accept_len, draft, jnp.where(pos == accept_len, token, PAD_TOKEN))
  tokens = jnp.where(active, tokens, PAD_TOKEN)
  plgpu.store(out_tok_ref.at[b, pos], tokens.astype(jnp.int32), mask=pos <= num_draft)

  sampling = active & ~greedy
  # A residual at j holding malformed entries counts once, also when position j already
  # counted (its q_j(d_j) or its row verdict).
  counted_j = jnp.sum(jnp.where((pos == j) & counted, 1, 0)) > 0
  row_only_bad = (j < num_draft) & row_bad & ~counted_j
  malformed = malformed_positions + _count(row_only_bad)
  field = jnp.arange(4, dtype=jnp.int32)  # accept_len, num_tokens, malformed, fallback
  stats = jnp.where(
      field == 0, accept_len,
      jnp.where(field == 1, accept_len + 1,
                jnp.where(field == 2, malformed * _count(sampling), _count(sampling & fallback))))
  stats = jnp.where(active, stats, 0).astype(jnp.int32)
  plgpu.store(stats_ref.at[b, field], stats)


# --------------------------------------------------------------------------------------
# pallas_call wrapper.
# --------------------------------------------------------------------------------------


def _speculative_sample_pallas(
    flags, draft_tokens, uniforms, p, q, q_ok, *, vocab_size, interpret, cfg: SamplerConfig):
  batch, num_draft = draft_tokens.shape
  block, chunk = cfg.block, cfg.chunk
  num_pos_pad = _common.next_power_of_2(num_draft + 1)
  num_chunks = _common.cdiv(vocab_size, chunk)
  has_q = q is not None
  operands = (flags, draft_tokens, uniforms, p) + ((q, q_ok) if has_q else ())
  part_shape = (batch, num_draft + 1, num_chunks)
  partials = pl.pallas_call(
      functools.partial(
          _partials_kernel, num_draft=num_draft, num_pos_pad=num_pos_pad,
          vocab_size=vocab_size, block=block, chunk=chunk, has_q=has_q),
      out_shape=(
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.int32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.int32),
      ),
      grid=(batch, num_draft + 1, num_chunks),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="spec_sampler_partials",
  )(*operands)
  tokens, stats = pl.pallas_call(
      functools.partial(
          _finish_kernel, num_draft=num_draft, num_pos_pad=num_pos_pad,
          num_chunks=num_chunks, num_chunks_pad=_common.next_power_of_2(num_chunks),
          vocab_size=vocab_size, block=block, chunk=chunk, has_q=has_q),
      out_shape=(
          jax.ShapeDtypeStruct((batch, num_draft + 1), jnp.int32),
          jax.ShapeDtypeStruct((batch, 4), jnp.int32),
      ),
      grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=interpret,
      name="spec_sampler_finish",
  )(*operands, *partials)
  return SamplerOutput(tokens, stats[:, 1], stats[:, 0], stats[:, 2], stats[:, 3])


# --------------------------------------------------------------------------------------
# Reference.
# --------------------------------------------------------------------------------------


def _prepare(draft_tokens, draft_probs, target_logits, rows, uniforms, vocab_size, active,
             draft_probs_ok, target_is_probs):
  batch, num_draft = draft_tokens.shape
  if target_logits.shape[:2] != (batch, num_draft + 1):
    raise ValueError(f"target_logits {target_logits.shape} vs draft_tokens {draft_tokens.shape}")
  if not 0 < vocab_size <= target_logits.shape[-1]:
    raise ValueError(f"vocab_size {vocab_size} vs V {target_logits.shape[-1]}")
  if draft_probs is not None and draft_probs.shape != (batch, num_draft, target_logits.shape[-1]):
    raise ValueError(f"draft_probs {draft_probs.shape} vs target_logits {target_logits.shape}")
  if draft_probs_ok is not None and draft_probs_ok.shape != (batch, num_draft):
    raise ValueError(f"draft_probs_ok {draft_probs_ok.shape} vs draft_tokens "
                     f"{draft_tokens.shape}")
  if target_is_probs:
    p = target_logits.astype(jnp.float32)
  else:
    p = sampling_probs(target_logits, rows, vocab_size)
  active = jnp.ones((batch,), bool) if active is None else jnp.asarray(active, bool)
  greedy = jnp.asarray(rows.top_k, jnp.int32) <= 1
  flags = (jnp.where(active, _ACTIVE, 0) | jnp.where(greedy, _GREEDY, 0)).astype(jnp.int32)
  q = q_ok = None
  if draft_probs is not None:
    q = draft_probs.astype(jnp.float32)
    q_ok = (jnp.ones((batch, num_draft), jnp.int32) if draft_probs_ok is None
            else jnp.asarray(draft_probs_ok).astype(jnp.int32))
  return (flags, jnp.asarray(draft_tokens, jnp.int32), jnp.asarray(uniforms, jnp.float32),
          p, q, q_ok, active, greedy)


def speculative_sample_reference(
    draft_tokens, draft_probs, target_logits, rows: SamplingRows, uniforms, vocab_size: int,
    active=None, *, draft_probs_ok=None, target_is_probs: bool = False) -> SamplerOutput:
  """Pure-jnp reference of :func:`speculative_sample` (same arguments and result)."""
  _, d, u, p, q, q_ok, active, greedy = _prepare(
      draft_tokens, draft_probs, target_logits, rows, uniforms, vocab_size, active,
      draft_probs_ok, target_is_probs)
  batch, num_draft = d.shape
  cols = jnp.arange(p.shape[-1])
  in_vocab = cols < vocab_size
  p = jnp.where(in_vocab, _as_prob(p), 0.0)  # [B, S+1, V]
  pos = jnp.arange(num_draft + 1)
  rows = jnp.arange(batch)

  valid = (d >= 0) & (d < vocab_size)
  safe = jnp.where(valid, d, 0)
  p_d = jnp.where(valid, jnp.take_along_axis(p[:, :num_draft], safe[..., None], -1)[..., 0], 0.0)
  if q is None:
    q_d = jnp.where(valid, 1.0, 0.0)
    row_ok = jnp.ones(d.shape, bool)
  else:
    q_d = jnp.where(valid, jnp.take_along_axis(q, safe[..., None], -1)[..., 0], 0.0)
    row_ok = q_ok != 0
  q_is_prob = (q_d > 0.0) & (q_d <= 1.0)
  accept = valid & q_is_prob & row_ok & (u[:, :num_draft] * q_d < p_d)
  accept_len_s = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
  counted = (valid & ~q_is_prob) | ~row_ok
  malformed_positions = jnp.sum(counted, axis=1)

  argmax_p = jnp.argmax(jnp.where(in_vocab, p, -1.0), axis=-1).astype(jnp.int32)  # [B, S+1]
  matches = d == argmax_p[:, :num_draft]
  accept_len_g = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
  token_g = argmax_p[rows, accept_len_g]

  j = accept_len_s
  p_j = p[rows, j]
  has_q = (j < num_draft)[:, None]
  jq = jnp.minimum(j, num_draft - 1)
  if q is None:
    q_j = jnp.where(has_q & valid[rows, jq][:, None] & (cols == d[rows, jq][:, None]), 1.0, 0.0)
    row_bad = jnp.zeros((batch,), bool)
  else:
    q_raw = q[rows, jq]
    entry_ok = (q_raw >= 0.0) & (q_raw <= 1.0)
    q_j = jnp.where(has_q & entry_ok & row_ok[rows, jq][:, None], q_raw, 0.0)
    row_bad = jnp.any(in_vocab & has_q & ~entry_ok, axis=-1)
  residual = jnp.where(in_vocab, jnp.maximum(p_j - q_j, 0.0), 0.0)
  fallback = ~(jnp.sum(residual, axis=-1) > 0.0)
  weights = jnp.where(fallback[:, None], p_j, residual)
  coin = u[:, num_draft]
  token_s = sample_from_probs(weights, coin)
  uniform_token = jnp.minimum((coin * vocab_size).astype(jnp.int32), vocab_size - 1)
  token_s = jnp.where(jnp.any(weights > 0, axis=-1), token_s, uniform_token)
  counted_j = (j < num_draft) & counted[rows, jq]
  malformed = malformed_positions + jnp.where(row_bad & ~counted_j, 1, 0)

  accept_len = jnp.where(greedy, accept_len_g, accept_len_s)
  token = jnp.where(greedy, token_g, token_s)
  d_pad = jnp.concatenate([d, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  tokens = jnp.where(pos < accept_len[:, None], d_pad,
                     jnp.where(pos == accept_len[:, None], token[:, None], PAD_TOKEN))
  tokens = jnp.where(active[:, None], tokens, PAD_TOKEN).astype(jnp.int32)
  sampling = active & ~greedy
  zero = jnp.zeros((batch,), jnp.int32)
  return SamplerOutput(
      tokens=tokens,
      num_tokens=jnp.where(active, accept_len + 1, 0).astype(jnp.int32),
      accept_len=jnp.where(active, accept_len, 0).astype(jnp.int32),
      num_malformed_q=jnp.where(sampling, malformed, zero).astype(jnp.int32),
      num_fallback=jnp.where(sampling & fallback, 1, zero).astype(jnp.int32),
  )


# --------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------


def speculative_sample(
    draft_tokens, draft_probs, target_logits, rows: SamplingRows, uniforms,
    vocab_size: int, active=None, *, draft_probs_ok=None, target_is_probs: bool = False,
    interpret: bool | None = None, target: str | None = None, block_v: int | None = None,
    chunk_v: int | None = None, num_stages: int | None = None) -> SamplerOutput:
  """Verify S draft tokens per row against the target (see the module docstring).

  Args:
    draft_tokens: [B, S] int32 draft ids (any value; out-of-range ones are rejected).
    draft_probs: [B, S, V] float32 draft distributions, or None for one-hot drafts.
    target_logits: [B, S+1, V] target logits (probabilities if target_is_probs).
    rows: the rows' sampling parameters, each field [B] (greedy iff top_k <= 1).
    uniforms: [B, S+1] float32 in [0, 1): S accept coins, then the final draw.
    vocab_size: the tokenizer's vocabulary size (<= V); no id >= it is emitted.
    active: [B] bool or None (all active); inactive rows emit only PAD_TOKEN.
    draft_probs_ok: [B, S] bool verdicts of the proposal's row check (None: all well
      formed); a draft token from a malformed row is never accepted, and is counted.
    target_is_probs: target_logits already holds probabilities (no filtering).
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
    target: the GPU to pick block sizes for (a key of ``_common.GPU_TARGETS``); None =
      automatic (``_common.resolve_target``).
    block_v, chunk_v, num_stages: override the block-size heuristic (tests, tuning).
  Returns:
    SamplerOutput with tokens [B, S+1] and per-row counters [B].
  """
  args = (draft_tokens, draft_probs, target_logits, rows, uniforms, vocab_size, active)
  supported = (
      _common.kernel_backend_ok(interpret, target_logits, draft_probs)
      and draft_tokens.ndim == 2 and draft_tokens.shape[1] >= 1
      and jnp.issubdtype(target_logits.dtype, jnp.floating)
      and (draft_probs is None or jnp.issubdtype(draft_probs.dtype, jnp.floating))
  )
  if not supported:
    return speculative_sample_reference(*args, draft_probs_ok=draft_probs_ok,
                                        target_is_probs=target_is_probs)
  flags, d, u, p, q, q_ok, _, _ = _prepare(*args, draft_probs_ok, target_is_probs)
  cfg = _block_sizes(vocab_size, _common.resolve_target(target), block_v, chunk_v, num_stages)
  return _speculative_sample_pallas(
      flags, d, u, p, q, q_ok, vocab_size=vocab_size,
      interpret=_common.resolve_interpret(interpret), cfg=cfg)
