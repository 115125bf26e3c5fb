"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import os
import tempfile

import jax
import pytest

from .multidevice import FAST_COMPILE_FLAGS

# On the CPU (the suite's own command sets JAX_PLATFORMS=cpu; the GPU suite's does not),
# XLA compiles with LLVM's cheaper passes: the suite builds hundreds of programs and runs
# each a few times, so compile time, not run time, is most of it (a sample of two files on
# CI's 2 cores: 281 s against 361 s). Set before any computation starts the backend, which
# reads XLA_FLAGS once; a caller's own XLA_FLAGS are left as they are.
if os.environ.get("JAX_PLATFORMS") == "cpu" and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = FAST_COMPILE_FLAGS
# pytest-xdist's workers on one GPU (the device suite's command, docs/GPU_TESTS.md): each
# takes its share of the device's memory instead of JAX's default 75%, which would leave
# the second worker none. Read once, when the backend starts.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                          f"{0.9 / int(os.environ['PYTEST_XDIST_WORKER_COUNT']):.2f}")

# Tests compare float32 results against float64-accurate references.
jax.config.update("jax_default_matmul_precision", "highest")
# Engines of equal shapes in different tests compile the same programs: one persistent
# cache for the whole run turns the repeats into cache hits. pytest-xdist's workers share
# it through the run's id (the cache writes each entry atomically).
def _compilation_cache_dir() -> str:
    if os.environ.get("EAGLE_JAX_TEST_CACHE"):
        return os.environ["EAGLE_JAX_TEST_CACHE"]
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return tempfile.mkdtemp(prefix="jaxcache-")
    path = os.path.join(tempfile.gettempdir(), f"jaxcache-{run_id}")
    os.makedirs(path, exist_ok=True)
    return path


jax.config.update("jax_compilation_cache_dir", _compilation_cache_dir())
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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The engine tests' checkpoints: a tiny Llama target with a test tokenizer of 300
    tokens (embedding width 320, as a padded vocabulary), and EAGLE-1 / EAGLE-3 drafts
    for it (a module's own ``models`` fixture overrides this one)."""
    from eagle_jax.testutil.drafts import write_tiny_eagle1_draft, write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target
    from eagle_jax.testutil.tokenizer import write_test_tokenizer

    root = tmp_path_factory.mktemp("engine")
    target = write_tiny_target(str(root / "target"), "llama", vocab_size=320, num_layers=4,
                               eos_token_id=2, init_std=0.15)
    write_test_tokenizer(target, vocab_size=300)
    return dict(
        target=target,
        eagle3=write_tiny_eagle3_draft(str(root / "eagle3"), target, draft_vocab_size=200),
        eagle1=write_tiny_eagle1_draft(str(root / "eagle1"), target),
    )
