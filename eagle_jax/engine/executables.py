"""The engine's executables: how a pure function becomes one, their cache, and precompile.

``CompileFn`` is the seam through which the engine turns each of its pure functions into
an executable:

    compile_fn(name, fn, example_args, donate_argnums) -> callable

``name`` is the key's kind ("step", "prefill", "catch_up", "update_slots" or "score",
``buckets``); ``example_args`` are arrays or ShapeDtypeStructs of the call's shapes. The
default (``jit_compile``) jits, lowers and compiles; the comparison tool
(``eagle_jax.compare``) passes one that runs the same function op by op, or wraps it
before jitting.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from eagle_jax.engine.buckets import ExecutableKey
from eagle_jax.engine.host_inputs import HostLayout

CompileFn = Callable[[str, Callable, tuple, tuple[int, ...]], Callable]

# ``precompile`` runs compiles in threads; every ``CompileFn`` traces under this lock.
# JAX's tracing is not thread-safe (a module it imports on first use registers effect
# types in a set another thread may be iterating: "Set changed size during iteration"),
# and under the GIL it would take turns anyway. XLA's compile, the long part, overlaps.
TRACE_LOCK = threading.Lock()

MAX_COMPILE_THREADS = 16


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in ``path`` ("" = off)."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def jit_compile(name: str, fn: Callable, example_args: tuple,
                donate_argnums: tuple[int, ...]) -> Callable:
    """The serving ``CompileFn``: one XLA executable, the donated buffers updated in place.

    The arguments given as host arrays (numpy arrays, or ShapeDtypeStructs in
    ``example_args``: prompt chunks, slot changes, page-table updates) travel packed in
    one buffer (``HostLayout``), one host-to-device copy per call instead of one per
    field; the returned callable takes them as ``fn`` does."""
    del name
    host = [i for i, arg in enumerate(example_args) if is_host_input(arg)]
    if not host:
        with TRACE_LOCK:
            lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*example_args)
        return lowered.compile()
    device = [i for i in range(len(example_args)) if i not in host]
    layout = HostLayout([example_args[i] for i in host])

    def unpacked(*args):
        full = dict(zip(device, args[:-1]))
        full.update(zip(host, layout.unpack(args[-1])))
        return fn(*(full[i] for i in range(len(example_args))))

    with TRACE_LOCK:
        lowered = jax.jit(unpacked, donate_argnums=tuple(
            device.index(i) for i in donate_argnums)).lower(
                *(example_args[i] for i in device), layout.spec)
    compiled = lowered.compile()

    def call(*args):
        return compiled(*(args[i] for i in device), layout.pack([args[i] for i in host]))

    return call


def is_host_input(arg) -> bool:
    """Whether an example argument is host inputs: a pytree of numpy arrays or
    ShapeDtypeStructs (device arguments are jax arrays)."""
    leaves = jax.tree.leaves(arg)
    return bool(leaves) and all(isinstance(x, (np.ndarray, jax.ShapeDtypeStruct))
                                for x in leaves)


def split_module(module):
    """module -> ((graphdef, treedef), parameter leaves); (None, None) for no module.

    Parameters travel to the executables as flat lists: flattening a list per call costs
    far less host time than flattening an NNX state tree."""
    if module is None:
        return None, None
    graph, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return (graph, treedef), leaves


def merge_module(definition, leaves):
    """Rebuilds a module from ``split_module``'s output inside a trace."""
    if definition is None:
        return None
    graph, treedef = definition
    return nnx.merge(graph, jax.tree.unflatten(treedef, leaves))


class ExecutableCache:
    """The executables by key, compiled on first use: ``build(key)`` gives (function,
    example arguments, donated argument indices) and ``compile_fn`` compiles it."""

    def __init__(self, compile_fn: CompileFn,
                 build: Callable[[ExecutableKey], tuple[Callable, tuple, tuple[int, ...]]]):
        self._compile_fn = compile_fn
        self._build = build
        self._compiled: dict[ExecutableKey, Callable] = {}

    def __len__(self) -> int:
        return len(self._compiled)

    def __getitem__(self, key: ExecutableKey) -> Callable:
        """Nothing is built on a hit: this runs on every dispatch."""
        executable = self._compiled.get(key)
        if executable is None:
            fn, example_args, donate_argnums = self._build(key)
            executable = self._compiled[key] = self._compile_fn(key.name, fn, example_args,
                                                                donate_argnums)
        return executable

    def precompile(self, keys: list[ExecutableKey], desc: str) -> None:
        """Compiles ``keys``, several at once: XLA's compiler runs outside the GIL, so
        threads overlap the compiles (of an 8B-shaped step, ~15 s each on one core)
        while tracing takes turns (``TRACE_LOCK``)."""
        workers = max(1, min(len(keys), os.cpu_count() or 1, MAX_COMPILE_THREADS))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            done = concurrent.futures.as_completed(
                [pool.submit(self.__getitem__, key) for key in keys])
            for future in tqdm(done, total=len(keys), desc=desc, leave=False):
                future.result()
