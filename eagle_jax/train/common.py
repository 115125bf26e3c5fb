"""Machinery shared by target pre-training (``target``) and draft training (``trainer``):
the AdamW optimizer and its warm-up + cosine learning rate, the data-parallel mesh, and
resumable training-state checkpoints.

``cfg`` below is either run's config (``TargetTrainConfig`` / ``TrainConfig``): only the
fields each function names are read.

Checkpoint layout (``root`` is ``OUT/ckpt`` for the target, ``OUT/checkpoints`` for the
draft)::

    root/step_XXXXXXX/   state.safetensors (params + optimizer state) + meta.json

Tensor names are ``"params" + keystr(path)`` / ``"opt" + keystr(path)`` of the leaves of the
parameter and optimizer-state pytrees; ``meta.json`` is whatever the caller passes.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eagle_jax.checkpoint import CheckpointReader, save_safetensors

# ------------------------------------------------------------------------ optimizer


def matrices_only(params) -> Any:
    """Weight-decay mask: a pytree of bools like ``params``, True on leaves of rank >= 2."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def warmup_cosine_lr(step, total, cfg) -> jax.Array:
    """Learning rate of update ``step`` (0-based) of ``total``: linear warm-up to ``cfg.lr``
    over ``cfg.warmup`` steps (``lr * (step + 1) / warmup``), then cosine decay to
    ``cfg.min_lr_ratio * cfg.lr`` at ``total``.

    step, total: int scalars or traced int32 [] (jit-able: a ``total`` that changes at run
    time needs no recompilation). Returns float32 []. Reads cfg.lr, warmup, min_lr_ratio.
    """
    step = jnp.asarray(step, jnp.float32)
    total = jnp.asarray(total, jnp.float32)
    warm = max(cfg.warmup, 1)
    warm_lr = cfg.lr * (step + 1.0) / warm
    progress = jnp.clip((step - warm) / jnp.maximum(total - warm, 1.0), 0.0, 1.0)
    cos_lr = cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 *
                       (1.0 + jnp.cos(jnp.pi * progress)))
    return jnp.where(step < warm, warm_lr, cos_lr)


def make_optimizer(cfg, *, lr_in_step: bool = False,
                   decay_mask=None) -> optax.GradientTransformation:
    """AdamW (eps 1e-8, decoupled weight decay) after global-norm gradient clipping.

    lr_in_step: False: the learning rate is optax's ``warmup_cosine_decay_schedule`` of the
      update count (0 at count 0, ``cfg.lr`` after ``cfg.warmup``, ``cfg.min_lr_ratio *
      cfg.lr`` at ``cfg.steps``) inside the optimizer, i.e. ``optax.adamw``; the updates
      are ready for ``optax.apply_updates``. True: no learning rate (state without a
      schedule count): the caller scales the updates by ``-lr`` itself, e.g. with
      ``warmup_cosine_lr`` computed inside jit from (step, total).
    decay_mask: None (decay every leaf) or a pytree / callable of bools, as optax's
      ``add_decayed_weights`` takes it (e.g. ``matrices_only``).

    Reads cfg.clip_norm, b1, b2, weight_decay (and lr, warmup, steps, min_lr_ratio when
    not ``lr_in_step``). The state tree (so the checkpoint tensor names) is
    ``(clip, adam, decay)`` with ``lr_in_step``, else ``(clip, (adam, decay, schedule))``.
    """
    clip = optax.clip_by_global_norm(cfg.clip_norm)
    adamw = (optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=1e-8),
             optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    if lr_in_step:
        return optax.chain(clip, *adamw)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=max(cfg.warmup, 1),
        decay_steps=max(cfg.steps, cfg.warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)
    return optax.chain(clip, optax.chain(*adamw, optax.scale_by_learning_rate(schedule)))


# ------------------------------------------------------------------- data parallel


def data_parallel(batch_size: int) -> tuple[list, NamedSharding, NamedSharding]:
    """A Mesh with one 'data' axis over the local devices.

    Returns (devices, replicated, sharded): ``replicated`` (P()) for parameters and
    optimizer state, ``sharded`` (P('data'): the leading axis split) for [B, ...] batches.
    Raises ValueError unless ``batch_size`` (global, sequences) divides evenly.
    """
    devices = jax.local_devices()
    if batch_size % len(devices):
        raise ValueError(f"batch_size {batch_size} must be a multiple of the "
                         f"{len(devices)} local devices")
    mesh = Mesh(np.array(devices), ("data",))
    return devices, NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


# ---------------------------------------------------------------------- checkpoints


def step_dir(root: str, step: int) -> str:
    """``root/step_XXXXXXX`` (zero-padded: lexical order is step order)."""
    return os.path.join(root, f"step_{step:07d}")


def _named_leaves(tree, prefix: str) -> dict[str, Any]:
    """{prefix + keystr(path): leaf} of a pytree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + jax.tree_util.keystr(path): leaf for path, leaf in flat}


def save_state(path: str, params, opt_state, meta: dict) -> None:
    """Writes ``path/state.safetensors`` (params + optimizer state, as host numpy) and
    ``path/meta.json`` (``meta``, indent 2) atomically: into ``path.tmp``, then renamed."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tensors = {name: np.asarray(jax.device_get(leaf)) for name, leaf in
               {**_named_leaves(params, "params"), **_named_leaves(opt_state, "opt")}.items()}
    save_safetensors(os.path.join(tmp, "state.safetensors"), tensors)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def load_state(path: str, params, opt_state) -> tuple[Any, Any, dict]:
    """Fills the templates ``params`` / ``opt_state`` (pytrees whose leaves give shape and
    dtype) from ``path``; returns (params, opt_state, meta) with host numpy leaves.
    Raises ``CheckpointError`` (a ValueError) on a missing tensor or another shape."""
    reader = CheckpointReader(path)

    def fill(tree, prefix):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [np.asarray(reader.get(prefix + jax.tree_util.keystr(p),
                                        expected_shape=np.shape(leaf)),
                             dtype=np.asarray(leaf).dtype) for p, leaf in flat]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    return fill(params, "params"), fill(opt_state, "opt"), meta


def _step_dirs(root: str) -> list[str]:
    """``root/step_*`` directories, oldest first, without unfinished ``.tmp`` ones."""
    return sorted(p for p in glob.glob(os.path.join(root, "step_*")) if not p.endswith(".tmp"))


def latest_checkpoint(root: str) -> str | None:
    """The newest complete (meta.json written) ``root/step_*`` directory, or None."""
    paths = [p for p in _step_dirs(root) if os.path.exists(os.path.join(p, "meta.json"))]
    return paths[-1] if paths else None


def prune_checkpoints(root: str, keep: int) -> None:
    """Deletes all but the newest ``keep`` ``root/step_*`` directories (none if keep <= 0)."""
    for p in _step_dirs(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
