"""Convert a PyTorch pickle checkpoint to safetensors, reading its tensors and nothing else.

    eagle-jax convert SRC [OUT]

SRC is a model directory holding ``pytorch_model.bin`` (as the published LLaMA-3.1-8B
EAGLE-3 draft ships), or sharded ``pytorch_model-*.bin`` files with their
``pytorch_model.bin.index.json``, or one ``.bin`` / ``.pt`` / ``.pth`` file, or an index.
OUT (default: SRC's directory) gets ``model.safetensors``, or for a sharded checkpoint
one ``model-XXXXX-of-XXXXX.safetensors`` per ``.bin`` shard plus
``model.safetensors.index.json``: the same tensor names, shapes, dtypes and values. When
OUT is another directory, SRC's other files (config.json, tokenizer, ...) are copied
there, pickles excepted. eagle_jax itself never reads a pickle (its checkpoint reader
refuses them and names this script).

How the pickle is read: ``torch.save``'s zip archive (``*/data.pkl`` + one raw record per
storage) is unpickled with a restricted unpickler that resolves only what a state dict
of plain tensors needs: ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``,
``torch._utils._rebuild_parameter`` (and ``_rebuild_parameter_with_state`` with no state),
and the ``torch.<dtype>Storage`` names, each replaced by a numpy stand-in, so torch is not
needed and no callable of the file's choosing ever runs.

Refused, each with a message naming the file and the thing refused:

* any other pickle global (``os.system``, ``builtins.eval``, a custom class, ...): a
  pickle calls whatever it names while it loads, so naming anything else is refused;
* anything but a flat ``{name: tensor}`` mapping (a training checkpoint with optimizer
  state, a step counter, nested dicts): only the tensors of a model convert; save
  ``model.state_dict()``;
* the pre-1.6 torch format and TorchScript archives: not a ``torch.save`` zip of tensors;
* storage dtypes it does not read (complex, quantized, float8: an FP8 checkpoint is
  published as safetensors already);
* tensors with backward hooks or python state;
* an index that disagrees with its shards (a listed shard or tensor missing, or a shard
  holding tensors the index does not list);
* an OUT that already holds safetensors (old shards would mix with the new ones).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import shutil
import sys
import zipfile

import ml_dtypes
import numpy as np

from eagle_jax.checkpoint import PICKLE_SUFFIXES, CheckpointError, save_safetensors

# torch.<name>Storage -> the numpy dtype of its elements
STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}
PICKLE_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class _StorageType:
    """Stand-in for a ``torch.<dtype>Storage`` class: only its element dtype matters."""

    def __init__(self, name: str):
        self.name, self.dtype = name, np.dtype(STORAGE_DTYPES[name])


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` of a ``torch.save`` archive into numpy arrays; every pickle
    global outside the allowlist is refused, so the file cannot run code."""

    def __init__(self, archive: zipfile.ZipFile, root: str, path: str):
        super().__init__(archive.open(f"{root}/data.pkl"))
        self.archive, self.root, self.path = archive, root, path
        byteorder = f"{root}/byteorder"
        self.big_endian = (byteorder in archive.namelist()
                           and archive.read(byteorder).strip() == b"big")
        self.storages: dict[str, np.ndarray] = {}
        self.allowed = {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): self._rebuild_parameter,
        }

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)
        if module == "torch" and name.endswith("Storage"):
            raise CheckpointError(
                f"{self.path}: refused torch.{name}: its dtype has no safetensors form here "
                f"(supported: {', '.join(sorted(STORAGE_DTYPES))})")
        raise CheckpointError(
            f"{self.path}: refused pickle global {module}.{name}: only tensors are read (a "
            "pickle calls what it names while loading, so nothing else is resolved)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise CheckpointError(f"{self.path}: refused persistent id {pid!r}: not a storage")
        _, storage_type, key, _location, numel = pid
        if key not in self.storages:
            record = f"{self.root}/data/{key}"
            try:
                raw = self.archive.read(record)
            except KeyError:
                raise CheckpointError(f"{self.path}: storage record {record} is missing") from None
            dtype = storage_type.dtype
            if len(raw) != int(numel) * dtype.itemsize:
                raise CheckpointError(
                    f"{self.path}: storage {key} holds {len(raw)} bytes, expected "
                    f"{int(numel) * dtype.itemsize} for {numel} {storage_type.name} elements")
            if self.big_endian and dtype.itemsize > 1:  # swap as unsigned ints, then view
                swapped = np.frombuffer(raw, f">u{dtype.itemsize}").astype(f"<u{dtype.itemsize}")
                self.storages[key] = swapped.view(dtype)
            else:
                self.storages[key] = np.frombuffer(raw, dtype)
        return self.storages[key]

    def _rebuild_tensor(self, storage, offset, size, stride, requires_grad=False,
                        backward_hooks=None, metadata=None):
        if backward_hooks:
            raise CheckpointError(f"{self.path}: refused a tensor with backward hooks")
        if not isinstance(storage, np.ndarray):
            raise CheckpointError(f"{self.path}: refused a tensor built from {type(storage)}")
        size, stride = tuple(int(n) for n in size), tuple(int(s) for s in stride)
        if len(size) != len(stride) or any(n < 0 for n in size) or any(s < 0 for s in stride):
            raise CheckpointError(f"{self.path}: tensor of size {size}, stride {stride}: corrupt")
        if 0 in size:
            return np.zeros(size, storage.dtype)
        last = int(offset) + sum((n - 1) * s for n, s in zip(size, stride))
        if offset < 0 or last >= storage.size:
            raise CheckpointError(
                f"{self.path}: tensor of size {size}, stride {stride} at offset {offset} runs "
                f"past its storage of {storage.size} elements")
        view = np.lib.stride_tricks.as_strided(
            storage[int(offset):], shape=size,
            strides=tuple(s * storage.dtype.itemsize for s in stride))
        return np.array(view, order="C")  # contiguous, writable, its own memory

    def _rebuild_parameter(self, data, requires_grad, backward_hooks, state=None):
        if backward_hooks or state:
            raise CheckpointError(f"{self.path}: refused a parameter with backward hooks or "
                                  "python state")
        return data


def read_torch_pickle(path: str) -> dict[str, np.ndarray]:
    """The tensors of one ``torch.save`` file as numpy arrays, read without torch and
    without running any code the file names. Raises CheckpointError on anything else."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: not a torch.save zip archive (the pre-1.6 torch format, or not a torch "
            "checkpoint): re-save it with a current torch, torch.save(state_dict, path)")
    with zipfile.ZipFile(path) as archive:
        roots = {n.split("/")[0] for n in archive.namelist()
                 if n.count("/") == 1 and n.endswith("/data.pkl")}
        if len(roots) != 1:
            kind = ("a TorchScript archive" if any(n.endswith("/constants.pkl")
                                                   for n in archive.namelist())
                    else "a zip without one */data.pkl")
            raise CheckpointError(f"{path}: {kind}, not a torch.save state dict")
        try:
            obj = _TensorUnpickler(archive, roots.pop(), path).load()
        except CheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError,
                IndexError, KeyError) as e:
            raise CheckpointError(f"{path}: corrupt pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a name -> tensor "
                              "mapping: save model.state_dict()")
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, np.ndarray):
            raise CheckpointError(
                f"{path}: {name!r} holds a {type(value).__name__}, not a tensor: only a flat "
                "name -> tensor state dict converts (no optimizer state, counters or nested "
                "dicts); save model.state_dict()")
    return dict(obj)


def _safetensors_name(pickle_name: str) -> str:
    """pytorch_model-00001-of-00002.bin -> model-00001-of-00002.safetensors."""
    stem = os.path.splitext(pickle_name)[0]
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model"):]
    return stem + ".safetensors"


def _find_source(src: str) -> tuple[str, str | None, str | None]:
    """(directory, single pickle file name or None, index file name or None)."""
    if os.path.isfile(src):
        directory, name = os.path.split(os.path.abspath(src))
        return (directory, None, name) if name.endswith(".index.json") else (directory, name, None)
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: no such file or directory")
    names = os.listdir(src)
    if PICKLE_INDEX in names:
        return src, None, PICKLE_INDEX
    if "pytorch_model.bin" in names:
        return src, "pytorch_model.bin", None
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if len(pickles) == 1:
        return src, pickles[0], None
    if not pickles:
        raise CheckpointError(f"{src}: no pickle checkpoint (pytorch_model.bin, *.bin, *.pt, "
                              "*.pth) to convert")
    raise CheckpointError(f"{src}: several pickle files ({', '.join(pickles)}) and no "
                          f"{PICKLE_INDEX}: pass the one to convert")


def _read_index(directory: str, index_name: str) -> dict[str, list[str]]:
    """shard file name -> the tensor names the index puts there."""
    path = os.path.join(directory, index_name)
    with open(path) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: no 'weight_map' object")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    for shard, names in shards.items():
        if not os.path.isfile(os.path.join(directory, shard)):
            raise CheckpointError(f"{path}: shard {shard} (holding {names[0]!r}) is missing")
    return shards


def convert_checkpoint(src: str, out: str | None = None) -> list[str]:
    """Converts the pickle checkpoint at ``src`` (see the module docstring) into
    safetensors in ``out`` (default: its directory); returns the files written."""
    directory, single, index = _find_source(src)
    out = directory if out is None else out
    os.makedirs(out, exist_ok=True)
    existing = sorted(n for n in os.listdir(out)
                      if n.endswith(".safetensors") or n == SAFETENSORS_INDEX)
    if existing:
        raise CheckpointError(f"{out}: already holds {', '.join(existing)}: remove them (or "
                              "choose another OUT) so old and new shards do not mix")
    written = []
    if single is not None:
        tensors = read_torch_pickle(os.path.join(directory, single))
        save_safetensors(os.path.join(out, "model.safetensors"), tensors)
        written.append("model.safetensors")
    else:
        index_path = os.path.join(directory, index)
        weight_map, total = {}, 0
        for shard, listed in _read_index(directory, index).items():
            shard_path = os.path.join(directory, shard)
            tensors = read_torch_pickle(shard_path)
            missing = sorted(set(listed) - set(tensors))
            unlisted = sorted(set(tensors) - set(listed))
            if missing:
                raise CheckpointError(f"{index_path}: lists {missing[0]!r} in {shard}, which "
                                      "lacks it")
            if unlisted:
                raise CheckpointError(f"{shard_path}: holds {unlisted[0]!r}, which {index} does "
                                      "not list: the index and its shards disagree")
            name = _safetensors_name(shard)
            save_safetensors(os.path.join(out, name), tensors)
            written.append(name)
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(a.nbytes for a in tensors.values())
        with open(os.path.join(out, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(SAFETENSORS_INDEX)
    if os.path.abspath(out) != os.path.abspath(directory):
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if (os.path.isfile(path) and not name.endswith(PICKLE_SUFFIXES) and name != index
                    and not os.path.exists(os.path.join(out, name))):
                shutil.copy2(path, os.path.join(out, name))
                written.append(name)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("src", help="model directory, pickle file or pytorch_model.bin.index.json")
    p.add_argument("out", nargs="?", default=None, help="output directory (default: SRC's)")
    a = p.parse_args(argv)
    try:
        written = convert_checkpoint(a.src, a.out)
    except CheckpointError as e:
        print(f"convert_checkpoint: {e}", file=sys.stderr)
        return 1
    out = a.out or _find_source(a.src)[0]
    print(f"wrote {', '.join(written)} to {out}")
    return 0

