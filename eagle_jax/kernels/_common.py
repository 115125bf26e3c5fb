"""Helpers shared by the Pallas kernels of ``eagle_jax.kernels``.

Every kernel in this package is written for Pallas' Triton path, so one source
compiles for CUDA and ROCm, and runs in Pallas interpret mode on a CPU (tests, CI).
Its block-size heuristic takes the ``GpuTarget`` it compiles for (``resolve_target``):
wavefront 64 and the CU's LDS on AMD, warp 32 and the SM's shared memory on NVIDIA.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# The custom-call target the Pallas Triton lowering emits, on CUDA and ROCm alike.
# jax.export refuses to serialise it unless told (it carries no compatibility
# guarantee), see tests/test_kernels_export.py.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Elements an array may hold for a kernel to index it: the Triton path's pointer offsets
# are int32 (a kernel's row * width + column is computed in int32), so a larger array's
# last elements would wrap to negative offsets, a silent wrong read.
MAX_INDEXED_ELEMENTS = 2**31

# Backends whose Pallas lowering is the Triton one (jax.default_backend() reports
# both CUDA and ROCm as "gpu"), plus the CPU, where the kernels run interpreted.
_KERNEL_BACKENDS = ("cpu", "gpu", "cuda", "rocm")


class GpuTarget(NamedTuple):
  """What the block-size heuristics know of the GPU a kernel is compiled for."""

  name: str          # "gfx942" (MI300X, CDNA3), "gfx950" (MI355X, CDNA4), "sm_90" (H100/H200)
  platform: str      # "rocm" or "cuda": the platform JAX lowers the kernel for
  warp_size: int     # threads per warp: a wavefront of 64 on CDNA, 32 on NVIDIA
  shared_bytes: int  # LDS per CU (AMD) / shared memory per SM (NVIDIA)
  num_cores: int     # CUs / SMs of the part the choices were made for


GPU_TARGETS = {
    "gfx942": GpuTarget("gfx942", "rocm", 64, 64 * 1024, 304),    # MI300X
    "gfx950": GpuTarget("gfx950", "rocm", 64, 160 * 1024, 256),   # MI355X
    "sm_90": GpuTarget("sm_90", "cuda", 32, 228 * 1024, 132),     # H200
}
# A process with no GPU (interpret mode on a CPU) tunes for sm_90, as JAX's Pallas
# lowering itself assumes compute capability 9.0 when it finds no GPU.
DEFAULT_TARGET = "sm_90"
# A GPU of a family whose parts are not in GPU_TARGETS gets its family's entry.
_FAMILY_TARGET = {"rocm": "gfx942", "cuda": "sm_90"}

# Set by ``compiled_kernels()``: every kernel whose caller left ``interpret`` automatic
# takes the compiled Triton path, so a whole model step can be lowered for a GPU on a CPU;
# ``_FORCED_TARGET`` is then the GPU the heuristics tune for.
_FORCE_COMPILED = False
_FORCED_TARGET: str | None = None


@contextlib.contextmanager
def compiled_kernels(target: str | None = None):
  """Within this block, kernels called with ``interpret=None`` lower to Triton.

  For exporting the engine step for ``platforms=["rocm"]`` / ``["cuda"]`` from a CPU
  machine (the kernels deep inside the step are called with ``interpret=None``).
  ``target`` (a key of ``GPU_TARGETS``) is the GPU whose block sizes the kernels called
  with ``target=None`` pick; None keeps an enclosing block's target, else the automatic
  choice (``resolve_target``).
  """
  global _FORCE_COMPILED, _FORCED_TARGET
  if target is not None:
    gpu_target(target)  # fail here on an unknown name, not deep inside the step
  previous = _FORCE_COMPILED, _FORCED_TARGET
  _FORCE_COMPILED, _FORCED_TARGET = True, target or _FORCED_TARGET
  try:
    yield
  finally:
    _FORCE_COMPILED, _FORCED_TARGET = previous


def lowering_context() -> tuple[bool, str | None]:
  """What a traced kernel depends on besides its arguments (``compiled_kernels``'s
  setting): a cache of traced functions that call kernels keys by it too, or a function
  traced for an interpreted run would be reused in a Triton export, or the other way."""
  return _FORCE_COMPILED, _FORCED_TARGET


def gpu_target(name: str) -> GpuTarget:
  """The entry of GPU_TARGETS named ``name``; ValueError for another name."""
  if name not in GPU_TARGETS:
    raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(GPU_TARGETS)}")
  return GPU_TARGETS[name]


def _device_target(device) -> GpuTarget:
  """The GPU_TARGETS entry of a JAX GPU device: its architecture name (ROCm reports
  ``gfx942[:sramecc+:xnack-]`` as ``compute_capability``, CUDA ``9.0``), else the part
  named in ``device_kind``, else its family's entry."""
  platform = "rocm" if device.platform == "rocm" or "AMD" in device.device_kind else "cuda"
  arch = str(getattr(device, "compute_capability", "") or "").split(":")[0]
  if platform == "cuda" and arch:
    arch = "sm_" + arch.replace(".", "")
  if arch in GPU_TARGETS:
    return GPU_TARGETS[arch]
  kind = device.device_kind.upper()
  for part, name in (("MI300", "gfx942"), ("MI325", "gfx942"), ("MI350", "gfx950"),
                     ("MI355", "gfx950"), ("H100", "sm_90"), ("H200", "sm_90")):
    if part in kind:
      return GPU_TARGETS[name]
  return GPU_TARGETS[_FAMILY_TARGET[platform]]


