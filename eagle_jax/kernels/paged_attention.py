"""Ragged paged attention: query blocks of any length over a paged KV pool, Pallas / Triton.

Layout. One layer's keys and values live in two pools ``k_pages, v_pages: [P, page_size,
K, D]``. Sequence b owns the pages ``page_table[b, :]``; its key at absolute position j
is pool row ``page_table[b, j // page_size] * page_size + j % page_size`` of the pool
viewed as ``[P * page_size, K, D]`` (a free reshape). Sequence b has ``kv_len[b]`` live
keys and a query block of ``q_len[b]`` tokens (1 for decode, S+1 for verify, a prefill
chunk, later a tree of drafts), padded to a static T: they are the sequence's LAST
q_len[b] positions, query t sitting at ``kv_len[b] - q_len[b] + t``.

Visibility. No query sees keys at or after kv_len. Causal (the default): query t sees
every key up to its own position. With ``block_mask [B, T, M]`` (M >= T, static), the
mask covers the M key positions ending at the block's last, i.e. starting at ``kv_len -
q_len - (M - T)``: column u is key position ``kv_len - q_len - (M - T) + u``, visible to
query t iff ``block_mask[b, t, u]``; keys before that region are always visible. M == T
is a tree of draft tokens in the block (each node sees its ancestors and itself); M > T
also masks the M - T keys just before the block (a draft-tree level whose queries see
only their ancestors among the previous levels' KV). Rows t >= q_len[b] (padding),
empty sequences and rows that see no key output exact zeros. The mask is one predicate
on (row, key position) inside the key loop, so a per-sequence custom mask changes no
other part.

Kernel 1 (``_attention_kernel``), grid ``(query tiles, num_splits, B * K)``. One program
owns one (sequence b, KV head h, query tile, KV split s). Its query tile is BLOCK_Q rows
r = t * G + g of the flattened (token, group head) block (G = N // K query heads share
KV head h; T * G rows pad to >= 16, the smallest dot edge; a prefill chunk spans several
tiles), so every K/V tile it loads serves all G heads at once: a KV head's pages are
read once per query tile, i.e. once in decode and verify. The program walks keys in
BLOCK_N-row tiles (independent of page_size): it loads the page-table entries of the
tile's positions, clamps them into [0, P), and gathers the pool rows. The walk is a
``fori_loop`` with traced bounds (lowered to ``scf.for`` with dynamic bounds), from the
split's first key to the smallest of the split's end, the live length and, for causal
blocks, the tile's largest query position + 1: pages past the live length are never
read. Scores ``Q K^T`` and ``P V`` are 2-D ``dot_general`` calls with float32
accumulation (operands in the pool's dtype, P cast to it as flash attention does); the
online softmax runs in float32 in base 2 (log2(e) folded into the scale), with a finite
running-max floor so that fully masked tiles give exp2(-inf) = 0, never NaN.

Split-K (flash decoding) and the combine. ``num_splits`` S is static (heuristic below),
but each sequence cuts its own live length into splits of ``split_len(b) =
round_up(max(cdiv(kv_len[b], S), MIN_SPLIT), BLOCK_N)`` keys, so a short sequence uses
one split and a long one all S: every split with keys does real work, and the programs
of unused splits exit after two scalar loads. Per query row the number of splits that
hold its keys is ``n_row = cdiv(keys of the row, split_len(b))``:

* rows with n_row <= 1 (every row of a short sequence, padding rows, empty slots) are
  finished by split 0 itself: it writes the normalised output directly;
* rows with n_row >= 2 write an unnormalised float32 partial (acc [D], running max m,
  sum l) per split that holds their keys, and a second small kernel
  (``_combine_kernel``, one program per output row) merges exactly those n_row
  partials and writes the row; it exits at once for rows that split 0 finished.

So partial bytes exist only for rows that needed splitting, and there they are
(write + read) ~8 * (T * G) * D bytes per split per KV head against >= MIN_SPLIT * D *
2 * itemsize bytes of K/V read: MIN_SPLIT >= 16 * T * G keeps them under ~1/8 of the
live KV bytes (and under 1/30 for decode). With S == 1 there are no partials and no
second kernel. The output of kernel 1 is aliased into the combine (rows are written
by exactly one of the two kernels).

Bad input. Shape mismatches raise ValueError at trace time. kv_len and q_len are the
caller's contract, but never cause an out-of-bounds read: kv_len is clamped into [0,
max_pages * page_size], q_len into [0, T], page-table columns into [0, max_pages) and
page ids into [0, P). Unsupported dtypes or head sizes, and backends without a Triton
lowering (TPU), take the pure-jnp reference, which is also the engine's fallback. The
kernel computes pool rows (of the [P * page_size * K, D] view) in int32 and jax's Pallas
Triton lowering turns them into element offsets, in 64 bits for an array past 2**32
bytes and in 32 below it, where a pool of 2-byte or wider elements has at most 2**31
(an H100 read a 4.27 GiB pool's pages past element 2**31 right, tests/gpu): so a pool of
the kernel's dtypes is addressed right up to 2**31 - 1 rows; more is a ValueError naming
the page limit (``max_pool_pages``), never a wrapped offset. (A 1-byte pool of 2**31 to
2**32 elements would get wrapping 32-bit offsets: ``max_pool_pages(itemsize=1)`` caps it
at 2**31 elements.)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common

_LOG2E = 1.4426950408889634
# Floor of the running max: finite, so exp2(m_old - m_new) and exp2(-inf - m) stay
# well defined (1 and 0) while a row has seen no visible key yet.
_M_FLOOR = -1e30
# Programs kernel 1 aims for (about 4 per SM of an H200, 2 per CU of an MI300X or MI355X):
# below this, long sequences are split (see _block_sizes for the measurements).
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 64
_MAX_HEAD_DIM = 256
# An FP8 pool's format: OCP e4m3 on every device (MI300X's matrix units take fnuz, but the
# kernel widens K / V tiles to q's dtype before its dots, and Pallas' Triton lowering
# cannot convert fnuz).
KV_FP8 = jnp.dtype(jnp.float8_e4m3fn)
# Rows of the pool's [rows, D] view within the kernel's int32 row arithmetic.
_MAX_POOL_ROWS = 2**31 - 1


# --------------------------------------------------------------------------------------
# Input checks (shared by the kernel and the reference).
# --------------------------------------------------------------------------------------


def _check_inputs(q, k_pages, v_pages, page_table, kv_len, q_len, block_mask):
  """Raises ValueError naming the argument whose shape is wrong; returns the sizes."""
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, N, D], got shape {q.shape}")
  b, t, n, d = q.shape
  if k_pages.ndim != 4 or k_pages.shape[3] != d:
    raise ValueError(f"k_pages must be [P, page_size, K, D={d}], got shape {k_pages.shape}")
  num_pages, page_size, k, _ = k_pages.shape
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages must have k_pages' shape {k_pages.shape}, got {v_pages.shape}")
  if k == 0 or n % k:
    raise ValueError(f"q's N={n} query heads must be a multiple of k_pages' K={k} kv heads")
  if page_table.ndim != 2 or page_table.shape[0] != b:
    raise ValueError(f"page_table must be [B={b}, max_pages], got shape {page_table.shape}")
  if kv_len.shape != (b,):
    raise ValueError(f"kv_len must be [B={b}], got shape {kv_len.shape}")
  if q_len.shape != (b,):
    raise ValueError(f"q_len must be [B={b}], got shape {q_len.shape}")
  if block_mask is not None and (block_mask.ndim != 3 or block_mask.shape[:2] != (b, t)
                                 or block_mask.shape[2] < t):
    raise ValueError(f"block_mask must be [B={b}, T={t}, M] with M >= T, got shape "
                     f"{block_mask.shape}; for a mask of the block alone use M = T")
  for name, x in (("page_table", page_table), ("kv_len", kv_len), ("q_len", q_len)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array, got {x.dtype}")
  return b, t, n, d, num_pages, page_size, k, page_table.shape[1]


def _scale(sm_scale, head_dim):
  return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def max_pool_pages(page_size: int, kv_heads: int, head_dim: int, *, itemsize: int = 2) -> int:
  """The most pages a [P, page_size, kv_heads, head_dim] pool may have for the kernel to
  address it: its rows within int32 and, for 1-byte elements, its elements within 2**31
  (module docstring). At page size 16 and K = 8 that is 16.8M pages (268M positions, 512
  GiB of bfloat16 K per layer at D = 128): no GPU's memory reaches it."""
  most = _MAX_POOL_ROWS // (page_size * kv_heads)
  if itemsize < 2:
    most = min(most, _common.MAX_INDEXED_ELEMENTS // (page_size * kv_heads * head_dim))
  return most


# --------------------------------------------------------------------------------------
# Reference (pure jnp; the fallback).
# --------------------------------------------------------------------------------------


def paged_attention_reference(
    q,           # [B, T, N, D]
    k_pages,     # [P, page_size, K, D]
    v_pages,     # [P, page_size, K, D]
    page_table,  # [B, max_pages] int
    kv_len,      # [B] int
    q_len,       # [B] int
    *,
    block_mask=None,  # [B, T, M >= T] bool or None (causal)
    sm_scale=None,
):
  """Dense reference: gathers each sequence's pages into [B, max_pages * page_size, K, D]
  and runs masked softmax attention in float32. Same clamping and visibility as the
  kernel; keys past the live length are zeroed after the gather (a freed page may hold
  NaN). Returns [B, T, N, D] in q.dtype.
  """
  b, t, n, d, num_pages, page_size, k, max_pages = _check_inputs(
      q, k_pages, v_pages, page_table, kv_len, q_len, block_mask)
  g = n // k
  cap = max_pages * page_size
  kv = jnp.clip(kv_len.astype(jnp.int32), 0, cap)
  ql = jnp.clip(q_len.astype(jnp.int32), 0, t)
  pages = jnp.clip(page_table.astype(jnp.int32), 0, max(num_pages - 1, 0))
  pos = jnp.arange(cap, dtype=jnp.int32)
  live = pos[None, :] < kv[:, None]  # [B, L]

  def dense(pool):  # [B, L, K, D], zero past the live length
    x = pool[pages].reshape(b, cap, k, d)
    return jnp.where(live[:, :, None, None], x, jnp.zeros((), x.dtype))

  keys, values = dense(k_pages), dense(v_pages)
  tok = jnp.arange(t, dtype=jnp.int32)
  start = kv - ql  # [B] first position of the block
  if block_mask is None:
    qpos = start[:, None] + tok[None, :]  # [B, T]
    visible = pos[None, None, :] <= qpos[:, :, None]
  else:
    cols = block_mask.shape[2]
    mstart = start - (cols - t)  # [B] key position of mask column 0
    u = jnp.clip(pos[None, :] - mstart[:, None], 0, cols - 1)  # [B, L] mask column of a key
    in_region = pos[None, :] >= mstart[:, None]
    bm = block_mask.astype(jnp.bool_)[
        jnp.arange(b)[:, None, None], tok[None, :, None], u[:, None, :]]  # [B, T, L]
    visible = jnp.where(in_region[:, None, :], bm, True)
  visible = visible & live[:, None, :] & (tok[None, :] < ql[:, None])[:, :, None]

  hi = lax.Precision.HIGHEST
  qg = q.reshape(b, t, k, g, d)
  s = jnp.einsum("btkgd,blkd->bkgtl", qg, keys, preferred_element_type=jnp.float32,
                 precision=hi) * _scale(sm_scale, d)
  s = jnp.where(visible[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # 0 where not visible
  l = jnp.sum(p, axis=-1)  # [B, K, G, T]
  o = jnp.einsum("bkgtl,blkd->btkgd", p, values.astype(jnp.float32), precision=hi)
  l = jnp.transpose(l, (0, 3, 1, 2))[..., None]  # [B, T, K, G, 1]
  o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
  return o.reshape(b, t, n, d).astype(q.dtype)


# --------------------------------------------------------------------------------------
# Heuristic.
# --------------------------------------------------------------------------------------


class PagedAttentionConfig(NamedTuple):
  """The tiling, splits and launch parameters of one call (see ``_block_sizes``)."""

  block_q: int      # query rows (token, group head) per program
  block_n: int      # keys per loop step
  block_d: int      # head_dim padded to a power of two
  num_splits: int   # static KV splits (1 = no combine)
  min_split: int    # fewest keys in one split of one sequence
  num_warps: int
  num_stages: int
  combine_warps: int  # of the combine kernel (one [splits, D] tile per program)


def _block_sizes(batch, q_tokens, group, head_dim, kv_heads, capacity, *,
                 gpu: _common.GpuTarget, causal=True, block_q=None, block_n=None,
                 num_splits=None, min_split=None, num_warps=None, num_stages=None
                 ) -> PagedAttentionConfig:
  """Tile sizes, splits and launch parameters; every argument left None is heuristic.

  BLOCK_Q = T * G rounded up to a power of two, at least 16 (the smallest tensor-core
  dot edge: decode with G = 4 wastes 3/4 of a tiny dot, which is free in a bandwidth
  bound loop) and at most 64, so a prefill chunk becomes several query tiles. A block of
  >= 64 rows whose B * K * tiles programs would fill fewer than half the cores takes
  narrower tiles (down to 16): a 32-token tree verify at B = 1 (128 rows,
  K = 8) ran in 12.9 us at 16-row tiles against 28.8 us at 64 on an H200 (288 keys,
  2026-12-01); at B >= 8 the 64-row tiles already give ~128 programs. 4 warps, but 8
  for a 64-row tile on AMD, past D = 128 or under a block mask; 2 pipeline stages. On
  AMD 4 wavefronts are one per SIMD of the CU, each with its own matrix core. On an
  H100 (2026-12-05, 20 calls in one jit, 32 / 8 heads, D = 128, bf16), causal 64-row
  tiles in 4 warps against 8: a 512-token prefill chunk over 2048 / 4096 / 8192 keys
  71-81 / 131-133 / 252 us against 102-112 / 189-190 / 359; a 32-token block at B = 64
  over 4096 keys 552 against 735 (B = 8: 104-106 against 146), a 16-token block 408-412
  against 442. In the engine a 2112-token prompt's first token
  came 1.1-3.3 ms sooner (docs/history/2026-12-05-issue-14-prefix-caching.md, "Issue 14,
  2026-12-05, fifth session").
  A draft tree's verify (a block mask) keeps 8: its 32-token tile at 4 warps takes 255
  registers and 56-64 bytes of stack (sm_90 cubin, scripts/rocm_compile.py), untimed.

  BLOCK_N, NVIDIA: 64 keys (32 for D > 128), 16 KiB per bf16 K or V tile at D = 128.
  Gathered K/V tiles keep an address per element, so wider tiles cost registers. At
  D = 128, bf16 (scripts/rocm_compile.py, triton 3.8, sm_90), the decode tile (BLOCK_Q =
  16, 4 warps) takes 80 registers and 38 KiB of shared memory, the verify tile (BLOCK_Q =
  32) 140 registers, without spills. On an H200 (2026-11-30, scripts/bench_attention.py
  --sweep) the S + 1 = 6 verify tile ran in 0.357 ms at 4 warps against 0.484 ms at 8
  (B = 64, 4096 keys each); 2 stages (1: 26% slower; 3: no gain: below 5 stages Triton
  gives the gathered K / V tile one shared buffer behind its page-table load, so no
  gather overlaps the dots; docs/history/2026-12-04-issue-14-prefix-caching.md, fourth
  session). Carrying
  the next tile's page ids through the loop gets two buffers at 3 stages, but the short
  chunk's tile then needs 144 KiB of shared memory and ran 17-26% slower (H200,
  2026-12-05).
  BLOCK_N, AMD (wavefront 64): half that, 32 keys (16 for D > 128). Compiled for gfx942
  and gfx950 at 64 keys (Llama-3.1-8B and Qwen3-32B shapes, scripts/rocm_compile.py),
  the verify tiles take 226-254 VGPRs (2 waves per SIMD), the tree-verify tile 251-275
  and spills 24-54 SGPRs or 6 VGPRs, the decode tile 126-204 VGPRs and, in 2 stages of
  64 keys, 66 KiB of gfx950's LDS. At 32 keys every tile fits in 104-194 VGPRs and 42-68
  SGPRs without spills, 2-4 waves per SIMD, 16-42 KiB of LDS (docs/ROCM.md): two
  workgroups of 32-key tiles keep the bytes of one 64-key workgroup in flight, with
  twice the waves to hide latency.

  MIN_SPLIT = max(256, 16 * T * G) keys, a power of two: a split's partials cost
  ~8 * T * G * D bytes (float32 write + read) against >= MIN_SPLIT * 2 * D * itemsize
  bytes of K/V, so with MIN_SPLIT >= 16 * T * G they stay below 1/8 of the live KV bytes.
  A prefill chunk's block (T * G >= 256 rows) whose query tiles give fewer programs
  than the GPU has cores takes a smaller MIN_SPLIT instead (AMD: 2 * T * G, partials
  up to 1/2 of the KV bytes; NVIDIA: 256, below): one sequence's short chunk over a long
  prefix (a chunk riding in a decode step, a prefix-cache hit's suffix) is a grid
  smaller than the GPU whose programs each scan every key, latency-bound, so splits pay
  for their partials; on AMD such a block keeps 64-row query tiles (the narrowing above
  is for tree verifies) and gets its parallelism from splits. On NVIDIA it takes 32-row
  query tiles of 128-key tiles in 3 stages, 4 warps, and MIN_SPLIT = 256: each program
  keeps more key bytes in flight.
  H200, 2026-12-03 (R = 20 calls in one jit, two rounds, 32 / 8 heads, D = 128, bf16):
  a 128-token chunk over 8192 keys 155-161 us against 220-223 us in 64-row, 64-key
  tiles (8 splits of 1024), over 16384 keys 278-281 against 384-392, a prefix-cache
  hit's 80 live rows over 2112 keys 60-81 against 72-76 us, over 8272 keys 150-158
  against 168-179 us; in the engine the hit's time to first token fell 0.3-0.6 ms
  (docs/history/2026-12-03-issue-14-prefix-caching.md, "Issue 14, 2026-12-03, second
  session"); a 64-token chunk over
  4096 keys, 66-82 against 65-69 us, gains nothing. Fewer splits of that hit (80 live
  rows over 2112 keys) are slower in the engine (H200, 2026-12-05, traced: 4 splits 33 +
  4 us of combine, one split 43 us, one live split of MIN_SPLIT = 4096 66 us), though
  one split wins the microbenchmark's fully live 128 rows. From 8192 keys on, 2 stages
  were 5-8% slower and 64-key tiles 14-22%. The tile takes 202 registers and 80.5 KiB of
  shared memory on sm_90 without spills (scripts/rocm_compile.py's cubin). On gfx942
  / gfx950 the 64-key form of that tile (half the keys, as below) compiles without
  spills in 232-254 VGPRs (2 waves per SIMD, against 3 for the AMD rule's), 3 stages
  spill SGPRs; unmeasured on an AMD GPU, so AMD keeps its rule. Longer chunks fill the
  GPU with query tiles and keep the 16x rule; on gfx942 (304 CUs) a 512-token chunk
  (256 programs) splits too.
  num_splits = the power of two that brings B * K * query tiles up to ~512 programs, but
  no more than the page table's capacity / MIN_SPLIT and 64: decode at B = 1 over a 32k
  table gets 64 splits (512 programs of 512 keys), B = 64 decode with K = 8 none. On the
  H200, B = 64 decode over 4096 keys ran at 95% of copy bandwidth without splits
  (0.279 ms) and 0.306 ms with 2; B = 1 over 32768 keys took 0.068 ms with 64 or 128
  splits alike. The same 512 on AMD, about 2 programs per CU: more would split B = 64
  verify and add a combine pass, a trade the H200 measured as a loss at 4 programs per
  SM and nobody has measured on an MI300X / MI355X. The per-sequence split length keeps
  short sequences on one split.
  """
  rows = q_tokens * group
  block_d = max(16, _common.next_power_of_2(head_dim))
  bq = block_q or min(64, max(16, _common.next_power_of_2(rows)))
  bn = block_n or (64 if block_d <= 128 else 32) * 32 // gpu.warp_size
  if block_q is None:
    # A few sequences' wide query blocks (a draft tree's verify at small batch) would
    # leave most cores idle: narrower query tiles until half the cores have a program.
    # Not a prefill chunk's (>= 256 rows): its keys split instead (below).
    while bq > 16 and 64 <= rows < 256 and batch * kv_heads * _common.cdiv(rows, bq) < (
        gpu.num_cores // 2):
      bq //= 2
  nvidia = gpu.warp_size == 32
  small_chunk = rows >= 256 and batch * kv_heads * _common.cdiv(rows, bq) < gpu.num_cores
  if small_chunk and nvidia:
    # NVIDIA: the short chunk's programs each walk a long key range; 32-row query tiles
    # over 128-key tiles in 3 stages keep more bytes in flight per program.
    bq, bn = block_q or 32, block_n or 128
  q_tiles = _common.cdiv(rows, bq)
  if not min_split:  # None or 0: the heuristic
    min_split = ((256 if nvidia else 2 * _common.next_power_of_2(rows))
                 if small_chunk else max(256, _common.next_power_of_2(16 * rows)))
  ms = max(min_split, bn)
  if num_splits is None:
    programs = batch * kv_heads * q_tiles
    want = _common.next_power_of_2(_common.cdiv(_TARGET_PROGRAMS, programs))
    by_capacity = max(1, capacity // ms)
    by_capacity = 1 << (by_capacity.bit_length() - 1)  # power of two at most that
    num_splits = max(1, min(want, by_capacity, _MAX_SPLITS))
  warps = num_warps or (4 if bq <= 32 or (nvidia and causal and block_d <= 128) else 8)
  stages = num_stages or (3 if small_chunk and nvidia else 2)
  for name, v in (("block_q", bq), ("block_n", bn)):
    if v < 16 or v & (v - 1):
      raise ValueError(f"{name}={v} must be a power of two >= 16")
  if num_splits < 1:
    raise ValueError(f"num_splits={num_splits} must be >= 1")
  combine_warps = 4 if _common.next_power_of_2(num_splits) * block_d >= 4096 else 2
  return PagedAttentionConfig(bq, bn, block_d, int(num_splits), int(ms), warps, stages,
                              combine_warps)


def paged_attention_config(q, k_pages, page_table, *, target=None, causal=True,
                           **tuning) -> PagedAttentionConfig:
  """The configuration ``paged_attention`` picks for these shapes (arrays or
  ShapeDtypeStructs), GPU target, mask (``causal=False``: a block mask is given) and
  tuning overrides; for benchmarks and logs."""
  b, t, n, d = q.shape
  _, page_size, k, _ = k_pages.shape
  return _block_sizes(b, t, n // k, d, k, page_table.shape[1] * page_size,
                      gpu=_common.resolve_target(target), causal=causal, **tuning)


# --------------------------------------------------------------------------------------
# Kernel bodies.
# --------------------------------------------------------------------------------------


def _split_len(kv, *, num_splits, min_split, block_n):
  """Keys per split of a sequence with kv live keys (a multiple of block_n)."""
  n = jnp.maximum(pl.cdiv(kv, num_splits), min_split)
  return pl.cdiv(n, block_n) * block_n


def _row_keys(kv, ql, t, row_ok, causal):
  """Keys a query row may see lie in [0, the returned count): its position + 1 when
  causal, the whole live length under a block mask, 0 for padding rows."""
  hi = jnp.clip(kv - ql + t + 1, 0, kv) if causal else jnp.broadcast_to(kv, t.shape)
  return jnp.where(row_ok, hi, 0)


def _store_rows(mask, rows, num_rows):
  """Rows of a masked store, with masked-out lanes sent one past the end.

  On a GPU a masked lane touches no memory, whatever its address. Pallas interpret
  mode stores by a scatter that writes masked lanes back with the value it read, so a
  masked lane must not share a row with a live one (padding rows clamp their token
  index and would); past the end, the scatter drops it.
  """
  return jnp.where(mask, rows, num_rows)


def _attention_kernel(
    # inputs
    kv_len_ref,  # [B] int32
    q_len_ref,   # [B] int32
    table_ref,   # [B * max_pages] int32
    q_ref,       # [B * T * N, D]
    k_ref,       # [P * page_size * K, D]
    v_ref,       # [P * page_size * K, D]
    *refs,       # block mask [B * T, M] int8 if given; out [B * T * N, D]; partials
    causal: bool, t_len: int, mask_cols: int, num_heads: int, kv_heads: int, head_dim: int,
    page_size: int, max_pages: int, num_pages: int, scale_log2: float, cfg: PagedAttentionConfig,
):
  if causal:
    mask_ref, (o_ref, *part_refs) = None, refs
  else:
    mask_ref, o_ref, *part_refs = refs
  group = num_heads // kv_heads
  bq, bn, bd, num_splits = cfg.block_q, cfg.block_n, cfg.block_d, cfg.num_splits
  qt, s, bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  b, h = bh // kv_heads, bh % kv_heads
  kv = jnp.clip(kv_len_ref[b], 0, max_pages * page_size)
  ql = jnp.clip(q_len_ref[b], 0, t_len)
  start = kv - ql  # position of block token 0
  mstart = start - (mask_cols - t_len)  # position of mask column 0

  # The tile's query rows r = t * G + g (token t, head h * G + g).
  r = qt * bq + jnp.arange(bq, dtype=jnp.int32)
  t = r // group
  row_in = r < t_len * group
  row_ok = row_in & (t < ql)
  t_safe = jnp.minimum(t, t_len - 1)
  qrow = (b * t_len + t_safe) * num_heads + h * group + r % group  # [BQ] rows of q / out
  d = jnp.arange(bd, dtype=jnp.int32)
  d_ok = d < head_dim

  # Keys of split s that any row of this tile sees: [lo, hi).
  split_len = _split_len(kv, num_splits=num_splits, min_split=cfg.min_split, block_n=bn)
  n_row = pl.cdiv(_row_keys(kv, ql, t, row_ok, causal), split_len)  # splits per row
  t_last = jnp.minimum(jnp.minimum((qt * bq + bq - 1) // group, t_len - 1), ql - 1)
  tile_keys = _row_keys(kv, ql, t_last, t_last >= (qt * bq) // group, causal)
  lo = s * split_len
  hi = jnp.minimum(tile_keys, lo + split_len)

  def attend():
    q = plgpu.load(q_ref.at[qrow[:, None], d[None, :]],
                   mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qpos = start + t  # [BQ]

    def body(i, carry):
      acc, m, l = carry
      pos = lo + i * bn + jnp.arange(bn, dtype=jnp.int32)  # [BN] key positions
      key_ok = pos < hi
      col = jnp.minimum(pos // page_size, max_pages - 1)
      page = plgpu.load(table_ref.at[b * max_pages + col], mask=key_ok, other=0)
      page = jnp.clip(page, 0, num_pages - 1)
      krow = (page * page_size + pos % page_size) * kv_heads + h  # [BN] pool rows
      kv_mask = key_ok[:, None] & d_ok[None, :]
      k = plgpu.load(k_ref.at[krow[:, None], d[None, :]], mask=kv_mask, other=0.0)
      k = k.astype(q.dtype)  # an FP8 pool's tile, widened in registers
      sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32) * scale_log2  # [BQ, BN]
      if causal:
        # key < hi and key <= the row's position, as one compare per score: on a 64-wide
        # wavefront each compare is a 64-bit SGPR mask, and two per score (and their AND)
        # filled gfx942's / gfx950's SGPRs in the split verify tile and spilled.
        visible = pos[None, :] < jnp.minimum(qpos + 1, hi)[:, None]
      else:
        in_region = pos >= mstart
        u = jnp.clip(pos - mstart, 0, mask_cols - 1)
        bm = plgpu.load(mask_ref.at[(b * t_len + t_safe)[:, None], u[None, :]],
                        mask=row_ok[:, None] & (key_ok & in_region)[None, :], other=0)
        visible = key_ok[None, :] & (~in_region[None, :] | (bm != 0))
      sc = jnp.where(visible, sc, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(sc, axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(sc - m_new[:, None])
      v = plgpu.load(v_ref.at[krow[:, None], d[None, :]], mask=kv_mask, other=0.0)
      v = v.astype(q.dtype)
      pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
      return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, bd), jnp.float32), jnp.full((bq,), _M_FLOOR, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    return lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), bn), body, init)

  # Split 0 always runs (it writes every row finished in one split, padding included);
  # another split runs only if some row of the tile has keys in it.
  @pl.when((s == 0) | (lo < hi))
  def _():
    acc, m, l = attend()
    if num_splits > 1:
      acc_ref, m_ref, l_ref = part_refs
      part = row_ok & (s < n_row) & (n_row >= 2)
      prow = _store_rows(part, qrow * num_splits + s, acc_ref.shape[0])
      plgpu.store(acc_ref.at[prow[:, None], d[None, :]], acc,
                  mask=part[:, None] & d_ok[None, :])
      plgpu.store(m_ref.at[prow], m, mask=part)
      plgpu.store(l_ref.at[prow], l, mask=part)

    @pl.when(s == 0)
    def _():
      done = row_ok & (l > 0.0)
      out = jnp.where(done[:, None], acc / jnp.where(done, l, 1.0)[:, None], 0.0)
      final = row_in & (n_row <= 1) if num_splits > 1 else row_in
      orow = _store_rows(final, qrow, o_ref.shape[0])
      plgpu.store(o_ref.at[orow[:, None], d[None, :]], out.astype(o_ref.dtype),
                  mask=final[:, None] & d_ok[None, :])


def _combine_kernel(
    kv_len_ref,  # [B] int32
    q_len_ref,   # [B] int32
    acc_ref,     # [B * T * N * S, D] float32 unnormalised partial outputs
    m_ref,       # [B * T * N * S] float32 running maxima (base 2)
    l_ref,       # [B * T * N * S] float32 sums
    o_in_ref,    # [B * T * N, D] kernel 1's output, aliased to o_ref
    o_ref,       # [B * T * N, D]
    *, causal: bool, t_len: int, num_heads: int, head_dim: int, page_size: int,
    max_pages: int, cfg: PagedAttentionConfig,
):
  del o_in_ref  # rows finished by kernel 1 stay as they are
  n, t, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  kv = jnp.clip(kv_len_ref[b], 0, max_pages * page_size)
  ql = jnp.clip(q_len_ref[b], 0, t_len)
  split_len = _split_len(kv, num_splits=cfg.num_splits, min_split=cfg.min_split,
                         block_n=cfg.block_n)
  n_row = pl.cdiv(_row_keys(kv, ql, t, t < ql, causal), split_len)

  @pl.when(n_row >= 2)
  def _():
    sp = jnp.arange(_common.next_power_of_2(cfg.num_splits), dtype=jnp.int32)
    s_ok = sp < n_row
    row = (b * t_len + t) * num_heads + n
    prow = row * cfg.num_splits + sp
    d = jnp.arange(cfg.block_d, dtype=jnp.int32)
    d_ok = d < head_dim
    m = plgpu.load(m_ref.at[prow], mask=s_ok, other=_M_FLOOR)
    l = plgpu.load(l_ref.at[prow], mask=s_ok, other=0.0)
    acc = plgpu.load(acc_ref.at[prow[:, None], d[None, :]],
                     mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    w = jnp.exp2(m - jnp.max(m))
    total = jnp.sum(w * l)
    out = jnp.sum(w[:, None] * acc, axis=0) / jnp.where(total > 0.0, total, 1.0)
    plgpu.store(o_ref.at[row, d], out.astype(o_ref.dtype), mask=d_ok)


# --------------------------------------------------------------------------------------
# pallas_call wrapper.
# --------------------------------------------------------------------------------------


def _paged_attention_pallas(q, k_pages, v_pages, page_table, kv_len, q_len, block_mask, *,
                            scale, interpret, cfg: PagedAttentionConfig):
  b, t, n, d = q.shape
  num_pages, page_size, kv_heads, _ = k_pages.shape
  max_pages = page_table.shape[1]
  group = n // kv_heads
  causal = block_mask is None
  q_tiles = pl.cdiv(t * group, cfg.block_q)
  i32 = jnp.int32
  statics = dict(causal=causal, t_len=t, num_heads=n, head_dim=d, page_size=page_size,
                 max_pages=max_pages, cfg=cfg)
  lens = (kv_len.astype(i32), q_len.astype(i32))
  inputs = [*lens, page_table.astype(i32).reshape(-1), q.reshape(b * t * n, d),
            k_pages.reshape(-1, d), v_pages.reshape(-1, d)]
  mask_cols = t if causal else block_mask.shape[2]
  if not causal:
    inputs.append(block_mask.astype(jnp.int8).reshape(b * t, mask_cols))
  rows = b * t * n
  out_shape = [jax.ShapeDtypeStruct((rows, d), q.dtype)]
  if cfg.num_splits > 1:
    parts = rows * cfg.num_splits
    out_shape += [jax.ShapeDtypeStruct((parts, d), jnp.float32),
                  jax.ShapeDtypeStruct((parts,), jnp.float32),
                  jax.ShapeDtypeStruct((parts,), jnp.float32)]
  params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  kernel = functools.partial(
      _attention_kernel, mask_cols=mask_cols, kv_heads=kv_heads, num_pages=num_pages,
      scale_log2=scale * _LOG2E, **statics)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(q_tiles, cfg.num_splits, b * kv_heads),
      compiler_params=params, interpret=interpret, name="paged_attention",
  )(*inputs)
  out = outs[0]
  if cfg.num_splits > 1:
    out = pl.pallas_call(
        functools.partial(_combine_kernel, **statics),
        out_shape=jax.ShapeDtypeStruct((rows, d), q.dtype), grid=(n, t, b),
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.combine_warps, num_stages=1),
        interpret=interpret, name="paged_attention_combine",
    )(*lens, *outs[1:], out)
  return out.reshape(b, t, n, d)


# --------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------


def paged_attention(
    q,           # [B, T, N, D]
    k_pages,     # [P, page_size, K, D]
    v_pages,     # [P, page_size, K, D]
    page_table,  # [B, max_pages] int32
    kv_len,      # [B] int32
    q_len,       # [B] int32
    *,
    block_mask=None,  # [B, T, M >= T] bool or None
    sm_scale=None,
    interpret=None,
    target=None,
    block_q=None,
    block_n=None,
    num_splits=None,
    min_split=None,
    num_warps=None,
    num_stages=None,
):
  """Attention of each sequence's query block over its pages of the KV pool.

  Args:
    q: [B, T, N, D] queries; row t < q_len[b] of sequence b sits at position
      kv_len[b] - q_len[b] + t. N must be a multiple of K (GQA, G = N // K).
    k_pages, v_pages: [P, page_size, K, D] one layer's key / value pool, in q's dtype
      (bfloat16 or float32 for the kernel; anything else takes the reference) or in
      ``KV_FP8`` (an FP8 cache: each tile widened to q's dtype before the dots).
    page_table: [B, max_pages] int32 page ids of each sequence (entries past a
      sequence's live pages are never read).
    kv_len: [B] int32 live keys per sequence, the query block included.
    q_len: [B] int32 valid queries of each block (rows past it output 0).
    block_mask: [B, T, M] bool (M >= T, static) or None = causal. Column u is key
      position kv_len[b] - q_len[b] - (M - T) + u (M == T: block key u); query t sees it
      iff block_mask[b, t, u]. Keys before those M positions: always visible.
    sm_scale: score scale, None = 1 / sqrt(D).
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
    target: the GPU to pick block sizes for (a key of ``_common.GPU_TARGETS``); None =
      automatic (``_common.resolve_target``).
    block_q, block_n, num_splits, min_split, num_warps, num_stages: override the
      heuristic (see ``_block_sizes``), for tests and benchmarks.
  Returns:
    [B, T, N, D] in q.dtype.
  """
  b, t, n, d, num_pages, page_size, k, max_pages = _check_inputs(
      q, k_pages, v_pages, page_table, kv_len, q_len, block_mask)
  dtypes = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
  # The pools are not given to kernel_backend_ok: past the kernel's rows they raise
  # below instead of taking the reference, whose dense gather of every sequence's whole
  # table would cost gigabytes per layer.
  supported = (
      _common.kernel_backend_ok(interpret)
      and q.dtype in dtypes and k_pages.dtype in (q.dtype, KV_FP8)
      and v_pages.dtype == k_pages.dtype
      and 0 < d <= _MAX_HEAD_DIM
      and min(b, t, n, num_pages, page_size, max_pages) > 0
  )
  if not supported:
    return paged_attention_reference(q, k_pages, v_pages, page_table, kv_len, q_len,
                                     block_mask=block_mask, sm_scale=sm_scale)
  addressable = max_pool_pages(page_size, k, d, itemsize=k_pages.dtype.itemsize)
  if num_pages > addressable:
    raise ValueError(
        f"k_pages has {num_pages} pages of {page_size} x {k} x {d}: more than the "
        f"{addressable} the kernel addresses (max_pool_pages); give the pool fewer pages "
        "(the engine sizes its pool within this)")
  cfg = _block_sizes(b, t, n // k, d, k, max_pages * page_size,
                     gpu=_common.resolve_target(target), causal=block_mask is None,
                     block_q=block_q, block_n=block_n, num_splits=num_splits,
                     min_split=min_split, num_warps=num_warps, num_stages=num_stages)
  return _paged_attention_pallas(
      q, k_pages, v_pages, page_table, kv_len, q_len, block_mask,
      scale=_scale(sm_scale, d), interpret=_common.resolve_interpret(interpret), cfg=cfg)
