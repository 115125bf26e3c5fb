"""Timing helpers shared by the ``bench_*.py`` scripts (one way to time, one copy bound).

Device work is asynchronous: every timing closes a run of back-to-back calls with one
``jax.block_until_ready``, so the host's round trip is paid once per run, not per call
(a sync per call understated the H200's copy bandwidth by 25%: 3.29 vs 4.10 TB/s).
"""

from __future__ import annotations

import os
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


def matmul_throughput(n: int = 8192, dtype=jnp.bfloat16, *, calls: int = 10,
                      repeats: int = 10) -> float:
    """Dense FLOP/s of an [n, n] x [n, n] matmul in ``dtype`` (float32 accumulation):
    the compute roof of ``roofline.Device``, as ``copy_bandwidth`` is its memory roof."""
    ka, kb = jax.random.split(jax.random.key(2))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype))
    ms = time_ms(matmul, a, b, calls=calls, repeats=repeats, warmup=2)
    return 2 * n ** 3 / (ms * 1e-3)


def device_ms_per_op(trace_dir: str, divisor: int) -> dict[str, list[tuple[str, float]]]:
    """Device time per op of the newest ``jax.profiler`` trace under ``trace_dir``, over
    ``divisor`` (steps or requests): {device line: [(event name, ms)], costliest first}."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs
             if f.endswith(".xplane.pb")]
    data = jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime))
    lines: dict[str, dict[str, float]] = {}  # device line -> event name -> ms
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            totals = lines.setdefault(f"{plane.name} {line.name}", {})
            for ev in line.events:
                totals[ev.name] = totals.get(ev.name, 0.0) + ev.duration_ns / 1e6 / divisor
    return {name: sorted(t.items(), key=lambda kv: -kv[1]) for name, t in lines.items()}


def print_profile(profile: dict[str, list[tuple[str, float]]], top: int = 30) -> None:
    """Each device line's total, and the ops of the "Ops" line (or, where the trace has
    none, of the busiest line)."""
    totals = {line: sum(ms for _, ms in events) for line, events in profile.items()}
    if not totals:
        print("  (no device lines in the trace: a CPU run)")
        return
    shown = [line for line in profile if "Ops" in line] or [max(totals, key=totals.get)]
    for line, events in profile.items():
        total = totals[line]
        print(f"  {line}: {total:.3f} ms")
        if line in shown:
            for name, ms in events[:top]:
                print(f"    {ms:8.3f} ms  {100 * ms / max(total, 1e-9):5.1f}%  {name[:100]}")
