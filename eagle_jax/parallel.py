"""Tensor parallelism: a 1-D device mesh, parameter shardings by role, the KV pool's.

The model is written once, for one device; tensor parallelism is a ``Mesh`` (axis
``"tp"``) and shardings on the same functions (the Megatron split):

    column-parallel  qkv_proj, gate_up_proj   weight [out, in] rows (and bias) on "tp"
    row-parallel     o_proj, down_proj        weight [out, in] input axis on "tp"
    vocab-parallel   embed_tokens, lm_head    weight [V, H] rows on "tp" (when N divides V)
    replicated       norms, q/k norms, anything else

An FP8 projection's ``weight_scale`` [out] shards as its weight's output axis (with a
column-parallel weight's rows; replicated beside a row-parallel one), its static
``input_scale`` is replicated; a row-parallel layer's per-token activation scale is a
maximum over the sharded input axis, which XLA reduces across the devices.

XLA's SPMD partitioner derives the rest from these: every matmul runs on the local shard,
the row-parallel outputs (o_proj, down_proj) take one all-reduce each, the embedding a
masked gather and the LM head vocabulary-sharded logits. The only code that sees shards is
the paged attention kernel, which runs per shard under ``shard_map`` (``per_shard``):
a Pallas call is opaque to the partitioner. The fused projections' rows are ordered shard
by shard (``models.layers.FusedLinear``), so an even split of their row axis hands every
device exactly its q / k / v heads (or gate / up columns) and nothing is resharded.

KV heads: with N <= K kv heads, device s holds kv heads [s K / N, (s + 1) K / N) and the
query heads that use them. With N > K (N a multiple of K) every kv head is replicated
N / K times, in the k / v projection rows and in the pool, so that the pool has N kv heads
and device s holds kv head s // (N / K) of the checkpoint: the one its query heads use.
The pool's per-device bytes are then those of one kv head.

This module depends on jax, flax, the config and ``params.py`` (the parameter walk and
``put``, shared with the checkpoint loader) only: the models import it.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eagle_jax.config import ModelConfig
from eagle_jax.params import module_param_paths, put

TP_AXIS = "tp"

# Parameter roles by the module name just above the parameter (its path's [-2]).
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
# An FP8 layer's static activation scales (one per checkpoint tensor) are replicated; its
# ``weight_scale`` [out] follows the weight's output axis (split with a column-parallel
# weight's rows, whole beside a row-parallel one's).
REPLICATED_NAMES = ("input_scale",)

# A KV pool layer [num_pages, page_size, kv_heads, head_dim]: kv heads on "tp".
KV_PAGES_SPEC = P(None, None, TP_AXIS, None)
# Attention's q and output [B, T, heads, head_dim]: heads on "tp".
HEADS_SPEC = P(None, None, TP_AXIS, None)


def tensor_parallel_size(mesh: Mesh | None) -> int:
    """Devices along the mesh's "tp" axis; 1 without a mesh."""
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def kv_replicas(num_kv_heads: int, tp: int) -> int:
    """How many times each kv head is stored: N / K when N > K kv heads, else 1."""
    return tp // num_kv_heads if tp > num_kv_heads else 1


def check_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raises ValueError unless ``tp`` splits the heads evenly (see the module docstring)."""
    if num_heads % tp:
        raise ValueError(
            f"tensor-parallel size {tp} does not divide the model's {num_heads} attention "
            f"heads; use a size that divides {num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor-parallel size {tp} and the model's {num_kv_heads} kv heads: one must "
            f"divide the other (kv heads split over the devices, or each replicated on "
            f"tp / {num_kv_heads} devices); use a divisor or a multiple of {num_kv_heads}")


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raises ValueError, naming the fix, unless ``tp`` devices can split ``cfg``'s model:
    it must divide the attention heads and the MLP width, and divide or be a multiple of
    the kv heads."""
    check_heads(cfg.num_heads, cfg.num_kv_heads, tp)
    if cfg.intermediate_size % tp:
        raise ValueError(
            f"tensor-parallel size {tp} does not divide the model's intermediate size "
            f"{cfg.intermediate_size}; use a size that divides it")


def make_mesh(tensor_parallel_size: int, cfg: ModelConfig | None = None,
              devices: list | None = None) -> Mesh:
    """A 1-D mesh (axis "tp") over ``devices`` (a data-parallel replica's group,
    ``device_groups``), by default the first ``tensor_parallel_size`` local devices.

    With ``cfg``, also checks that the model splits over that many devices
    (``check_tensor_parallel``). Raises ValueError naming the fix.
    """
    n = tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {n!r}")
    if devices is None:
        devices = device_groups(1, n)[0]
    if len(devices) != n:
        raise ValueError(f"a mesh of tensor-parallel size {n} needs {n} devices, got "
                         f"{len(devices)}: pass one device group of device_groups(M, {n})")
    if cfg is not None:
        check_tensor_parallel(cfg, n)
    return Mesh(np.array(devices), (TP_AXIS,))


