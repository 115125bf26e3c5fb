"""The engine's executables: how a pure function becomes one, their cache, and precompile.

``CompileFn`` is the seam through which the engine turns each of its pure functions into
an executable:

    compile_fn(key, fn, example_args, donate_argnums) -> callable

``key`` is the ``buckets.ExecutableKey`` compiled (``key.name`` its kind: "step",
"prefill", "catch_up", "update_slots" or "score"); ``example_args`` are arrays or
ShapeDtypeStructs of the call's shapes. The default (``jit_compile``) jits, lowers and
compiles; the comparison tool (``eagle_jax.compare``) passes one that runs the same
function op by op, or wraps it before jitting. With ``jit_compile`` the engine goes
through the executable store instead (``executable_store``: the same compile, kept on
disk between starts).

``ExecutableCache`` holds them by key: compiled on first use, all at start-up
(``precompile``), or a ready set at start-up and the rest in background threads
(``compile_in_background``), with ``available`` telling the scheduler which it can run
without waiting.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from eagle_jax.engine.buckets import ExecutableKey, StepKey
from eagle_jax.engine.host_inputs import HostLayout

logger = logging.getLogger("eagle_jax.engine")

CompileFn = Callable[[ExecutableKey, Callable, tuple, tuple[int, ...]], Callable]

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


def jit_compile(key: ExecutableKey, fn: Callable, example_args: tuple,
                donate_argnums: tuple[int, ...]) -> Callable:
    """The serving ``CompileFn``: one XLA executable, the donated buffers updated in place.

    The arguments given as host arrays (numpy arrays, or ShapeDtypeStructs in
    ``example_args``: prompt chunks, slot changes, page-table updates) travel packed in
    one buffer (``HostLayout``), one host-to-device copy per call instead of one per
    field; the returned callable takes them as ``fn`` does."""
    del key
    signature = CallSignature.of(example_args)
    return signature.wrap(signature.lower(fn, example_args, donate_argnums).compile())


class CallSignature:
    """How ``jit_compile`` calls an executable: which arguments are device arrays, and
    the ``HostLayout`` the host ones travel in (none: every argument is on the device).
    Read from the example arguments alone (no tracing), so that a stored executable
    (``executable_store``) is called as a freshly compiled one is."""

    def __init__(self, device: list[int], host: list[int], layout: HostLayout | None):
        self.device, self.host, self.layout = device, host, layout

    @classmethod
    def of(cls, example_args: tuple) -> "CallSignature":
        host = [i for i, arg in enumerate(example_args) if is_host_input(arg)]
        if not host:
            return cls(list(range(len(example_args))), [], None)
        device = [i for i in range(len(example_args)) if i not in host]
        return cls(device, host, HostLayout([example_args[i] for i in host]))

    def lower(self, fn: Callable, example_args: tuple, donate_argnums: tuple[int, ...]):
        """``jax.stages.Lowered`` of ``trace``."""
        traced = self.trace(fn, example_args, donate_argnums)
        with TRACE_LOCK:
            return traced.lower()

    def trace(self, fn: Callable, example_args: tuple, donate_argnums: tuple[int, ...]):
        """Traces ``fn`` (under ``TRACE_LOCK``) taking the host arguments as one packed
        buffer: ``jax.stages.Traced``."""
        if self.layout is None:
            with TRACE_LOCK:
                return jax.jit(fn, donate_argnums=donate_argnums).trace(*example_args)
        device, host, layout = self.device, self.host, self.layout

        def unpacked(*args):
            full = dict(zip(device, args[:-1]))
            full.update(zip(host, layout.unpack(args[-1])))
            return fn(*(full[i] for i in range(len(example_args))))

        with TRACE_LOCK:
            return jax.jit(unpacked, donate_argnums=tuple(
                device.index(i) for i in donate_argnums)).trace(
                    *(example_args[i] for i in device), layout.spec)

    def wrap(self, compiled: Callable) -> Callable:
        """``compiled`` (of ``lower``'s function) as a callable taking ``fn``'s arguments."""
        if self.layout is None:
            return compiled
        device, host, layout = self.device, self.host, self.layout

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
    example arguments, donated argument indices) and ``compile_fn`` compiles it, or
    ``store`` (``executable_store.ExecutableStore``, serving's ``jit_compile`` only)
    loads it as compiled by an earlier process.

    Keys may compile in background threads (``compile_in_background``); until one is
    done it is *pending*, and ``available`` says no, so that the scheduler picks an
    executable that is compiled instead. A pending key asked for anyway (no compiled
    one could serve) waits for its compile if it has started, else is taken out of the
    queue and compiled at once."""

    def __init__(self, compile_fn: CompileFn,
                 build: Callable[[ExecutableKey], tuple[Callable, tuple, tuple[int, ...]]],
                 store=None):
        self._compile_fn = compile_fn
        self._build = build
        self._store = store
        self._compiled: dict[ExecutableKey, Callable] = {}
        self._pending: dict[ExecutableKey, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._on_complete: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._compiled)

    @property
    def store(self):
        """The ``executable_store.ExecutableStore`` it loads from and saves to, or None."""
        return self._store

    def __getitem__(self, key: ExecutableKey) -> Callable:
        """Nothing is built on a hit: this runs on every dispatch."""
        executable = self._compiled.get(key)
        if executable is not None:
            return executable
        with self._lock:
            pending = self._pending.get(key)
        # Not started yet (queued behind others): compiled here, now, instead.
        if pending is not None and not pending.cancel():
            return pending.result()
        return self._compile(key)

    def _compile(self, key: ExecutableKey) -> Callable:
        fn, example_args, donate_argnums = self._build(key)
        # (A constrained step calls back to the host: it cannot be serialized.)
        if self._store is not None and not (isinstance(key, StepKey) and key.constrained):
            executable = self._store.load_or_compile(key, fn, example_args, donate_argnums)
        else:
            executable = self._compile_fn(key, fn, example_args, donate_argnums)
        self._compiled[key] = executable
        return executable

    def available(self, key: ExecutableKey) -> bool:
        """Whether running ``key`` now waits for no background compile: it is compiled,
        or compiles on first use (it was never queued for the background)."""
        return key not in self._pending

    @property
    def num_pending(self) -> int:
        """Keys queued for the background and not compiled yet."""
        return len(self._pending)

    def precompile(self, keys: list[ExecutableKey], desc: str) -> None:
        """Compiles ``keys``, several at once: XLA's compiler runs outside the GIL, so
        threads overlap the compiles (of an 8B-shaped step, ~15 s each on one core)
        while tracing takes turns (``TRACE_LOCK``)."""
        keys = [key for key in keys if key not in self._compiled]
        if not keys:
            return
        workers = max(1, min(len(keys), os.cpu_count() or 1, MAX_COMPILE_THREADS))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            done = concurrent.futures.as_completed(
                [pool.submit(self.__getitem__, key) for key in keys])
            for future in tqdm(done, total=len(keys), desc=desc, leave=False):
                future.result()

    def compile_in_background(self, keys: list[ExecutableKey], threads: int,
                              on_complete: Callable[[], None] | None = None) -> None:
        """Queues ``keys`` for compiling in ``threads`` background threads (the first
        call's count holds) and returns at once; ``on_complete()`` is called (from a
        compile thread) once none is pending."""
        with self._lock:
            keys = [k for k in dict.fromkeys(keys)
                    if k not in self._compiled and k not in self._pending]
            if not keys:
                return
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    threads, thread_name_prefix="eagle-jax-compile")
            self._on_complete = on_complete
            futures = {key: self._pool.submit(self._compile, key) for key in keys}
            self._pending.update(futures)
        for key, future in futures.items():
            future.add_done_callback(lambda f, key=key: self._background_done(key, f))

    def _background_done(self, key: ExecutableKey, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            # Left uncompiled: asked for, it compiles on first use and raises there.
            logger.error("compiling %r in the background failed", key,
                         exc_info=future.exception())
        with self._lock:
            self._pending.pop(key, None)
            on_complete = self._on_complete if not self._pending else None
        if on_complete is not None:
            on_complete()

    def wait(self) -> None:
        """Blocks until no background compile is pending."""
        while True:
            with self._lock:
                futures = list(self._pending.values())
            if not futures:
                return
            concurrent.futures.wait(futures)
