"""Draft-tree attention mask: kernel against reference against a plain walk of the parent
chains, chains, the mask's own semantics, input checks, export and the ROCm compile."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels._common import TRITON_CUSTOM_CALL, compiled_kernels
from eagle_jax.kernels.tree_mask import (
    MAX_KERNEL_NODES, TreeMask, build_tree_mask, build_tree_mask_reference)

reference = jax.jit(build_tree_mask_reference)


# --------------------------------------------------------------------------------------
# Random trees and an independent walk of their parent chains.
# --------------------------------------------------------------------------------------


def _random_parents(seed, batch, n1):
  """[batch, n1] int32 parents: linked nodes (half of them to a recent node, so chains
  get deep), absent nodes (negative parents, parents >= i, some past N1) and orphans
  (a valid link to an absent node)."""
  rng = np.random.default_rng(seed)
  parents = np.full((batch, n1), -1, np.int32)
  for b in range(batch):
    parents[b, 0] = rng.choice([-1, -7, 0, n1 + 3])  # ignored whatever it holds
    absent = []
    for i in range(1, n1):
      kind = rng.uniform()
      if kind < 0.12:
        parents[b, i] = -1 - rng.integers(4)
      elif kind < 0.22:
        parents[b, i] = i + rng.integers(0, n1 + 2)  # itself, a later node, past N1
      elif kind < 0.34 and absent:
        parents[b, i] = rng.choice(absent)  # an orphan: its parent is absent
      elif kind < 0.67:
        parents[b, i] = rng.integers(max(0, i - 3), i)  # a recent node: deep chains
      else:
        parents[b, i] = rng.integers(0, i)
      if not _reaches_root(parents[b], i):
        absent.append(i)
  return parents


def _reaches_root(par, i):
  while i != 0:
    if not 0 <= par[i] < i:
      return False
    i = par[i]
  return True


def _walk(parents):
  """The TreeMask of ``parents`` by following each node's chain of links in Python."""
  batch, n1 = parents.shape
  mask = np.zeros((batch, n1, n1), bool)
  depth = np.zeros((batch, n1), np.int32)
  present = np.zeros((batch, n1), bool)
  for b in range(batch):
    for i in range(n1):
      chain, c = [i], i
      while c != 0 and 0 <= parents[b, c] < c:
        c = int(parents[b, c])
        chain.append(c)
      if c == 0:
        mask[b, i, chain] = True
        depth[b, i] = len(chain) - 1
        present[b, i] = True
      else:
        mask[b, i, i] = True
  return TreeMask(mask, depth, present)


def _assert_equal(out, want):
  assert out.mask.dtype == jnp.bool_ and out.present.dtype == jnp.bool_
  assert out.depth.dtype == jnp.int32
  for name in TreeMask._fields:
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), getattr(want, name),
                                  err_msg=name)


@pytest.mark.parametrize("n1,batch,seed", [(1, 3, 0), (2, 5, 1), (9, 6, 2), (33, 4, 3),
                                           (65, 3, 4)])
def test_random_trees_kernel_matches_reference_and_walk(n1, batch, seed):
  """The public function (the kernel, interpreted on a CPU) and the reference against a
  plain walk of the parent chains, on trees with absent nodes and orphans."""
  parents = _random_parents(seed, batch, n1)
  want = _walk(parents)
  _assert_equal(build_tree_mask(parents), want)
  _assert_equal(reference(parents), want)
  if n1 >= 9:  # the draw is not trivial: deep chains, absent nodes, orphans
    linked = (np.arange(n1) > 0) & (parents >= 0) & (parents < np.arange(n1))
    assert want.depth.max() >= 4
    assert np.any(~want.present & ~linked) and np.any(~want.present & linked)


def test_public_function_runs_the_kernel_on_cpu():
  """interpret=None on a CPU takes the Pallas kernel, not the reference fallback."""
  jaxpr = str(jax.make_jaxpr(build_tree_mask)(jnp.zeros((2, 9), jnp.int32)))
  assert "pallas_call" in jaxpr
  assert "pallas_call" not in str(jax.make_jaxpr(build_tree_mask_reference)(
      jnp.zeros((2, 9), jnp.int32)))


def test_jit_and_integer_dtypes():
  parents = _random_parents(5, 4, 17)
  want = _walk(parents)
  _assert_equal(jax.jit(build_tree_mask)(parents), want)
  _assert_equal(build_tree_mask(parents.astype(np.int8)), want)
  _assert_equal(build_tree_mask(jnp.asarray(parents, jnp.int16)), want)


# --------------------------------------------------------------------------------------
# Chains and the mask's semantics.
# --------------------------------------------------------------------------------------


# Chain lengths on both sides of a power of two: N1 - 1 links need ceil(log2(N1 - 1))
# squarings, one fewer would miss the root.
@pytest.mark.parametrize("n1", [3, 17, 18, 33, 34, 65])
def test_chain_is_lower_triangular(n1):
  parents = np.tile(np.arange(-1, n1 - 1, dtype=np.int32), (2, 1))
  out = build_tree_mask(parents)
  tril = np.tril(np.ones((n1, n1), bool))
  np.testing.assert_array_equal(out.mask, np.broadcast_to(tril, (2, n1, n1)))
  np.testing.assert_array_equal(out.depth, np.tile(np.arange(n1), (2, 1)))
  assert np.all(np.asarray(out.present))
  _assert_equal(reference(parents), _walk(parents))


