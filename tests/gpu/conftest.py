"""The device suite: tests marked ``gpu``, run on a GPU with

    python -m pytest -q -m gpu tests/gpu

and skipped wherever JAX's default backend is the CPU (so the CPU suite, which collects
them too, reports them as skipped). docs/GPU_TESTS.md records each run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or jax.default_backend() != "cpu":
        return
    skip = pytest.mark.skip(reason="gpu test: JAX's default backend is the CPU")
    for item in gpu_items:
        item.add_marker(skip)


# Bytes of device memory filled with 0xFF (float32 NaN, int32 -1) and freed before each
# kernel test: XLA's allocator hands the freed block to the next buffers, so a kernel
# output element that no program writes reads as NaN / -1, as Pallas' interpret mode
# poisons them on a CPU.
POISON_BYTES = 1 << 30


@pytest.fixture
def poisoned_device_memory():
    junk = jnp.full((POISON_BYTES // 4,), -1, jnp.int32)
    junk.block_until_ready()
    junk.delete()
    yield
