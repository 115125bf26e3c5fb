"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import os
import tempfile

import jax
import pytest

# Tests compare float32 results against float64-accurate references.
jax.config.update("jax_default_matmul_precision", "highest")
# Engines of equal shapes in different tests compile the same programs: one persistent
# cache for the whole session turns the repeats into cache hits.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("EAGLE_JAX_TEST_CACHE") or tempfile.mkdtemp(prefix="jaxcache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """arch -> directory of a tiny random transformers checkpoint (written lazily)."""
    from eagle_jax.testutil.models import write_tiny_target

    root = tmp_path_factory.mktemp("targets")
    cache: dict[str, str] = {}

    def get(arch: str, **kwargs) -> str:
        key = arch + repr(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = write_tiny_target(os.path.join(root, f"{arch}-{len(cache)}"), arch,
                                           **kwargs)
        return cache[key]

    return get
