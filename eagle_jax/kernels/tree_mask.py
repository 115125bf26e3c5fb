"""Draft-tree attention mask from parent links: ancestors, depth and presence per node.

What it is for. EAGLE-2 tree verification scores the N + 1 nodes of a draft tree in one
target forward. Node i may attend only to the committed context and to its own
ancestors among the nodes (itself included), never to a sibling branch: the mask is
passed as ``block_mask [B, T, M = T]`` (T = N + 1) to
``eagle_jax.kernels.paged_attention.paged_attention``, where column u of row t is block
key u and keys before the block are always visible. Node i's RoPE position is
``seq_len + depth[i]``: the root sits at seq_len (the committed tokens before the block)
and every node one past its parent, so siblings share a position.

Tree layout, per row b (as ``tree_sampler.py``): node 0 is the root (its parent entry is
ignored, conventionally -1); node i > 0 has a parent link iff ``0 <= parents[b, i] < i``
(anything else, e.g. a negative entry, marks it absent). A node is present iff its chain
of links reaches the root: the root always; node i > 0 iff it has a link and its parent
is present (an orphan, whose parent is absent, is absent too). For a present node,
``mask[i, j]`` is True iff j is i or one of its ancestors up to and including the root,
and ``depth[i]`` is the number of links to the root (root 0). An absent node's row is
itself only (``mask[i, i]``, so an attention row never sees no key), depth 0.

Algorithm: reflexive-transitive closure by repeated squaring. R = I | P, with P[i, k] = 1
iff k is node i's parent link, holds every ancestor within 1 link; R <- min(1, R @ R)
doubles the reach (R is reflexive, so R @ R keeps what R had), and links go from a node
to a smaller index, so no chain has more than N1 - 1 links: ceil(log2(N1 - 1)) squarings
give every ancestor. Then present[i] = R[i, 0], depth[i] = rowsum(R[i]) - 1, and absent
rows are reset to the identity. Why: a parent-chain walk is a data-dependent loop of up
to N1 - 1 dependent gathers per node; the closure is O(log N1) 2-D dots of a matrix
that fits in registers (N1 <= 65 in the engine), no dynamic trip count, no gather, and
the 0/1 operands and integer sums (<= N1) are exact in bfloat16 x bfloat16 -> float32.

Kernel design. One pallas_call (Triton path), grid (B,): one program per row loads the
row's parents as a power-of-two vector (N1P >= 16, the smallest dot edge; masked lanes
read -1, no link), builds R in registers, squares it with ``dot_general`` and writes the
[N1, N1] mask (int8, masked store: the wrapper neither pads nor slices) and one int32
per node: depth, or -1 for an absent node. The wrapper turns these into bool and the
``TreeMask`` fields. The public function falls back to the pure-jnp reference (pointer
jumping: the 2^k-th ancestor and the ancestors within 2^k links, by row gathers, a
different algorithm from the kernel's) on backends without a Triton lowering (TPU), for
an empty batch, and for trees of more than ``MAX_KERNEL_NODES`` nodes, whose [N1P, N1P]
matrices would no longer fit in registers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common

# The kernel holds [N1P, N1P] matrices in registers: 128 x 128 is 16 entries per thread
# at 16 warps (a workgroup's most on AMD: 1024 lanes); above it the public function takes
# the reference.
MAX_KERNEL_NODES = 128
# Triton's smallest dot edge.
_MIN_NODES_PAD = 16


class TreeMask(NamedTuple):
  """The attention mask of a draft tree and its nodes' depths. Shapes: [B, N1(, N1)]."""

  mask: jax.Array  # bool [B, N1, N1]: node j is node i itself or one of its ancestors
  depth: jax.Array  # int32 [B, N1]: links from the root (root 0); 0 for absent nodes
  present: jax.Array  # bool [B, N1]: the chain of parent links reaches the root


