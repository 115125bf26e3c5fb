"""Safetensors checkpoints: reading, writing, and loading into NNX modules.

The reader parses the safetensors format directly (an 8-byte header length, a JSON
header, raw little-endian tensors) over a memory map, so a tensor is read only when it is
needed, bfloat16 needs nothing beyond ``ml_dtypes``, and every error can name the file
and the tensor. Pickle checkpoints (``*.bin``, ``*.pt``) are refused, never loaded:
``scripts/convert_checkpoint.py`` converts them (reading tensors only, no code run).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import struct
import threading
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from eagle_jax.config import read_json
from eagle_jax.params import module_param_paths, put

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_NP_TO_SAFETENSORS = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


class SafetensorsFile:
    """Lazy reader of one ``.safetensors`` file."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            size = os.path.getsize(path)
            if n > size - 8:
                raise CheckpointError(f"{path}: corrupt safetensors header length {n}")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._offset = 8 + n
        self._size = size
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype code ("BF16", "F8_E4M3", ...)."""
        return self.header[name]["dtype"]

    def _layout(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, first byte, end byte) of a tensor in the file, checked."""
        info = self.header[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = (self._offset + o for o in info["data_offsets"])
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end > self._size:
            raise CheckpointError(f"{self.path}: tensor {name!r} spans bytes {start}..{end} "
                                  f"but the file ends at {self._size}: it is truncated")
        if end - start != count * np.dtype(dtype).itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} holds {end - start} bytes, expected "
                f"{count * np.dtype(dtype).itemsize} for shape {info['shape']} {info['dtype']}")
        return np.dtype(dtype), tuple(info["shape"]), start, end

    def nbytes(self, name: str) -> int:
        start, end = self.header[name]["data_offsets"]
        return end - start

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file's memory map (read when touched)."""
        dtype, shape, start, end = self._layout(name)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[start:end].view(dtype).reshape(shape)

    def warm(self, name: str) -> None:
        """Asks the kernel to read the tensor's bytes into the page cache (one
        ``posix_fadvise(WILLNEED)``, submitting large sequential reads), so that ``get``'s
        memory map finds them there rather than reading a few pages per fault; a no-op
        for bytes already cached."""
        _, _, start, end = self._layout(name)
        if not hasattr(os, "posix_fadvise"):  # (not on macOS: the faults read then)
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


class CheckpointReader:
    """All tensors of a Hugging Face model directory (one file or an indexed set of shards)."""

    def __init__(self, model_dir: str | os.PathLike):
        model_dir = os.fspath(model_dir)
        if not os.path.isdir(model_dir):
            raise CheckpointError(f"{model_dir}: not a directory")
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        self._prefetch: _Prefetch | None = None
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: no 'weight_map' object")
            for name, fname in weight_map.items():
                path = os.path.join(model_dir, fname)
                if fname not in self._files:
                    if not os.path.exists(path):
                        raise CheckpointError(
                            f"{index_path}: shard {fname} (holding {name!r}) is missing")
                    self._files[fname] = SafetensorsFile(path)
                if name not in self._files[fname].header:
                    raise CheckpointError(f"{path}: tensor {name!r} listed in the index is absent")
                self._where[name] = fname
        elif files:
            for fname in files:
                st = SafetensorsFile(os.path.join(model_dir, fname))
                self._files[fname] = st
                for name in st.keys():
                    self._where[name] = fname
        else:
            pickles = [f for f in os.listdir(model_dir) if f.endswith(PICKLE_SUFFIXES)]
            if pickles:
                raise CheckpointError(
                    f"{model_dir}: only pickle checkpoints found ({', '.join(sorted(pickles))}); "
                    "pickles are never loaded: convert them to safetensors with "
                    f"'python scripts/convert_checkpoint.py {model_dir}' (tensors only, no "
                    "code run)")
            raise CheckpointError(f"{model_dir}: no *.safetensors files found")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    @contextlib.contextmanager
    def prefetching(self, names: Sequence[str], *, max_bytes: int = 2 << 30,
                    workers: int = 4) -> Iterator[None]:
        """Within the block, ``workers`` threads have the kernel read ``names`` into the
        page cache (in the order ``get`` will ask for them; absent ones are skipped)
        ahead of ``get``, at most ``max_bytes`` beyond the tensors taken: the disk reads
        large ranges while the caller converts and sends each tensor to its devices. (A
        cold load of an 8B checkpoint, each tensor's pages faulted in by the memory map
        and then sent, ran at 0.73 of the disk's speed on an H100 host.)"""
        self._prefetch = _Prefetch([(n, self._files[self._where[n]]) for n in names
                                    if n in self._where], max_bytes, workers)
        try:
            yield
        finally:
            self._prefetch.close()
            self._prefetch = None

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> str:
        return os.path.join(self.model_dir, self._where[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def dtype(self, name: str) -> str:
        return self._files[self._where[name]].dtype(name)

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor, a view of its file's memory map (within ``prefetching``, once its
        read was asked for); CheckpointError naming the file and tensor when it is absent
        or of another shape than ``expected_shape``."""
        if name not in self._where:
            shape = f"; expected shape {tuple(expected_shape)}" if expected_shape else ""
            raise CheckpointError(f"checkpoint {self.model_dir} lacks tensor {name!r}{shape}")
        if self._prefetch is not None:
            self._prefetch.wait(name)
        arr = self._files[self._where[name]].get(name)
        if expected_shape is not None and tuple(arr.shape) != tuple(expected_shape):
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has shape {tuple(arr.shape)}; "
                f"expected shape {tuple(expected_shape)}")
        return arr


class _Prefetch:
    """Asks for tensors' reads into the page cache in a given order on background
    threads (``SafetensorsFile.warm``), at most ``max_bytes`` ahead of the tensors
    waited for (one always asked for): the cache it fills stays bounded whatever the
    checkpoint's size."""

    def __init__(self, order: list[tuple[str, SafetensorsFile]], max_bytes: int,
                 workers: int):
        self._order = order
        self._max_bytes = max_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "checkpoint-read")
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._sizes = {name: f.nbytes(name) for name, f in order}
        self._next = 0  # order[_next:] not submitted yet
        self._ahead = 0  # bytes asked for and not waited for
        self._lock = threading.Lock()
        self._submit()

    def _submit(self) -> None:
        while self._next < len(self._order) and (
                not self._futures or self._ahead < self._max_bytes):
            name, file = self._order[self._next]
            self._next += 1
            if name not in self._futures:
                self._futures[name] = self._pool.submit(file.warm, name)
                self._ahead += self._sizes[name]

    def wait(self, name: str) -> None:
        """Returns once ``name``'s read was asked for (at once for a name not in the
        order), and asks for the reads the window now admits; raises the
        CheckpointError ``warm`` raised for it."""
        with self._lock:
            future = self._futures.pop(name, None)
            if future is not None:
                self._ahead -= self._sizes[name]
            self._submit()
        if future is not None:
            future.result()

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)


