"""Compiled executables kept on disk, so that a warm start neither traces nor compiles.

JAX's persistent compilation cache skips XLA's compile, but it is keyed by the lowered
program: every start still traces and lowers each executable (~3 s each on a CPU for the
default pair, most of a warm start). This store is keyed by what an executable is
*built from*, known before tracing:

- the code: a hash of the eagle_jax package's source files, the jax and jaxlib versions,
  the jax settings that change a program (matmul precision, x64);
- the machine: the backend platform, the kinds and count of the devices, the devices the
  engine runs on, ``XLA_FLAGS``;
- the executable: its ``ExecutableKey``, the shapes, dtypes, shardings and tree
  structure of its example arguments, its donated arguments, and ``context`` (the
  engine's and models' configurations that shape its function: ``ModelRunner``).

A hit is loaded with ``jax.experimental.serialize_executable.deserialize_and_load``; a
miss is compiled (``executables.jit_compile``'s way) and written (a temporary file,
then a rename: a reader never sees half an entry). An entry that does not load (corrupt,
truncated, from an incompatible build) is logged and compiled again, never an error.
Every edit of the source makes new entries (~6 MB each for the default pair on a CPU):
past ``max_bytes`` the least recently used are removed (a hit refreshes an entry's time).

Entries are pickles and executables, loaded as they are: like JAX's own cache, the
directory must be one only its user can write.

Only serving's ``jit_compile`` uses it: a ``CompileFn`` of the comparison tool runs or
wraps the function differently, which the key cannot see.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import time
from typing import Callable

import jax
import jaxlib
from jax.experimental import serialize_executable

from eagle_jax.engine.buckets import ExecutableKey
from eagle_jax.engine.executables import CallSignature

logger = logging.getLogger("eagle_jax.engine")

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORE_SUBDIR = "executables"  # under the JAX cache directory
FORMAT = 1  # bump when an entry's layout changes
MAX_STORE_BYTES = 2 << 30  # entries beyond this, least recently used first, are removed


def jax_cache_in_use() -> bool:
    """Whether JAX's persistent compilation cache serves this process's compiles. An
    executable JAX loaded from that cache serializes without its compiled functions on a
    CPU (jax 0.10.2: the entry loads, then fails at its first call with "NOT_FOUND:
    Function add_select_fusion.15 not found"), and a compile does not say whether it was
    such a load: while JAX's cache is in use, the store keeps nothing. (JAX decides once
    per process whether its cache is used, so the decision is asked, not the setting.)"""
    if not jax.config.jax_compilation_cache_dir:
        return False
    try:
        from jax._src import compilation_cache  # the decision has no public name

        return compilation_cache.is_cache_used(jax.devices()[0].client)
    except (ImportError, AttributeError):
        return True


def store_dir(compilation_cache_dir: str) -> str:
    """Where the store lives for ``EngineConfig.compilation_cache_dir`` ("" = none)."""
    return os.path.join(compilation_cache_dir, STORE_SUBDIR) if compilation_cache_dir else ""


@functools.cache
def source_hash() -> str:
    """sha256 of the eagle_jax package's Python sources (paths and contents)."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, PACKAGE_DIR).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()


def environment() -> str:
    """The code and machine part of every key (module docstring)."""
    devices = jax.devices()
    return repr(dict(
        format=FORMAT, source=source_hash(), jax=jax.__version__, jaxlib=jaxlib.__version__,
        platform=jax.default_backend(), device_kinds=sorted({d.device_kind for d in devices}),
        num_devices=len(devices), xla_flags=os.environ.get("XLA_FLAGS", ""),
        matmul_precision=str(jax.config.jax_default_matmul_precision),
        x64=bool(jax.config.jax_enable_x64)))


def argument_signature(example_args: tuple) -> str:
    """The tree structure and each leaf's shape, dtype, weak type and sharding."""
    leaves, treedef = jax.tree.flatten(example_args)
    return repr((str(treedef), [
        (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
         str(getattr(x, "sharding", None))) for x in leaves]))


class ExecutableStore:
    """Serialized executables under ``directory`` (module docstring). ``context``: what
    else shapes the functions (the configurations); ``devices``: the devices the
    executables run on (a data-parallel replica's, a tensor-parallel mesh's)."""

    def __init__(self, directory: str, context: str, devices: list,
                 max_bytes: int = MAX_STORE_BYTES):
        self.directory, self.max_bytes = directory, max_bytes
        self.devices = list(devices)
        self._prefix = environment() + context + repr([d.id for d in self.devices])
        self.hits = self.misses = 0

    def path(self, key: ExecutableKey, example_args: tuple,
             donate_argnums: tuple[int, ...]) -> str:
        """The entry's file: its name hashes everything the executable is built from."""
        digest = hashlib.sha256("\0".join((
            self._prefix, repr(key), argument_signature(example_args),
            repr(tuple(donate_argnums)))).encode()).hexdigest()
        return os.path.join(self.directory, f"{key.name}-{digest[:40]}.bin")

    def load_or_compile(self, key: ExecutableKey, fn: Callable, example_args: tuple,
                        donate_argnums: tuple[int, ...]) -> Callable:
        """The stored executable of ``key``, or ``fn`` compiled (and stored)."""
        signature = CallSignature.of(example_args)
        path = self.path(key, example_args, donate_argnums)
        compiled = self._load(path, key)
        if compiled is not None:
            self.hits += 1
            return signature.wrap(compiled)
        self.misses += 1
        compiled = signature.lower(fn, example_args, donate_argnums).compile()
        if jax_cache_in_use():
            logger.debug("executable store: JAX's persistent cache is in use in this "
                         "process; %r is not stored", key)
        else:
            self._save(path, key, compiled)
        return signature.wrap(compiled)

    def _load(self, path: str, key: ExecutableKey):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("executable store: cannot read %s (%s); compiling %r", path, e, key)
            return None
        try:
            start = time.perf_counter()
            serialized, in_tree, out_tree = pickle.loads(data)
            compiled = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=self.devices)
            logger.debug("executable store: loaded %r in %.2f s", key,
                         time.perf_counter() - start)
            try:
                os.utime(path)  # recently used: the last to be evicted
            except OSError:
                pass
            return compiled
        except Exception as e:  # noqa: BLE001 - any bad entry is recompiled, never fatal
            logger.warning("executable store: entry %s for %r does not load (%s: %s); "
                           "compiling it again", path, key, type(e).__name__, e)
            return None

    def _save(self, path: str, key: ExecutableKey, compiled) -> None:
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # noqa: BLE001 - e.g. an executable with constants
            logger.info("executable store: %r cannot be serialized (%s: %s); it compiles "
                        "at every start", key, type(e).__name__, e)
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("executable store: cannot write %s (%s); %r will compile at "
                           "the next start too", path, e, key)
            return
        self._evict()

    def _evict(self) -> None:
        """Removes the least recently used entries while they hold over ``max_bytes``."""
        entries = []
        for name in os.listdir(self.directory):
            if name.endswith(".bin"):
                try:
                    st = os.stat(os.path.join(self.directory, name))
                except OSError:  # removed meanwhile (another process)
                    continue
                entries.append((st.st_mtime, st.st_size, name))
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError:
                pass
            total -= size
