"""A module's parameters: the walk over them and putting values on their devices.

Checkpoint loading (``checkpoint.py``) and tensor parallelism (``parallel.py``) both
walk an NNX module's parameters and place host values with a sharding; both take these
two from here. A leaf: it imports jax, numpy and flax only.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def module_param_paths(module: nnx.Module) -> list[tuple[tuple, nnx.Param]]:
    """(path, Param) for every parameter of the module, in a stable order."""
    out = []
    for path, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param):
            out.append((tuple(path), var))
    return out


def put(tree, sharding: jax.sharding.Sharding):
    """``jax.device_put(tree, sharding)``, also when the sharding spans other processes'
    devices (``jax.distributed``), which ``device_put`` refuses for a host value: then
    each process places its own shards of the value, which every process holds alike
    (the same checkpoint, the same initial state)."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def put_one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # already global: a reshard
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put_one, tree)