def device_groups(data_parallel_size: int, tensor_parallel_size: int) -> list[list]:
    """The local devices of each of M data-parallel replicas of N devices each: replica i
    takes devices [i N, (i + 1) N). Raises ValueError naming the fix when M N exceeds
    the local devices.

    With several processes (``jax.distributed``) there is one group, every process's
    devices (``global_device_group``)."""
    m, n = data_parallel_size, tensor_parallel_size
    if jax.process_count() > 1:
        return [global_device_group(m, n)]
    devices = jax.local_devices()
    if m * n > len(devices):
        sizes, fix = ((f"tensor-parallel size {n}", "") if m == 1 else (
            f"data-parallel size {m} x tensor-parallel size {n} = {m * n} devices",
            " in all (lower --data-parallel-size or --tensor-parallel-size)"))
        raise ValueError(
            f"{sizes} exceeds the {len(devices)} local {devices[0].platform} device(s); "
            f"use at most {len(devices)}{fix} (on a CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={m * n} before jax starts)")
    return [list(devices[i * n:(i + 1) * n]) for i in range(m)]


def global_device_group(data_parallel_size: int, tensor_parallel_size: int) -> list:
    """Every device of every process, the one tensor-parallel group of a multi-process run.

    Each process runs the same program over all of them (SPMD), so the group must take
    every process's devices: a mesh that left a process's devices out would leave that
    process nothing to run. Raises ValueError naming the fix for a data-parallel size
    above 1 (replicas across processes are not supported) or a tensor-parallel size other
    than the global device count."""
    m, n = data_parallel_size, tensor_parallel_size
    devices = jax.devices()
    processes = jax.process_count()
    if m != 1:
        raise ValueError(
            f"data-parallel size {m} with {processes} processes: replicas across processes "
            f"are not supported; use --data-parallel-size 1 and --tensor-parallel-size "
            f"{len(devices)} (one tensor-parallel group over every process's devices)")
    if n != len(devices):
        raise ValueError(
            f"tensor-parallel size {n} with {processes} processes of {len(devices)} devices "
            f"in all: a multi-process engine spans every device; use "
            f"--tensor-parallel-size {len(devices)}")
    return list(devices)


def min_over_processes(num_bytes: int) -> int:
    """The smallest of every process's ``num_bytes`` (rounded down to KiB: jax's integers
    are 32-bit), so that processes sizing a buffer from their own free memory agree on
    one size; ``num_bytes`` itself with one process."""
    if jax.process_count() == 1:
        return num_bytes
    from jax.experimental import multihost_utils

    kib = multihost_utils.process_allgather(np.array(num_bytes // 1024, np.int32))
    return int(np.min(kib)) * 1024


def param_spec(path: tuple, shape: tuple[int, ...], tp: int) -> P:
    """The PartitionSpec of the parameter at ``path`` (e.g. ``('layers', 0, 'mlp',
    'down_proj', 'weight')``) of shape ``shape`` by its role (module docstring).

    A vocabulary-parallel table whose V is not a multiple of ``tp`` stays replicated
    (it costs memory, not correctness): an uneven split would pad every shard.
    """
    module, name = (str(path[-2]), str(path[-1])) if len(path) >= 2 else ("", "")
    if name in REPLICATED_NAMES:
        return P()
    if module in COLUMN_PARALLEL:
        return P(TP_AXIS, *([None] * (len(shape) - 1)))
    if module in ROW_PARALLEL and name == "weight":
        return P(None, TP_AXIS)
    if module in VOCAB_PARALLEL and name == "weight" and shape[0] % tp == 0:
        return P(TP_AXIS, None)
    return P()


def param_shardings(model: nnx.Module, mesh: Mesh) -> dict[tuple, NamedSharding]:
    """Parameter path -> NamedSharding, for every parameter of ``model``."""
    tp = tensor_parallel_size(mesh)
    return {path: NamedSharding(mesh, param_spec(path, var.shape, tp))
            for path, var in module_param_paths(model)}


def shard_params(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places every parameter of ``model`` with its sharding (in place; returns it)."""
    shardings = param_shardings(model, mesh)
    for path, var in module_param_paths(model):
        var.set_value(put(var[...], shardings[path]))
    return model


def replicate_tree(tree, mesh: Mesh):
    """Every array of ``tree`` replicated on the mesh's devices."""
    return put(tree, NamedSharding(mesh, P()))


def place(module: nnx.Module, sharding: jax.sharding.Sharding) -> nnx.Module:
    """Places every array variable of ``module`` with ``sharding`` (in place; returns it):
    a draft replicated on the target's mesh, or a data-parallel replica's models
    committed to its one device (else its executables would run on the default device).
    Arrays already committed to the sharding's devices stay as they are: a draft's
    borrowed target embedding / LM head keep their vocabulary-parallel sharding, arrays
    built on the replica's device are not copied."""
    devices = sharding.device_set
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable) and isinstance(var[...], jax.Array):
            x = var[...]
            if not (x.committed and x.sharding.device_set == devices):
                var.set_value(put(x, sharding))
    return module


def kv_pages_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of one KV pool layer [num_pages, page_size, kv_heads, head_dim]."""
    return NamedSharding(mesh, KV_PAGES_SPEC)


def shard_pages(pages, mesh: Mesh):
    """A KV pool (``KVPages``, every layer) placed with its kv heads on "tp"."""
    return put(pages, kv_pages_sharding(mesh))


def per_shard(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``fn`` run on each device's shards (``jax.shard_map``, jax >= 0.10.2).

    check_vma is off: a ``pallas_call``'s outputs carry no varying-axes annotation, which
    the check would demand; the specs say how each output varies instead.
    """
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
