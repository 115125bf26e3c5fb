"""Safetensors checkpoints: reading, writing, and loading into NNX modules.

The reader parses the safetensors format directly (an 8-byte header length, a JSON
header, raw little-endian tensors) over a memory map, so a tensor is read only when it is
needed, bfloat16 needs nothing beyond ``ml_dtypes``, and every error can name the file
and the tensor. Pickle checkpoints (``*.bin``, ``*.pt``) are refused, never loaded:
``scripts/convert_checkpoint.py`` converts them (reading tensors only, no code run).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable, Mapping

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
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype code ("BF16", "F8_E4M3", ...)."""
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        raw = self._mmap[self._offset + start:self._offset + end]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if raw.size != count * np.dtype(dtype).itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} holds {raw.size} bytes, expected "
                f"{count * np.dtype(dtype).itemsize} for shape {info['shape']} {info['dtype']}")
        return raw.view(dtype).reshape(info["shape"])


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

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> str:
        return os.path.join(self.model_dir, self._where[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def dtype(self, name: str) -> str:
        return self._files[self._where[name]].dtype(name)

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in self._where:
            shape = f"; expected shape {tuple(expected_shape)}" if expected_shape else ""
            raise CheckpointError(f"checkpoint {self.model_dir} lacks tensor {name!r}{shape}")
        arr = self._files[self._where[name]].get(name)
        if expected_shape is not None and tuple(arr.shape) != tuple(expected_shape):
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has shape {tuple(arr.shape)}; "
                f"expected shape {tuple(expected_shape)}")
        return arr


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
    for path, var in module_param_paths(module):
        parts = _part_names(path, var, name_of)
        if len(parts) == 1 and parts[0][0] in optional and parts[0][0] not in reader:
            continue
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