def test_chain_beyond_kernel_size_takes_reference():
  n1 = MAX_KERNEL_NODES + 1
  parents = np.arange(-1, n1 - 1, dtype=np.int32)[None]
  parents[0, n1 // 2] = -1  # the second half hangs from an absent node
  out = build_tree_mask(parents)
  _assert_equal(out, _walk(parents))
  assert out.depth[0, n1 // 2 - 1] == n1 // 2 - 1 and not out.present[0, n1 // 2 + 1]


def test_mask_semantics_on_a_tree_of_chains():
  """Each node's row is the chain root .. node: its parent's row plus itself, a path of
  depth + 1 nodes whose every node's row is contained in it; absent rows see only
  themselves; column 0 is presence."""
  n1 = 33
  parents = _random_parents(6, 4, n1)
  # Row 0: three chains of 10 hanging from the root, and two absent nodes.
  parents[0] = -1
  for i in range(1, 31):
    parents[0, i] = 0 if i % 10 == 1 else i - 1
  parents[0, 32] = 31  # 31 is absent: 32 is an orphan
  out = build_tree_mask(parents)
  mask, depth, present = (np.asarray(x) for x in out)
  for b in range(parents.shape[0]):
    assert present[b, 0] and depth[b, 0] == 0
    for i in range(n1):
      assert mask[b, i, i]  # an attention row is never empty
      if not present[b, i]:
        assert depth[b, i] == 0 and mask[b, i].sum() == 1
        continue
      assert mask[b, i].sum() == depth[b, i] + 1 and mask[b, i, 0]
      assert not mask[b, i, i + 1:].any()  # ancestors have smaller indices
      if i > 0:
        p = parents[b, i]
        assert present[b, p] and depth[b, i] == depth[b, p] + 1
        np.testing.assert_array_equal(mask[b, i], mask[b, p] | (np.arange(n1) == i))
      for j in np.flatnonzero(mask[b, i]):  # transitive: an ancestor's ancestors
        assert np.all(mask[b, i] >= mask[b, j])
  # The three chains of row 0: depth 1..10 each, disjoint apart from the root.
  np.testing.assert_array_equal(depth[0, 1:31], np.tile(np.arange(1, 11), 3))
  assert not present[0, 31] and not present[0, 32]
  tril = np.tril(np.ones((10, 10), bool))
  for c in range(3):
    block = slice(1 + 10 * c, 11 + 10 * c)
    np.testing.assert_array_equal(mask[0, block, block], tril)
    assert mask[0, block].sum() == tril.sum() + 10  # the chain and the root, nothing else


# --------------------------------------------------------------------------------------
# Input checks.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("parents,match", [
    (np.zeros((9,), np.int32), "2-D"),
    (np.zeros((2, 3, 9), np.int32), "2-D"),
    (np.zeros((2, 9), np.float32), "integer"),
    (np.zeros((2, 9), bool), "integer"),
    (np.zeros((2, 0), np.int32), "N1 >= 1"),
])
@pytest.mark.parametrize("fn", [build_tree_mask, build_tree_mask_reference])
def test_bad_input_raises(fn, parents, match):
  with pytest.raises(ValueError, match=match):
    fn(parents)


def test_bad_input_raises_under_jit():
  with pytest.raises(ValueError, match="integer"):
    jax.jit(build_tree_mask)(jnp.zeros((2, 9), jnp.float32))


# --------------------------------------------------------------------------------------
# Export and the ROCm compile.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n1", [9, 65])
@pytest.mark.parametrize("platform,target", [("cuda", "sm_90"), ("rocm", "gfx942")])
def test_exports_triton_kernel(platform, target, n1):
  """The kernel lowers through the Triton path for CUDA and ROCm on a CPU machine (as in
  tests/test_kernels_export.py: the Triton custom call allowed explicitly)."""
  fn = lambda p: build_tree_mask(p, interpret=False)
  with compiled_kernels(target=target):
    exported = jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(
            jax.ShapeDtypeStruct((8, n1), jnp.int32))
  assert exported.mlir_module().count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}") == 1
  assert [a.shape for a in exported.out_avals] == [(8, n1, n1), (8, n1), (8, n1)]


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="the triton package exists for Linux only")
@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_compiles_for_amd_without_spills(arch):
  """The Triton IR JAX emits for ROCm compiles for gfx950 / gfx942 with the triton
  package, without spills, at the engine's tree sizes (scripts/rocm_compile.py's tools,
  as tests/test_rocm_compile.py uses them for the other kernels)."""
  from eagle_jax.bench import rocm_compile

  rows = []
  for n1 in (9, 33, 65):
    fn = lambda p: build_tree_mask(p, interpret=False, target=arch)
    [call] = rocm_compile.triton_calls(fn, [jax.ShapeDtypeStruct((64, n1), jnp.int32)], "rocm")
    assert call.name == "tree_mask" and call.grid == (64, 1, 1)
    row = dict(model="-", case=f"tree mask N1={n1}", kernel=call.name, arch=arch,
               num_warps=call.num_warps)
    try:
      row.update(rocm_compile.resources(call, arch))
    except Exception as e:  # noqa: BLE001 - reported by failures()
      row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
    rows.append(row)
  assert rocm_compile.failures(rows) == []
