"""One host-to-device copy per call: an executable's host inputs packed into one buffer.

Each numpy argument of a compiled call is a host-to-device copy of its own at dispatch,
on the request's critical path: a prefill took 15 of them (its prompt chunks and slot
changes, field by field), a step with prompt chunks 9. ``HostLayout`` lays such a pytree
of small arrays end to end in one int32 buffer: the host copies the fields in (a few
microseconds), the executable takes them back out with static slices and bitcasts,
which cost nothing. The layout is static (every field's shape and dtype), so a field of
the wrong shape or dtype is an error at the call, never a silently shifted read.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Dtypes a field may have: 4-byte ones travel as their bits, bool as 0 / 1.
_FIELD_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32),
                 np.dtype(np.bool_))


class HostLayout:
    """Where each field of a pytree of host arrays lies in one int32 buffer.

    ``HostLayout(example)``: ``example`` a pytree of numpy arrays or
    ``jax.ShapeDtypeStruct``s; ``pack(tree)`` (host) gives the [size] int32 buffer,
    ``unpack(buffer)`` (inside the executable) the pytree of jax arrays.
    """

    def __init__(self, example: Any):
        leaves, self.treedef = jax.tree.flatten(example)
        self.fields: list[tuple[tuple[int, ...], np.dtype, int]] = []  # shape, dtype, offset
        offset = 0
        for i, leaf in enumerate(leaves):
            dtype = np.dtype(leaf.dtype)
            if dtype not in _FIELD_DTYPES:
                raise ValueError(f"host input field {i} has dtype {dtype}; a packed field is "
                                 f"one of {[str(d) for d in _FIELD_DTYPES]}")
            self.fields.append((tuple(leaf.shape), dtype, offset))
            offset += math.prod(leaf.shape)
        self.size = offset

    @property
    def spec(self) -> jax.ShapeDtypeStruct:
        """The packed buffer's shape and dtype (the executable's argument)."""
        return jax.ShapeDtypeStruct((self.size,), jnp.int32)

    def pack(self, tree: Any) -> np.ndarray:
        """The host arrays of ``tree`` (the example's structure, shapes and dtypes) as one
        [size] int32 buffer."""
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"host inputs have structure {treedef}, the executable was "
                             f"compiled for {self.treedef}")
        buffer = np.empty((self.size,), np.int32)
        for i, (leaf, (shape, dtype, offset)) in enumerate(zip(leaves, self.fields)):
            leaf = np.asarray(leaf)
            if leaf.shape != shape or leaf.dtype != dtype:
                raise ValueError(f"host input field {i} is {leaf.dtype}{list(leaf.shape)}, the "
                                 f"executable was compiled for {dtype}{list(shape)}")
            bits = leaf.astype(np.int32) if dtype == np.bool_ else leaf.view(np.int32)
            buffer[offset:offset + bits.size] = bits.reshape(-1)
        return buffer

    def unpack(self, buffer: jax.Array) -> Any:
        """The pytree ``pack`` packed, from its buffer (inside a trace)."""
        leaves = []
        for shape, dtype, offset in self.fields:
            bits = buffer[offset:offset + math.prod(shape)].reshape(shape)
            if dtype == np.bool_:
                leaves.append(bits != 0)
            elif dtype == np.int32:
                leaves.append(bits)
            else:
                leaves.append(lax.bitcast_convert_type(bits, dtype))
        return jax.tree.unflatten(self.treedef, leaves)
