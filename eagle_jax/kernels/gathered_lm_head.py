"""Gathered LM head: logits of selected rows only, the gather fused into the matmul.

EAGLE draft extend runs the draft over a window of W positions per request but needs
the LM head only at each request's last accepted position (seed 000). Projecting all
N = B * W rows and discarding the rest wastes the matmul; ``hidden[rows] @ W.T`` in
XLA materialises the gathered [B, H] rows first. The kernel loads the B selected rows
by index straight into the dot's operand tiles.

Grid: (cdiv(V, BLOCK_V), cdiv(B, BLOCK_B)). Each program owns a [BLOCK_B, BLOCK_V]
logits tile and walks H in BLOCK_K steps: a gathered [BLOCK_B, BLOCK_K] tile of
hidden (row pointers from ``row_indices``) times a [BLOCK_V, BLOCK_K] weight tile,
accumulated in float32 with a 2-D ``pl.dot``. For decode-sized B the weight (e.g.
128256 x 4096 bf16 = 1 GiB) dominates the bytes: the kernel is bound by reading it
once, which is also the floor of projecting all N rows (see docs/BENCHMARKS.md,
"Kernels").

Out-of-range row indices are clamped to [0, N-1] (never an out-of-bounds read); the
row they select is then garbage by the caller's own contract, but memory stays safe.
JAX arrays are dense and row-major, so no contiguity guard is needed. A weight or hidden
array past the kernel's int32 offsets (``_common.MAX_INDEXED_ELEMENTS``: V x H > 2**31,
a 405B-class head unsharded) takes the reference, whose XLA dot addresses it whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common


def gathered_lm_head_reference(hidden, row_indices, weight):
  """hidden [N, H], row_indices [B], weight [V, H] -> [B, V] float32."""
  rows = jnp.clip(row_indices.astype(jnp.int32), 0, hidden.shape[0] - 1)
  return jnp.dot(hidden[rows], weight.T, preferred_element_type=jnp.float32)


def _block_sizes(batch: int, vocab: int, itemsize: int, gpu: _common.GpuTarget,
                 block_v: int | None = None, block_k: int | None = None):
  """(BLOCK_B, BLOCK_V, BLOCK_K, num_warps, num_stages).

  BLOCK_B covers the whole decode batch (>= 16, the smallest tensor-core dot edge) up
  to 64, so each weight tile is read once for all selected rows. BLOCK_K = 64 = 128-byte
  bf16 rows per load; 4 warps (on AMD one wavefront per SIMD of the CU).

  NVIDIA: BLOCK_V = 128 gives 250 programs for EAGLE-3's 32000-row head (~1000 for a
  128k vocabulary), about 2 per SM of an H200, and the [BLOCK_B, BLOCK_V] float32
  accumulator stays in registers (115 at B = 64, scripts/rocm_compile.py --arch sm_90);
  4 pipeline stages keep 3 weight tiles in flight per program (96 KiB of shared memory
  at B = 64), which is what a weight-streaming matmul needs.

  AMD: the same 250 programs would leave CUs idle (MI300X has 304, MI355X 256), so
  BLOCK_V halves to 64 while 128 gives fewer programs than CUs: 500 programs, 1.6-2
  per CU. With about 2 programs per CU, 2 resident workgroups hold the whole grid, and
  what is left of the LDS goes to pipeline depth: num_stages = 1 + LDS / (2 x one stage's
  tiles), at most 4. Compiled at B = 64, bf16: the former 128 x 4 stages needed 72 KiB of
  LDS on gfx942, more than its 64 KiB (it could not launch); 64 x 3 stages take 32 KiB
  on gfx942 and 64 x 4 stages 66 KiB of gfx950's 160 KiB, 72-94 VGPRs, 2 workgroups per
  CU, no spills (docs/ROCM.md).
  """
  block_b = min(64, max(16, _common.next_power_of_2(batch)))
  block_k = block_k or 64
  if gpu.platform == "cuda":
    return block_b, block_v or 128, block_k, 4, 4
  programs_at_128 = _common.cdiv(vocab, 128) * _common.cdiv(batch, block_b)
  block_v = block_v or (128 if programs_at_128 >= gpu.num_cores else 64)
  stage_bytes = (block_b + block_v) * block_k * itemsize
  num_stages = max(1, min(4, 1 + gpu.shared_bytes // (2 * stage_bytes)))
  return block_b, block_v, block_k, 4, num_stages


def _lm_head_kernel(rows_ref, h_ref, w_ref, o_ref, *, num_sel, num_rows, vocab, hidden_size,
                    block_b, block_v, block_k):
  v_blk, b_blk = pl.program_id(0), pl.program_id(1)
  sel = b_blk * block_b + jnp.arange(block_b, dtype=jnp.int32)
  sel_ok = sel < num_sel
  rows = plgpu.load(rows_ref.at[sel], mask=sel_ok, other=0)
  rows = jnp.clip(rows, 0, num_rows - 1)  # never read past hidden
  vcols = v_blk * block_v + jnp.arange(block_v, dtype=jnp.int32)
  v_ok = vcols < vocab

  def body(k, acc):
    kcols = k * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k_ok = kcols < hidden_size
    h = plgpu.load(h_ref.at[rows[:, None], kcols[None, :]],
                   mask=sel_ok[:, None] & k_ok[None, :], other=0.0)
    w = plgpu.load(w_ref.at[vcols[:, None], kcols[None, :]],
                   mask=v_ok[:, None] & k_ok[None, :], other=0.0)
    # h @ w.T as a 2-D dot_general (pl.dot is gone from JAX >= 0.12; the Triton
    # lowering maps this contraction onto tt.dot with a transposed operand).
    return acc + jax.lax.dot_general(
        h, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, pl.cdiv(hidden_size, block_k), body,
                          jnp.zeros((block_b, block_v), jnp.float32))
  plgpu.store(o_ref.at[sel[:, None], vcols[None, :]], acc,
              mask=sel_ok[:, None] & v_ok[None, :])


def _gathered_lm_head_pallas(hidden, row_indices, weight, *, interpret, gpu, block_v, block_k):
  num_rows, hidden_size = hidden.shape
  vocab = weight.shape[0]
  num_sel = row_indices.shape[0]
  block_b, block_v, block_k, num_warps, num_stages = _block_sizes(
      num_sel, vocab, weight.dtype.itemsize, gpu, block_v, block_k)
  kernel = functools.partial(
      _lm_head_kernel, num_sel=num_sel, num_rows=num_rows, vocab=vocab,
      hidden_size=hidden_size, block_b=block_b, block_v=block_v, block_k=block_k)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_sel, vocab), jnp.float32),
      grid=(pl.cdiv(vocab, block_v), pl.cdiv(num_sel, block_b)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="gathered_lm_head",
  )(row_indices.astype(jnp.int32), hidden, weight)


def gathered_lm_head(
    hidden: jax.Array, row_indices: jax.Array, weight: jax.Array, *,
    interpret: bool | None = None, target: str | None = None, block_v: int | None = None,
    block_k: int | None = None) -> jax.Array:
  """Logits of the selected rows: ``hidden[row_indices] @ weight.T`` in float32.

  Args:
    hidden: [N, H] float32 or bfloat16.
    row_indices: [B] int32 rows of hidden to project (clamped to [0, N-1]).
    weight: [V, H], same dtype as hidden.
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
    target: the GPU to pick block sizes for (a key of ``_common.GPU_TARGETS``); None =
      automatic (``_common.resolve_target``).
    block_v, block_k: override the heuristic (powers of two, >= 16).
  Returns:
    [B, V] float32 logits.
  """
  supported = (
      _common.kernel_backend_ok(interpret, hidden, weight)
      and hidden.ndim == 2 and weight.ndim == 2 and row_indices.ndim == 1
      and hidden.shape[1] == weight.shape[1]
      and hidden.dtype == weight.dtype
      and hidden.dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
      and hidden.shape[0] > 0 and row_indices.shape[0] > 0 and weight.shape[0] > 0
      and jnp.issubdtype(row_indices.dtype, jnp.integer)
  )
  if not supported:
    return gathered_lm_head_reference(hidden, row_indices, weight)
  return _gathered_lm_head_pallas(
      hidden, row_indices, weight, interpret=_common.resolve_interpret(interpret),
      gpu=_common.resolve_target(target), block_v=block_v, block_k=block_k)
