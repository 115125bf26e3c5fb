"""``jax.export`` of the engine's pure functions for a GPU platform, from any machine."""

from __future__ import annotations

from typing import Callable

import jax

from eagle_jax.kernels._common import TRITON_CUSTOM_CALL, compiled_kernels


def export(fn: Callable, args: tuple, donate: tuple[int, ...], platform: str,
           target: str) -> jax.export.Exported:
    """``fn`` jitted (``donate`` argnums) and exported for ``platform`` ("rocm", "cuda")
    with the kernels compiled for ``target`` (e.g. "gfx950", "sm_90"): the module carries
    the Triton custom calls a GPU of that platform would compile. Arguments placed on a
    mesh export with their shardings."""
    with compiled_kernels(target=target):
        return jax.export.export(
            jax.jit(fn, donate_argnums=donate), platforms=[platform],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*args)
