"""Helpers shared by the Pallas kernels of ``eagle_jax.kernels``.

Every kernel in this package is written for Pallas' Triton path, so one source
compiles for CUDA and ROCm, and runs in Pallas interpret mode on a CPU (tests, CI).
"""

from __future__ import annotations

import contextlib

import jax

# The custom-call target the Pallas Triton lowering emits, on CUDA and ROCm alike.
# jax.export refuses to serialise it unless told (it carries no compatibility
# guarantee), see tests/test_kernels_export.py.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Backends whose Pallas lowering is the Triton one (jax.default_backend() reports
# both CUDA and ROCm as "gpu"), plus the CPU, where the kernels run interpreted.
_KERNEL_BACKENDS = ("cpu", "gpu", "cuda", "rocm")


# Set by ``compiled_kernels()``: every kernel whose caller left ``interpret`` automatic
# takes the compiled Triton path, so a whole model step can be lowered for a GPU on a CPU.
_FORCE_COMPILED = False


@contextlib.contextmanager
def compiled_kernels():
  """Within this block, kernels called with ``interpret=None`` lower to Triton.

  For exporting the engine step for ``platforms=["rocm"]`` / ``["cuda"]`` from a CPU
  machine (the kernels deep inside the step are called with ``interpret=None``).
  """
  global _FORCE_COMPILED
  previous, _FORCE_COMPILED = _FORCE_COMPILED, True
  try:
    yield
  finally:
    _FORCE_COMPILED = previous


def default_interpret() -> bool:
  """True on a CPU-only process: Pallas then runs the kernel body in interpret mode."""
  return jax.default_backend() == "cpu" and not _FORCE_COMPILED


def resolve_interpret(interpret: bool | None) -> bool:
  """``None`` means automatic (interpret on a CPU); an explicit bool is kept.

  Forcing ``interpret=False`` on a CPU machine is how the tests lower the Triton
  kernels for ``jax.export(..., platforms=["cuda"/"rocm"])``.
  """
  return default_interpret() if interpret is None else bool(interpret)


def kernel_backend_ok(interpret: bool | None) -> bool:
  """Whether the Pallas-Triton path may run here.

  With ``interpret`` left automatic, only CPU and GPU backends qualify; a TPU (whose
  Pallas lowering is Mosaic, not Triton) takes the pure-jnp reference instead. An
  explicit ``interpret`` is the caller forcing a path (export tests, benchmarks).
  """
  if interpret is not None:
    return True
  return jax.default_backend() in _KERNEL_BACKENDS


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)