def save_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Writes one safetensors file (tensors in insertion order)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(np.asarray(arr)).reshape(np.shape(arr))
        code = _NP_TO_SAFETENSORS.get(arr.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be saved")
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def save_sharded(model_dir: str, tensors: Mapping[str, np.ndarray],
                 max_shard_bytes: int = 5 << 30) -> list[str]:
    """Writes ``model.safetensors`` or shards plus ``model.safetensors.index.json``."""
    os.makedirs(model_dir, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        nbytes = np.asarray(arr).nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += nbytes
    if len(shards) == 1:
        save_safetensors(os.path.join(model_dir, "model.safetensors"), shards[0])
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(os.path.join(model_dir, fname), shard)
        names.append(fname)
        for name, arr in shard.items():
            weight_map[name] = fname
            total += np.asarray(arr).nbytes
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def fused_row_order(rows: tuple[int, ...], shards: int = 1,
                    replicas: tuple[int, ...] | None = None) -> np.ndarray:
    """Row r of a fused parameter is row ``order[r]`` of its parts' checkpoint tensors
    concatenated (part 0's ``rows[0]`` rows, then part 1's, ...).

    Shard-major (``models.layers.FusedLinear``): the rows are ``shards`` equal blocks,
    block s holding, part by part, shard s's slice of each part. Part i is cut into
    ``shards / replicas[i]`` equal chunks and block s takes chunk ``s // replicas[i]``,
    so each chunk appears ``replicas[i]`` times (kv heads replicated when the devices
    outnumber them). shards = 1: the identity.
    """
    replicas = replicas or (1,) * len(rows)
    starts = np.cumsum((0,) + tuple(rows))[:-1]
    order = []
    for s in range(shards):
        for start, n, rep in zip(starts, rows, replicas):
            size = n // (shards // rep)
            first = start + (s // rep) * size
            order.append(np.arange(first, first + size))
    return np.concatenate(order)


def _shard_layout(var: nnx.Param) -> tuple[int, tuple[int, ...] | None]:
    """(shards, replicas) of a fused parameter's rows (``fused_row_order``); (1, None)
    for any other."""
    return getattr(var, "checkpoint_shards", 1), getattr(var, "checkpoint_replicas", None)


def _part_names(path: tuple, var: nnx.Param, name_of: Callable[[tuple], str]):
    """[(checkpoint name, rows)] of a parameter: itself, or the separate tensors a fused
    parameter (``checkpoint_parts`` metadata, see ``models.layers.FusedLinear``) is made of:
    the fused module's name in the path replaced by each part's."""
    parts = getattr(var, "checkpoint_parts", None)
    if parts is None:
        return [(name_of(path), var.shape[0])]
    return [(name_of(path[:-2] + (part,) + path[-1:]), rows) for part, rows in parts]


def keeps_dtype(var: nnx.Param) -> bool:
    """Whether a parameter keeps its own dtype on load and save (an FP8 weight and its
    float32 scales, ``models.layers``) instead of taking the model's."""
    return getattr(var, "checkpoint_keeps_dtype", False)


def load_into(module: nnx.Module, reader: CheckpointReader, name_of: Callable[[tuple], str],
              dtype, *, optional: Iterable[str] = (),
              shardings: dict[tuple, jax.sharding.Sharding] | None = None,
              read: Callable | None = None) -> None:
    """Fills every parameter of ``module`` from the checkpoint, cast to ``dtype`` (a
    parameter that keeps its dtype, ``keeps_dtype``, is read as it is).

    ``shardings`` (parameter path -> sharding; tensor parallelism): each tensor goes from
    the host straight to its devices, each device receiving only its shard, so a model
    larger than one device loads (nothing is built whole on one device first).

    ``name_of`` maps a parameter path (e.g. ``('layers', 0, 'mlp', 'down_proj', 'weight')``)
    to its checkpoint name; a fused parameter is the concatenation (along its first axis)
    of its parts' tensors, rows reordered shard by shard when it is tensor-parallel
    (``fused_row_order``). The expected shape is each part's checkpoint rows; a missing
    tensor or a shape mismatch raises a CheckpointError naming the file, tensor and shape.
    ``read(name, expected_shape, var)`` reads one tensor (default ``reader.get``; FP8
    models: ``fp8_checkpoint.Fp8Loader.read``). A float8 tensor read into a parameter
    that is not FP8 is an error (its scales would be lost).
    """
    optional = set(optional)
    params = [(path, var, _part_names(path, var, name_of))
              for path, var in module_param_paths(module)]
    with reader.prefetching([name for _, _, parts in params for name, _ in parts]):
        for path, var, parts in params:
            _load_param(reader, path, var, parts, dtype, optional, shardings, read)


def _load_param(reader, path, var, parts, dtype, optional, shardings, read) -> None:
    """One parameter of ``load_into``."""
    if len(parts) == 1 and parts[0][0] in optional and parts[0][0] not in reader:
        return
    arrays = [reader.get(name, expected_shape=(rows,) + tuple(var.shape[1:]))
              if read is None else read(name, (rows,) + tuple(var.shape[1:]), var)
              for name, rows in parts]
    for (name, _), arr in zip(parts, arrays):
        if arr.dtype.itemsize == 1 and arr.dtype.kind == "V" and not keeps_dtype(var):
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor {name!r} is {arr.dtype}; eagle_jax reads "
                "FP8 tensors only as the decoder layers' projections of a checkpoint "
                "whose config.json declares an FP8 quantization_config "
                "(compressed-tensors or fbgemm_fp8) with their scales")
    arr = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
    shards, replicas = _shard_layout(var)
    if shards > 1:
        arr = arr[fused_row_order(tuple(rows for _, rows in parts), shards, replicas)]
    cast = var.dtype if keeps_dtype(var) else dtype
    if shardings is None:
        var.set_value(jnp.asarray(arr, dtype=cast))
    else:
        var.set_value(put(arr.astype(cast), shardings[path]))


def module_tensors(module: nnx.Module, name_of: Callable[[tuple], str],
                   dtype=None) -> dict[str, np.ndarray]:
    """Checkpoint-named numpy copies of every parameter of ``module`` (fused parameters
    split back into their parts, in the checkpoint's row order; of a replicated kv head
    the first copy is written), cast to ``dtype`` but those that keep theirs (FP8:
    ``fp8_checkpoint.checkpoint_layout`` turns them into a checkpoint's)."""
    out = {}
    for path, var in module_param_paths(module):
        arr = np.asarray(jax.device_get(var[...]))
        arr = arr if dtype is None or keeps_dtype(var) else arr.astype(dtype)
        names = _part_names(path, var, name_of)
        shards, replicas = _shard_layout(var)
        if shards > 1:
            order = fused_row_order(tuple(rows for _, rows in names), shards, replicas)
            arr = arr[np.unique(order, return_index=True)[1]]  # first copy of each row
        start = 0
        for name, rows in names:
            out[name] = arr[start:start + rows]
            start += rows
    return out


def dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)