def _check_parents(parents) -> jax.Array:
  """parents as an int32 [B, N1] array; ValueError naming the problem and the fix."""
  shape = jnp.shape(parents)
  dtype = jnp.result_type(parents)
  if len(shape) != 2:
    raise ValueError(
        f"parents must be 2-D [B, N1] (a batch of trees), got shape {shape}; for a single "
        f"tree pass parents[None]")
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(
        f"parents must be an integer array of node indices, got dtype {dtype}; pass "
        f"parent indices as int32 (-1 for the root and absent nodes)")
  if shape[1] < 1:
    raise ValueError(
        f"parents must have N1 >= 1 columns (node 0 is the root), got shape {shape}; "
        f"a tree of N draft tokens has N1 = N + 1 nodes")
  return jnp.asarray(parents).astype(jnp.int32)


def _num_squarings(num_nodes: int) -> int:
  """ceil(log2(N1 - 1)): squarings for chains of up to N1 - 1 links (0 for N1 <= 2)."""
  return max(num_nodes - 2, 0).bit_length()


# --------------------------------------------------------------------------------------
# Reference: pointer jumping with row gathers.
# --------------------------------------------------------------------------------------


def build_tree_mask_reference(parents) -> TreeMask:
  """Pure-jnp reference of :func:`build_tree_mask` (same argument and result).

  Pointer jumping: up_k[i] is node i's 2^k-th ancestor (the root is its own parent; a
  chain that breaks goes to a sentinel node N1 with no ancestors) and A_k[i] the nodes
  within 2^k links of i, itself included; A_{k+1}[i] = A_k[i] | A_k[up_k[i]] and
  up_{k+1}[i] = up_k[up_k[i]].
  """
  parents = _check_parents(parents)
  batch, num_nodes = parents.shape
  nodes = jnp.arange(num_nodes, dtype=jnp.int32)
  sentinel = num_nodes
  link = (nodes > 0) & (parents >= 0) & (parents < nodes)
  up = jnp.where(link, parents, jnp.where(nodes == 0, 0, sentinel))  # [B, N1]
  up = jnp.concatenate([up, jnp.full((batch, 1), sentinel, jnp.int32)], axis=1)
  eye = nodes[:, None] == nodes[None, :]  # [N1, N1]
  anc = eye | (up[:, :num_nodes, None] == nodes)  # [B, N1, N1]
  anc = jnp.concatenate([anc, jnp.zeros((batch, 1, num_nodes), jnp.bool_)], axis=1)
  gather = jax.vmap(lambda table, index: table[index])
  for _ in range(_num_squarings(num_nodes)):
    anc = anc | gather(anc, up)
    up = gather(up, up)
  anc = anc[:, :num_nodes]
  present = anc[:, :, 0]
  mask = jnp.where(present[:, :, None], anc, eye)
  depth = jnp.where(present, jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1, 0)
  return TreeMask(mask=mask, depth=depth.astype(jnp.int32), present=present)


# --------------------------------------------------------------------------------------
# Pallas kernel (Triton path): one program per row squares its ancestor matrix.
# --------------------------------------------------------------------------------------


