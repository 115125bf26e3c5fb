"""Timing helpers shared by the ``bench_*.py`` scripts (one way to time, one copy bound).

Device work is asynchronous: every timing closes a run of back-to-back calls with one
``jax.block_until_ready``, so the host's round trip is paid once per run, not per call
(a sync per call understated the H200's copy bandwidth by 25%: 3.29 vs 4.10 TB/s).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def time_ms(fn, *args, calls: int = 10, repeats: int = 15, warmup: int = 3) -> float:
    """Median over ``repeats`` of the mean ms of ``calls`` back-to-back calls of fn(*args)."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, *, calls: int = 10, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of ``x + 1`` over
    ``nbytes`` of float32: the 100% mark of every "% of copy bandwidth" column."""
    x = jax.random.normal(jax.random.key(1), (nbytes // 4,), jnp.float32)
    ms = time_ms(jax.jit(lambda a: a + 1.0), x, calls=calls, repeats=repeats, warmup=2)
    return 2 * x.nbytes / (ms * 1e-3)