def resolve_target(target: str | None) -> GpuTarget:
  """The GPU the block-size heuristics tune for.

  An explicit name wins; then the target of an enclosing ``compiled_kernels(target=)``;
  then the GPU this process runs on (``jax.devices()[0]``); with none (a CPU, interpret
  mode), ``DEFAULT_TARGET``. Exporting for another platform than the local one therefore
  names its target (``scripts/rocm_compile.py`` asks for gfx942 and gfx950 on a CPU).
  """
  if target is not None:
    return gpu_target(target)
  if _FORCED_TARGET is not None:
    return gpu_target(_FORCED_TARGET)
  device = jax.devices()[0]
  if device.platform in ("gpu", "cuda", "rocm"):
    return _device_target(device)
  return gpu_target(DEFAULT_TARGET)


def default_interpret() -> bool:
  """True on a CPU-only process: Pallas then runs the kernel body in interpret mode."""
  return jax.default_backend() == "cpu" and not _FORCE_COMPILED


def resolve_interpret(interpret: bool | None) -> bool:
  """``None`` means automatic (interpret on a CPU); an explicit bool is kept.

  Forcing ``interpret=False`` on a CPU machine is how the tests lower the Triton
  kernels for ``jax.export(..., platforms=["cuda"/"rocm"])``.
  """
  return default_interpret() if interpret is None else bool(interpret)


def kernel_backend_ok(interpret: bool | None, *arrays) -> bool:
  """Whether the Pallas-Triton path may run here, on ``arrays`` (the call's large inputs;
  None entries are skipped).

  With ``interpret`` left automatic, only CPU and GPU backends qualify; a TPU (whose
  Pallas lowering is Mosaic, not Triton) takes the pure-jnp reference instead. An
  explicit ``interpret`` is the caller forcing a path (export tests, benchmarks). An
  array of more than MAX_INDEXED_ELEMENTS takes the reference on any backend: its XLA
  ops address it whole, where the kernel's int32 offsets would wrap.
  """
  if any(a is not None and math.prod(jnp.shape(a)) > MAX_INDEXED_ELEMENTS for a in arrays):
    return False
  if interpret is not None:
    return True
  return jax.default_backend() in _KERNEL_BACKENDS


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


# Index larger than any vocabulary column or tree node index: the identity of a "first
# index" min.
NO_INDEX = 1 << 30
# A float32 scan of a block and its sum differ by far less than this relative amount.
CDF_SLACK = 1.0 + 1e-3


def inverse_cdf_init(before=0.0):
  """The carry of an inverse-CDF draw before its first block (``inverse_cdf_block``);
  ``before``: the weight of the blocks it skips, where it starts past column 0."""
  return jnp.asarray(before, jnp.float32), jnp.int32(NO_INDEX), jnp.int32(-1)


def inverse_cdf_block(carry, cols, w, target):
  """One block of an inverse-CDF draw over unnormalised weights, blocks visited in
  increasing column order: ``w`` [block] at columns ``cols`` [block]. ``carry``: the
  weight of the blocks before, the first column whose cumulative weight exceeds
  ``target`` (NO_INDEX until found), the last column of positive weight (-1: none)."""
  running, found, last_pos = carry
  total = jnp.sum(w)

  def locate():
    csum = running + jnp.cumsum(w)
    return jnp.min(jnp.where((csum > target) & (w > 0.0), cols, NO_INDEX))

  # The block's scan (cross-warp, the costly part) only where the target may fall in it;
  # the slack covers the scan's rounding against the sum's. The other branch computes its
  # NO_INDEX from `found`: Triton's lowering of a cond cannot yield a constant.
  may_hold = (found == NO_INDEX) & ((running + total) * CDF_SLACK >= target)
  first = lax.cond(may_hold, locate, lambda: jnp.maximum(found, NO_INDEX))
  found = jnp.where(found == NO_INDEX, first, found)
  last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(w > 0.0, cols, -1)))
  return running + total, found, last_pos


def inverse_cdf_token(carry):
  """The drawn column after the last block: the first column past ``target``, or, when
  rounding left the target at or past the summed weight, the last column of positive
  weight (-1 when every weight was 0)."""
  _, found, last_pos = carry
  return jnp.where(found != NO_INDEX, found, last_pos).astype(jnp.int32)

