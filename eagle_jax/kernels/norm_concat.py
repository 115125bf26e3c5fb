"""Fused dual RMSNorm + concat of EAGLE-3's first draft layer (seed 002).

EAGLE-3's layer 0 computes ``concat([rmsnorm(embeds), rmsnorm(hidden)], -1)``. Unfused
that is two reductions, two scaled writes and a concat copy; the kernel reads each
input row once and writes both halves of the output row directly.

The public function falls back to the unfused reference when its guards fail, like
the upstream Triton helper: same shapes, same dtype, equal eps, dtype float32 or
bfloat16, H <= MAX_HIDDEN, and a backend with a Triton lowering (CPU runs it
interpreted; a TPU takes the reference). JAX arrays are dense and row-major, so the
upstream "contiguous" guard has no counterpart here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common

# One program holds a whole row of each input in registers; 8192 columns is 32
# float32 values per thread per input at 8 warps, beyond which registers would spill.
MAX_HIDDEN = 8192


def rmsnorm_reference(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """Llama RMSNorm. x: [..., H], w: [H] -> [..., H] in x.dtype (computed in f32)."""
  xf = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * rstd * w.astype(jnp.float32)).astype(x.dtype)


def rmsnorm_concat_reference(embeds, hidden, w_embeds, w_hidden, eps_embeds, eps_hidden):
  """[N, H] x2 -> [N, 2H]: the unfused path."""
  return jnp.concatenate(
      [rmsnorm_reference(embeds, w_embeds, eps_embeds),
       rmsnorm_reference(hidden, w_hidden, eps_hidden)], axis=-1)


def _block_h(hidden_size: int, gpu: _common.GpuTarget) -> tuple[int, int]:
  """(BLOCK_H, num_warps): the whole row in one masked load.

  A single block keeps each row in registers between the reduction and the scaled
  store, so every input byte is read exactly once. Warps scale with the row so that a
  thread holds 8-16 values per input (e.g. H = 4096: 8 warps, 16 values).
  The same warps on AMD (8-16 bf16 values per lane of a 64-wide wavefront at H = 4096 to
  8192): the grid is one program per row, B rows in a decode step, fewer than the CUs,
  so a workgroup's own waves are what hide its load. Compiled for gfx942 / gfx950
  (docs/ROCM.md): 27-40 VGPRs, no spills, 8 waves per SIMD allowed.
  """
  del gpu  # the same choice on every target (above)
  block = max(32, _common.next_power_of_2(hidden_size))
  num_warps = min(8, max(1, block // 512))
  return block, num_warps


def _norm_concat_kernel(e_ref, h_ref, we_ref, wh_ref, o_ref, *, hidden_size, block, eps):
  row = pl.program_id(0)
  cols = jnp.arange(block, dtype=jnp.int32)
  mask = cols < hidden_size

  def normed(x_ref, w_ref):
    x = plgpu.load(x_ref.at[row, cols], mask=mask, other=0.0).astype(jnp.float32)
    w = plgpu.load(w_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(x * x) / hidden_size + eps)
    return (x * rstd * w).astype(o_ref.dtype)

  plgpu.store(o_ref.at[row, cols], normed(e_ref, we_ref), mask=mask)
  plgpu.store(o_ref.at[row, hidden_size + cols], normed(h_ref, wh_ref), mask=mask)


def _rmsnorm_concat_pallas(embeds, hidden, w_embeds, w_hidden, eps, *, interpret, gpu):
  num_rows, hidden_size = embeds.shape
  block, num_warps = _block_h(hidden_size, gpu)
  return pl.pallas_call(
      functools.partial(_norm_concat_kernel, hidden_size=hidden_size, block=block, eps=eps),
      out_shape=jax.ShapeDtypeStruct((num_rows, 2 * hidden_size), embeds.dtype),
      grid=(num_rows,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="rmsnorm_concat",
  )(embeds, hidden, w_embeds, w_hidden)


def rmsnorm_concat(
    embeds: jax.Array, hidden: jax.Array, w_embeds: jax.Array, w_hidden: jax.Array,
    eps_embeds: float, eps_hidden: float, *, interpret: bool | None = None,
    target: str | None = None) -> jax.Array:
  """concat([rmsnorm(embeds, w_embeds), rmsnorm(hidden, w_hidden)], -1) in one pass.

  Args:
    embeds, hidden: [N, H], float32 or bfloat16 (computed in float32).
    w_embeds, w_hidden: [H], any float dtype (cast to float32).
    eps_embeds, eps_hidden: Python floats.
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
    target: the GPU to pick block sizes for (a key of ``_common.GPU_TARGETS``); None =
      automatic (``_common.resolve_target``).
  Returns:
    [N, 2H] in the inputs' dtype.
  """
  supported = (
      _common.kernel_backend_ok(interpret, embeds, hidden)
      and embeds.ndim == 2
      and embeds.shape == hidden.shape
      and embeds.dtype == hidden.dtype
      and embeds.dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
      and w_embeds.shape == w_hidden.shape == embeds.shape[-1:]
      and isinstance(eps_embeds, (int, float)) and isinstance(eps_hidden, (int, float))
      and float(eps_embeds) == float(eps_hidden)
      and 0 < embeds.shape[-1] <= MAX_HIDDEN
      and embeds.shape[0] > 0
  )
  if not supported:
    return rmsnorm_concat_reference(embeds, hidden, w_embeds, w_hidden, eps_embeds, eps_hidden)
  return _rmsnorm_concat_pallas(
      embeds, hidden, w_embeds, w_hidden, float(eps_embeds),
      interpret=_common.resolve_interpret(interpret), gpu=_common.resolve_target(target))