def _num_warps(num_nodes_pad: int, gpu: _common.GpuTarget) -> int:
  """Warps for one program's [N1P, N1P] matrix: about 16 entries per thread, 4 to 16 warps.

  N1P = 64 (the engine's 33-node trees): 8 warps on NVIDIA, 4 on AMD; N1P = 128 (65
  nodes): 16 on both. The grid is B programs, one tree each, fewer than the SMs / CUs at
  decode batch sizes, so a program's own warps are all the parallelism there is.
  Compiled at N1 = 9, 33, 65 for gfx942 / gfx950 (``scripts/rocm_compile.py``'s tools,
  tests/test_kernels_tree_mask.py): 22-122 VGPRs, no spills; sm_90: 28-60 registers, no
  local memory. With 8 warps at N1P = 128 AMD needs 142-146 VGPRs, and before the
  squarings were a loop (``fori_loop``, one body) instead of unrolled, 177 and SGPR spills.
  """
  per_thread = 16
  return max(4, min(16, num_nodes_pad * num_nodes_pad // (per_thread * gpu.warp_size)))


def _tree_mask_kernel(par_ref, mask_ref, depth_ref, *, num_nodes, num_nodes_pad):
  b = pl.program_id(0)
  nodes = jnp.arange(num_nodes_pad, dtype=jnp.int32)
  in_tree = nodes < num_nodes
  par = plgpu.load(par_ref.at[b, nodes], mask=in_tree, other=-1)
  link = in_tree & (nodes > 0) & (par >= 0) & (par < nodes)
  rows, cols = nodes[:, None], nodes[None, :]
  eye = rows == cols
  # R = I | P, 0/1 in bfloat16: exact dot operands, whose sums (<= N1P) accumulate
  # exactly in float32; min(1, .) brings them back to 0/1.
  r = jnp.where(eye | (link[:, None] & (par[:, None] == cols)), 1.0, 0.0).astype(jnp.bfloat16)

  def square(_, r):
    rr = lax.dot_general(r, r, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.minimum(rr, 1.0).astype(jnp.bfloat16)

  r = lax.fori_loop(0, _num_squarings(num_nodes), square, r).astype(jnp.float32)
  reaches_root = jnp.sum(jnp.where(cols == 0, r, 0.0), axis=1) > 0.0  # R[i, 0]
  present = in_tree & reaches_root  # the root too: R[0, 0] = 1
  r = jnp.where(present[:, None], r, jnp.where(eye, 1.0, 0.0))
  depth = jnp.sum(r, axis=1).astype(jnp.int32) - 1
  out = in_tree[:, None] & (cols < num_nodes)
  plgpu.store(mask_ref.at[b, rows, cols], r.astype(jnp.int8), mask=out)
  plgpu.store(depth_ref.at[b, nodes], jnp.where(present, depth, -1), mask=in_tree)


def _tree_mask_pallas(parents, *, interpret, gpu, num_warps=None):
  """parents [B, N1] int32 -> (mask [B, N1, N1] int8, depth [B, N1] int32, -1 = absent)."""
  batch, num_nodes = parents.shape
  num_nodes_pad = max(_MIN_NODES_PAD, _common.next_power_of_2(num_nodes))
  num_warps = num_warps or _num_warps(num_nodes_pad, gpu)
  return pl.pallas_call(
      functools.partial(_tree_mask_kernel, num_nodes=num_nodes, num_nodes_pad=num_nodes_pad),
      out_shape=(
          jax.ShapeDtypeStruct((batch, num_nodes, num_nodes), jnp.int8),
          jax.ShapeDtypeStruct((batch, num_nodes), jnp.int32),
      ),
      grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="tree_mask",
  )(parents)


def build_tree_mask(parents, *, interpret: bool | None = None,
                    target: str | None = None) -> TreeMask:
  """The attention mask, depths and presence of each row's draft tree (module docstring).

  Args:
    parents: [B, N1] integer; node 0 is the root (entry ignored, conventionally -1);
      node i > 0 is linked to parents[b, i] if that is in [0, i), else absent.
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
    target: the GPU to pick the launch for (a key of ``_common.GPU_TARGETS``); None =
      automatic (``_common.resolve_target``).
  Returns:
    TreeMask: mask [B, N1, N1] bool (ancestors and self; identity rows for absent
    nodes), depth [B, N1] int32 (0 for absent nodes), present [B, N1] bool.
  """
  parents = _check_parents(parents)
  batch, num_nodes = parents.shape
  supported = (
      _common.kernel_backend_ok(interpret)
      and batch >= 1
      and num_nodes <= MAX_KERNEL_NODES
  )
  if not supported:
    return build_tree_mask_reference(parents)
  mask, depth = _tree_mask_pallas(
      parents, interpret=_common.resolve_interpret(interpret),
      gpu=_common.resolve_target(target))
  present = depth >= 0
  return TreeMask(mask=mask != 0, depth=jnp.maximum(depth, 0), present=present)
