"""Steps of the default-model pipeline (``scripts/make_default_model.sh``) between its
training runs: the draft's step count fitted to what is left of the stage budget
(``plan_draft_steps``), the cast of a checkpoint to bfloat16 (``cast_checkpoint``) and the
size report of the model pair (``checkpoint_size_report``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np

from eagle_jax.checkpoint import CheckpointReader, save_sharded
from eagle_jax.config import resolve_dtype
from eagle_jax.train.target import safetensors_bytes


def cast_checkpoint(src: str, dst: str, dtype: str = "bfloat16",
                    max_shard_bytes: int = 15 * 10**6) -> int:
    """Copies a safetensors model directory with floating tensors cast to ``dtype``
    (integer / bool tensors kept) and config.json's torch_dtype updated; other JSON /
    text files are copied. Returns the safetensors bytes written."""
    reader = CheckpointReader(src)
    target = np.dtype(resolve_dtype(dtype))
    tensors = {}
    for name in reader.keys():
        arr = np.asarray(reader.get(name))
        tensors[name] = arr.astype(target) if jnp.issubdtype(arr.dtype, jnp.floating) else arr
    os.makedirs(dst, exist_ok=True)
    for old in glob.glob(os.path.join(dst, "*.safetensors")):
        os.remove(old)
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if os.path.isfile(full) and not name.endswith(".safetensors") and \
                name != "model.safetensors.index.json":
            shutil.copyfile(full, os.path.join(dst, name))
    cfg_path = os.path.join(dst, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            c = json.load(f)
        c["torch_dtype"] = np.dtype(target).name
        with open(cfg_path, "w") as f:
            json.dump(c, f, indent=2)
    save_sharded(dst, tensors, max_shard_bytes=max_shard_bytes)
    return safetensors_bytes(dst)


def checkpoint_size_report(dirs: dict[str, str]) -> dict:
    """{name: {tensors, params, bytes, by_dtype}} of safetensors model directories."""
    report = {}
    for key, d in dirs.items():
        reader = CheckpointReader(d)
        by_dtype: dict[str, int] = {}
        params = 0
        for name in reader.keys():
            arr = reader.get(name)
            by_dtype[str(arr.dtype)] = by_dtype.get(str(arr.dtype), 0) + arr.nbytes
            params += arr.size
        report[key] = dict(tensors=len(reader.keys()), elements=int(params),
                           tensor_bytes=int(sum(by_dtype.values())), by_dtype=by_dtype,
                           file_bytes=safetensors_bytes(d))
    return report


def plan_draft_steps(calib_out: str, data_dir: str, phase1_start: float, phase1_end: float,
                     remaining_s: float, *, max_steps: int, min_steps: int = 20,
                     safety: float = 0.92, default_startup_s: float = 15.0) -> dict:
    """Steps for the real draft run from a calibration run of ``scripts/train_draft.py``
    (``--out calib_out --data-dir data_dir --stop-after K``), so that a second, fresh
    invocation (same data cache, same shapes) ends within ``remaining_s``.

    * step time: from the calibration's metrics.jsonl (``elapsed_s`` at log steps; the
      first log is skipped, it holds the compilation);
    * the second run's fixed cost: its startup (imports, target load: the time from the
      calibration's start to its first feature chunk on disk, else ``default_startup_s``)
      plus the calibration's time after feature collection (``data_dir/meta.json`` written)
      less its training steps (compilations, first evaluation, saves, exit).

    ``steps`` is 0 when fewer than ``min_steps`` fit: keep the calibration run's draft.
    """
    recs = []
    with open(os.path.join(calib_out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and "elapsed_s" in r:
                recs.append(r)
    if len(recs) < 3:
        raise ValueError(f"{calib_out}/metrics.jsonl: need 3 logged steps, found {len(recs)}")
    a, b = recs[1], recs[-1]
    rate = (b["elapsed_s"] - a["elapsed_s"]) / max(b["step"] - a["step"], 1)
    k = recs[-1]["step"]
    meta_path = os.path.join(data_dir, "meta.json")
    collect_end = os.path.getmtime(meta_path) if os.path.exists(meta_path) else phase1_start
    firsts = sorted(glob.glob(os.path.join(data_dir, "tokens_*.npy")))
    first_chunk = os.path.getmtime(firsts[0]) if firsts else phase1_start
    if collect_end > phase1_start:
        startup = max(first_chunk - phase1_start, 1.0)
        collect_s = collect_end - first_chunk
    else:  # the cache predates the calibration run
        startup, collect_s = default_startup_s, 0.0
        collect_end = phase1_start + default_startup_s
    post = max(phase1_end - collect_end - k * rate, 0.0)
    overhead = startup + post
    steps = int(max(remaining_s - overhead, 0.0) * safety / max(rate, 1e-6))
    return dict(step_s=rate, calib_steps=k, startup_s=round(startup, 2),
                collect_s=round(collect_s, 2), fixed_s=round(overhead, 2),
                remaining_s=round(remaining_s, 2), fit_steps=steps,
                steps=0 if steps < min_steps else int(min(steps, max_steps)))
