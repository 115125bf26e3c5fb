"""Ragged paged attention (Pallas interpret mode) against its reference, and the
reference against an independent float64 loop.

Every case scatters the sequences' pages over the pool in a shuffled order, fills the
page-table columns past each sequence's pages with garbage (negative, past the pool),
and poisons every pool row that holds no live key (free pages and the tails of last
pages) with NaN: those rows must never reach the output. The kernel's output and
partial buffers are poisoned too: Pallas interpret mode fills them with NaN, so a row
that no program writes shows up as NaN.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels._common import GPU_TARGETS
from eagle_jax.kernels.paged_attention import (
    max_pool_pages, paged_attention, paged_attention_reference)

# The package exports the function under the module's name.
pa_mod = importlib.import_module("eagle_jax.kernels.paged_attention")

f32, bf16 = jnp.float32, jnp.bfloat16


def _cdiv(a, b):
  return -(-a // b)


def _inputs(rng, kv, ql, *, t, n, k, d, page_size, dtype, spare_cols=1, spare_pages=3):
  """Random q and pools with pages scattered through a shuffled free list.

  Returns (q, k_poisoned, v_poisoned, k_clean, v_clean, table, kv_len, q_len): the
  poisoned pools hold NaN wherever no live key is, the clean ones random values.
  """
  b = len(kv)
  need = [_cdiv(x, page_size) for x in kv]
  max_pages = max(need + [1]) + spare_cols
  num_pages = sum(need) + spare_pages
  free = rng.permutation(num_pages)
  table = rng.integers(-3, num_pages + 50, size=(b, max_pages)).astype(np.int32)
  live = np.zeros((num_pages, page_size), bool)
  used = 0
  for i, x in enumerate(kv):
    table[i, :need[i]] = free[used:used + need[i]]
    used += need[i]
    for j in range(x):
      live[table[i, j // page_size], j % page_size] = True
  shape = (num_pages, page_size, k, d)
  kc = rng.standard_normal(shape).astype(np.float32)
  vc = rng.standard_normal(shape).astype(np.float32)
  poison = lambda x: np.where(live[:, :, None, None], x, np.nan)
  q = rng.standard_normal((b, t, n, d)).astype(np.float32)
  as_ = lambda x: jnp.asarray(x, dtype)
  return (as_(q), as_(poison(kc)), as_(poison(vc)), as_(kc), as_(vc), jnp.asarray(table),
          jnp.asarray(kv, jnp.int32), jnp.asarray(ql, jnp.int32))


def _tree_mask(rng, ql, t, extra=0):
  """[B, T, extra + T]: node i < q_len has a random parent < i and sees its ancestors and
  itself; rows of padding tokens and columns past q_len are random (never to be read).
  The first `extra` columns (the keys just before the block) are random."""
  masks = rng.random((len(ql), t, t)) < 0.5
  for i, n in enumerate(ql):
    parent = [-1] + [int(rng.integers(0, j)) for j in range(1, n)]
    for node in range(n):
      masks[i, node, :n] = False
      a = node
      while a >= 0:
        masks[i, node, a] = True
        a = parent[a]
  return jnp.asarray(np.concatenate([rng.random((len(ql), t, extra)) < 0.5, masks], axis=2))


def _check(out, ref, ql, dtype):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(out)), "non-finite output: a poisoned row was read or a row not written"
  for i, n in enumerate(np.asarray(ql)):
    assert np.all(out[i, max(n, 0):] == 0.0), f"padding rows of sequence {i} are not exactly 0"
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == f32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(out, ref, **tol)


def _run(seed, kv, ql, *, t, n, k, d, page_size=16, dtype=f32, tree=False, extra=0,
         kv_dtype=None, **tuning):
  """``kv_dtype``: the pools' (``pa_mod.KV_FP8``: an FP8 cache, against the reference
  over the same e4m3 values)."""
  rng = np.random.default_rng(seed)
  q, kp, vp, kc, vc, table, kv_len, q_len = _inputs(
      rng, kv, ql, t=t, n=n, k=k, d=d, page_size=page_size, dtype=dtype)
  if kv_dtype is not None:  # 3 * N(0, 1): values up to ~15, e4m3's coarse steps in play
    kp, vp, kc, vc = (jnp.asarray(3 * x.astype(f32), kv_dtype) for x in (kp, vp, kc, vc))
  mask = _tree_mask(rng, ql, t, extra) if tree else None
  out = paged_attention(q, kp, vp, table, kv_len, q_len, block_mask=mask, **tuning)
  assert out.shape == q.shape and out.dtype == q.dtype
  ref = paged_attention_reference(q, kc, vc, table, kv_len, q_len, block_mask=mask)
  _check(out, ref, ql, dtype)
  # The reference is as blind to the poison as the kernel.
  ref_poisoned = paged_attention_reference(q, kp, vp, table, kv_len, q_len, block_mask=mask)
  np.testing.assert_array_equal(np.asarray(ref_poisoned, np.float32), np.asarray(ref, np.float32))
  return out


# Live lengths on page boundaries and +-1 (page_size 16), and an empty slot.
_EDGES = [15, 16, 17, 32, 1]

CASES = {
    # name: (kv lengths, q lengths, T, N, K, D, dtype, tuning)
    "decode_gqa4_f32": (_EDGES, [1] * 5, 1, 8, 2, 64, f32, {}),
    "decode_gqa1_bf16_d128": (_EDGES + [0], [1] * 5 + [0], 1, 2, 2, 128, bf16, {}),
    "verify_gqa8_f32": ([6, 47, 48, 0, 49], [6, 6, 3, 0, 6], 6, 16, 2, 64, f32, {}),
    "verify_gqa4_bf16_d128": ([6, 31, 33, 64], [6, 2, 6, 5], 6, 8, 2, 128, bf16, {}),
    "chunk_query_tiles_f32": ([40, 100, 77], [40, 17, 40], 40, 4, 2, 64, f32, dict(block_q=16)),
    "decode_splits_f32": ([1, 16, 17, 95, 200], [1] * 5, 1, 8, 2, 64, f32,
                          dict(num_splits=4, min_split=16, block_n=16)),
    "verify_splits_bf16": ([6, 33, 64, 190], [6, 6, 4, 6], 6, 8, 2, 128, bf16,
                           dict(num_splits=8, min_split=32, block_n=32)),
    "chunk_splits_tiles_f32": ([40, 130, 0], [40, 33, 0], 40, 4, 1, 64, f32,
                               dict(block_q=32, num_splits=3, min_split=16, block_n=16)),
    # The heuristic's choices for an MI300X (32-key tiles) over a short table.
    "verify_gfx942_bf16": ([6, 33, 64, 190], [6, 6, 4, 6], 6, 8, 2, 128, bf16,
                           dict(target="gfx942")),
    # An FP8 cache (``--kv-cache-dtype fp8``): e4m3 pools widened to q's dtype.
    "decode_fp8_kv_bf16_d128": (_EDGES, [1] * 5, 1, 8, 2, 128, bf16,
                                dict(kv_dtype=pa_mod.KV_FP8)),
    "verify_splits_fp8_kv_f32": ([6, 33, 64, 190], [6, 6, 4, 6], 6, 8, 2, 64, f32,
                                 dict(kv_dtype=pa_mod.KV_FP8, num_splits=4, min_split=16,
                                      block_n=16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name):
  kv, ql, t, n, k, d, dtype, tuning = CASES[name]
  _run(sum(map(ord, name)), kv, ql, t=t, n=n, k=k, d=d, dtype=dtype, **tuning)


@pytest.mark.parametrize("dtype,tuning", [
    (f32, {}), (bf16, dict(num_splits=4, min_split=16, block_n=16))])
def test_tree_mask(dtype, tuning):
  _run(7, [6, 40, 23, 17], [6, 6, 4, 1], t=6, n=8, k=2, d=64, dtype=dtype, tree=True, **tuning)


@pytest.mark.parametrize("dtype,extra,tuning", [
    (f32, 5, {}), (bf16, 21, dict(num_splits=4, min_split=16, block_n=16))])
def test_mask_wider_than_block(dtype, extra, tuning):
  """block_mask [B, T, T + extra]: the first `extra` columns are the keys just before the
  block. Regions starting before position 0 (kv 6, q 6), inside the committed prefix,
  and (with splits of 64 keys) across key tiles and split boundaries (kv 200)."""
  _run(9, [6, 40, 23, 17, 200], [6, 6, 4, 1, 5], t=6, n=8, k=2, d=64, dtype=dtype,
       tree=True, extra=extra, **tuning)


def test_wide_mask_all_before_block_is_causal():
  """True on every column before the block and lower-triangular inside it: the same
  output as the causal call, in kernel and reference."""
  rng = np.random.default_rng(10)
  kv, ql, t, extra = [6, 40, 200, 0], [6, 3, 6, 0], 6, 9
  q, kp, vp, kc, vc, table, kv_len, q_len = _inputs(rng, kv, ql, t=t, n=4, k=2, d=64,
                                                    page_size=16, dtype=f32)
  mask = np.concatenate([np.ones((4, t, extra), bool), np.tril(np.ones((4, t, t), bool))], 2)
  split = dict(num_splits=4, min_split=16, block_n=16)
  causal = paged_attention(q, kp, vp, table, kv_len, q_len, **split)
  masked = paged_attention(q, kp, vp, table, kv_len, q_len, block_mask=jnp.asarray(mask),
                           **split)
  _check(masked, causal, ql, f32)
  ref = paged_attention_reference(q, kc, vc, table, kv_len, q_len, block_mask=mask)
  np.testing.assert_allclose(np.asarray(ref), np.asarray(causal), rtol=2e-5, atol=2e-5)


def test_page_size_not_dividing_block_n():
  # 4-token pages: one 32-key tile gathers from 8 pages; 48-token pages: a page spans tiles.
  _run(11, [5, 64, 71], [1, 1, 1], t=1, n=4, k=1, d=64, page_size=4, block_n=32)
  _run(12, [5, 100, 47], [3, 3, 3], t=3, n=4, k=2, d=64, page_size=48, block_n=16)


def test_contract_violations_never_read_out_of_bounds():
  """kv_len past the page table / negative, q_len past T / negative / above kv_len:
  the kernel clamps (same rule as the reference) and stays finite."""
  rng = np.random.default_rng(5)
  q, kp, vp, kc, vc, table, _, _ = _inputs(rng, [40, 40, 40, 40], [2] * 4, t=4, n=4, k=2,
                                            d=64, page_size=16, dtype=f32, spare_cols=0)
  kv_len = jnp.asarray([1 << 20, -5, 3, 40], jnp.int32)
  q_len = jnp.asarray([4, 2, 4, 99], jnp.int32)
  out = paged_attention(q, kc, vc, table, kv_len, q_len, num_splits=2, min_split=16,
                        block_n=16)
  ref = paged_attention_reference(q, kc, vc, table, kv_len, q_len)
  _check(out, ref, np.clip(np.asarray(q_len), 0, 4), f32)
  assert np.all(np.asarray(out)[1] == 0.0)  # negative kv_len: an empty slot


def test_reference_against_float64_loop():
  rng = np.random.default_rng(3)
  kv, ql, t, n, k, d, ps = [5, 19, 33], [3, 1, 3], 3, 4, 2, 16, 8
  q, _, _, kc, vc, table, kv_len, q_len = _inputs(rng, kv, ql, t=t, n=n, k=k, d=d,
                                                  page_size=ps, dtype=f32)
  qn, kn, vn, tab = (np.asarray(x, np.float64) for x in (q, kc, vc, table))
  g = n // k
  # Causal; a tree over the block; a mask that also covers the 4 keys before the block
  # (for kv 5, q 3 those start before position 0). Every row sees its own key.
  for mask in (None, _tree_mask(rng, ql, t), _tree_mask(rng, ql, t, 4)):
    expect = np.zeros((len(kv), t, n, d))
    for b in range(len(kv)):
      start = kv[b] - ql[b]
      m0 = start - (0 if mask is None else mask.shape[2] - t)  # key of mask column 0
      for tok in range(ql[b]):
        vis = [j for j in range(kv[b]) if j < m0 or (
            j <= start + tok if mask is None else bool(mask[b, tok, j - m0]))]
        for head in range(n):
          keys = np.stack([kn[int(tab[b, j // ps]), j % ps, head // g] for j in vis])
          vals = np.stack([vn[int(tab[b, j // ps]), j % ps, head // g] for j in vis])
          s = keys @ qn[b, tok, head] / np.sqrt(d)
          p = np.exp(s - s.max())
          expect[b, tok, head] = p @ vals / p.sum()
    ref = paged_attention_reference(q, kc, vc, table, kv_len, q_len, block_mask=mask)
    np.testing.assert_allclose(np.asarray(ref), expect, rtol=1e-5, atol=1e-6)


def test_sm_scale_and_no_visible_key_row():
  """A tree row that masks out even itself, with no keys before the block, sees
  nothing: exact zeros in kernel and reference (never NaN)."""
  rng = np.random.default_rng(8)
  q, kp, vp, kc, vc, table, kv_len, q_len = _inputs(rng, [3, 20], [3, 3], t=3, n=2, k=1,
                                                    d=64, page_size=16, dtype=f32)
  mask = jnp.asarray(np.tril(np.ones((2, 3, 3), bool))).at[0, 1, :].set(False)
  out = paged_attention(q, kp, vp, table, kv_len, q_len, block_mask=mask, sm_scale=0.3)
  ref = paged_attention_reference(q, kc, vc, table, kv_len, q_len, block_mask=mask,
                                  sm_scale=0.3)
  _check(out, ref, [3, 3], f32)
  assert np.all(np.asarray(out)[0, 1] == 0.0)


def test_bad_shapes_raise():
  q = jnp.zeros((2, 3, 4, 16), f32)
  pool = jnp.zeros((5, 8, 2, 16), f32)
  table, lens = jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32)
  with pytest.raises(ValueError, match="k_pages"):
    paged_attention(q, jnp.zeros((5, 8, 2, 32), f32), pool, table, lens, lens)
  with pytest.raises(ValueError, match="v_pages"):
    paged_attention(q, pool, pool[:4], table, lens, lens)
  with pytest.raises(ValueError, match="multiple"):
    paged_attention(jnp.zeros((2, 3, 3, 16), f32), pool, pool, table, lens, lens)
  with pytest.raises(ValueError, match="page_table"):
    paged_attention(q, pool, pool, table[:1], lens, lens)
  with pytest.raises(ValueError, match="kv_len"):
    paged_attention(q, pool, pool, table, lens[:1], lens)
  with pytest.raises(ValueError, match="q_len"):
    paged_attention_reference(q, pool, pool, table, lens, jnp.ones((3,), jnp.int32))
  for shape in ((2, 3, 2), (2, 4, 4), (2, 3)):  # M < T, T mismatch, not 3-D
    with pytest.raises(ValueError, match=r"block_mask must be \[B=2, T=3, M\] with M >= T"):
      paged_attention(q, pool, pool, table, lens, lens, block_mask=jnp.ones(shape, bool))


def test_unsupported_dtype_falls_back_to_reference():
  rng = np.random.default_rng(2)
  q, kp, vp, kc, vc, table, kv_len, q_len = _inputs(rng, [9, 20], [1, 2], t=2, n=2, k=1,
                                                    d=16, page_size=8, dtype=jnp.float16)
  out = paged_attention(q, kc, vc, table, kv_len, q_len)
  ref = paged_attention_reference(q, kc, vc, table, kv_len, q_len)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_heuristic():
  bs = functools.partial(pa_mod._block_sizes, gpu=GPU_TARGETS["sm_90"])
  # Decode, B=1 over a 32k table: many splits; B=64 (512 programs): none.
  assert bs(1, 1, 4, 128, 8, 32768).num_splits == 64
  assert bs(64, 1, 4, 128, 8, 32768).num_splits == 1
  assert bs(256, 1, 4, 128, 8, 32768).num_splits == 1
  # A short page table caps the splits at capacity / MIN_SPLIT.
  assert bs(1, 1, 4, 128, 8, 512).num_splits == 2
  # Verify: 24 rows -> one 32-row tile; a 512-token prefill chunk: 32 tiles of 64 rows,
  # and MIN_SPLIT so large that it never splits at this capacity.
  cfg = bs(1, 6, 4, 128, 8, 32768)
  assert (cfg.block_q, cfg.min_split) == (32, 512)
  cfg = bs(1, 512, 4, 128, 8, 8192)
  assert (cfg.block_q, cfg.num_splits) == (64, 1)
  # A short chunk (126 tokens, 504 rows) over a long table: its 64-row tiles would give
  # 64 programs, fewer than the 132 SMs, so on NVIDIA it takes 32-row tiles of 128 keys
  # in 3 stages, and its keys split (4 splits bring 512 programs).
  cfg = bs(1, 126, 4, 128, 8, 8704)
  assert (cfg.block_q, cfg.block_n, cfg.min_split, cfg.num_splits, cfg.num_warps,
          cfg.num_stages) == (32, 128, 256, 4, 4, 3)
  # Explicit settings win over the short chunk's.
  cfg = bs(1, 126, 4, 128, 8, 8704, block_q=64, block_n=64, num_stages=2)
  assert (cfg.block_q, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 64, 4, 2)
  for cfg in (bs(3, 5, 3, 80, 2, 1000), bs(1, 1, 1, 256, 1, 1 << 20)):
    for v in (cfg.block_q, cfg.block_n, cfg.block_d, cfg.min_split):
      assert v & (v - 1) == 0
  with pytest.raises(ValueError, match="block_n"):
    bs(1, 1, 4, 128, 8, 4096, block_n=48)


def test_short_chunk_over_a_long_prefix():
  """A prefix-cache hit's shape: one sequence's short chunk (a partial query block) over
  a prefix several splits long, in the heuristic's short-chunk tiling (NVIDIA: 32-row
  query tiles, 128-key tiles, 3 stages); the last split ends inside a key tile."""
  q = jax.ShapeDtypeStruct((1, 64, 8, 32), f32)
  pages = jax.ShapeDtypeStruct((64, 16, 2, 32), f32)
  cfg = pa_mod.paged_attention_config(q, pages, jax.ShapeDtypeStruct((1, 64), jnp.int32))
  assert (cfg.block_q, cfg.block_n, cfg.num_stages) == (32, 128, 3) and cfg.num_splits > 1
  _run(21, [1000], [57], t=64, n=8, k=2, d=32)


def test_splits_follow_the_live_length():
  """With S static splits, a sequence uses cdiv(kv_len, split_len) of them: one for a
  short sequence (no partials, no combine work), all S for a long one."""
  cfg = pa_mod._block_sizes(1, 1, 4, 128, 8, 32768, gpu=GPU_TARGETS["sm_90"])  # 64 splits
  kv = jnp.asarray([0, 1, 128, 256, 257, 4096, 32768, 32767], jnp.int32)
  split_len = pa_mod._split_len(kv, num_splits=cfg.num_splits, min_split=cfg.min_split,
                                block_n=cfg.block_n)
  used = np.asarray(-(-kv // split_len))
  np.testing.assert_array_equal(used, [0, 1, 1, 1, 2, 16, 64, 64])
  assert np.all(np.asarray(split_len) % cfg.block_n == 0)


def test_jit_and_non_power_of_two_head_dim():
  # D = 80 pads to a 128-wide tile with masked columns.
  rng = np.random.default_rng(4)
  q, kp, vp, kc, vc, table, kv_len, q_len = _inputs(rng, [30, 7], [2, 1], t=2, n=6, k=3,
                                                    d=80, page_size=8, dtype=f32)
  out = jax.jit(paged_attention)(q, kp, vp, table, kv_len, q_len)
  _check(out, paged_attention_reference(q, kc, vc, table, kv_len, q_len), [2, 1], f32)


def test_paged_attention_refuses_a_pool_past_its_int32_rows():
  """The kernel's pool rows are int32: a pool of more than 2**31 - 1 rows (pages x
  page_size x K) is a ValueError at trace time and one at the limit traces, whatever its
  elements (2**37 here: the lowering's 64-bit offsets); a 1-byte pool's limit is 2**31
  elements (32-bit offsets up to 4 GiB). Shapes only, nothing is allocated."""
  page, k, d = 16, 2, 64
  most = max_pool_pages(page, k, d)
  assert most * page * k <= 2**31 - 1 < (most + 1) * page * k
  assert most * page * k * d * 2 > 2**32  # past 32-bit element offsets
  spec = jax.ShapeDtypeStruct

  def trace(num_pages):
    pool = spec((num_pages, page, k, d), jnp.bfloat16)
    return jax.eval_shape(
        paged_attention, spec((1, 1, 4, d), jnp.bfloat16), pool, pool,
        spec((1, 8), jnp.int32), spec((1,), jnp.int32), spec((1,), jnp.int32))

  assert trace(most).shape == (1, 1, 4, d)
  with pytest.raises(ValueError, match=f"more than the {most} the kernel addresses"):
    trace(most + 1)
  assert max_pool_pages(page, k, d, itemsize=1) == 2**31 // (page * k * d)