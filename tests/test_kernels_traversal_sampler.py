"""Traversal Verification tree sampler: the kernel against its reference, the accepted
node's exact distribution against an independent enumeration of the algorithm, greedy
rows, guards, export. The emitted tokens' distribution against the target's, on the
engine's own trees, is ``tests/test_draft_tree.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels._common import TRITON_CUSTOM_CALL, compiled_kernels
from eagle_jax.kernels.traversal_sampler import traversal_sample, traversal_sample_reference
from eagle_jax.kernels.tree_sampler import tree_speculative_sample
from eagle_jax.testutil.stats import chi2_pvalue
from eagle_jax.testutil.trees import (
    check_flagged_rows, check_poisoned_rows, check_tree_output, random_tree_inputs)

ALPHA = 1e-3  # false-alarm rate of each goodness-of-fit test


@pytest.mark.parametrize("seed,batch,num_nodes,num_cols,vocab,max_depth,block,max_children", [
    (0, 8, 8, 16, 16, 3, None, None),
    (1, 8, 6, 16, 13, 2, 4, None),
    (2, 6, 7, 40, 37, 3, 8, 2),
    (3, 6, 12, 64, 50, 5, 16, 3),
    (4, 4, 6, 48, 20, 3, 16, 2),  # padding columns past the last vocabulary block
])
def test_random_trees_kernel_matches_reference(seed, batch, num_nodes, num_cols, vocab,
                                               max_depth, block, max_children):
  """The public function (the Pallas kernel, interpreted on a CPU) against the
  reference: random parents, absent nodes, duplicate siblings, greedy and sampling rows,
  inactive rows, padding columns, several vocabulary blocks, nodes beyond max_children."""
  tokens, parents, q, q_row, p, greedy, u, active = random_tree_inputs(
      seed, batch, num_nodes, num_cols, vocab, max_depth)
  args = (tokens, parents, q, q_row, p, greedy, u, vocab, active)
  out = traversal_sample(*args, max_depth=max_depth, block_v=block, max_children=max_children)
  ref = traversal_sample_reference(*args, max_depth=max_depth, max_children=max_children)
  if max_children is not None:  # no path goes through a node beyond its parent's cap
    path = np.asarray(out.path)
    rank = np.array([[np.sum(parents[b, 1:i] == parents[b, i]) if i else 0
                      for i in range(num_nodes + 1)] for b in range(batch)])
    on_path = np.take_along_axis(rank, np.maximum(path, 0), axis=1)
    assert np.all(on_path[path > 0] < max_children)
  for name in ("accept_len", "num_tokens", "num_malformed_q", "num_fallback", "path"):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  # The final draw may differ only where blockwise sums move a CDF boundary.
  assert np.mean(np.asarray(out.tokens) == np.asarray(ref.tokens)) >= 0.98
  check_tree_output(out, tokens, parents, vocab, active, max_depth)
  assert np.all(np.asarray(out.num_fallback) == 0)


def test_greedy_rows_equal_the_argmax_walk():
  """Greedy rows take the target's argmax path: the same output as ``tree_sampler``'s."""
  tokens, parents, q, q_row, p, greedy, u, active = random_tree_inputs(4, 10, 8, 16, 16, 3)
  greedy[:] = True
  args = (tokens, parents, q, q_row, p, greedy, u, 16, active)
  out = traversal_sample(*args, max_depth=3)
  ref = tree_speculative_sample(*args, max_depth=3)
  for name in out._fields:
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  assert np.asarray(out.accept_len).max() >= 1


# --------------------------------------------------------------------------------------
# The accepted node's exact distribution, by enumerating the algorithm's branches.
# --------------------------------------------------------------------------------------


def _accepted_node_probs(tokens, parents, q, q_row, p):
  """Probability that each node is the accepted one, in float64: every accept / reject
  branch of Traversal Verification followed with its probability (module docstring of
  ``traversal_sampler``), written independently of the sampler."""
  n1 = len(tokens)
  kids = {c: [i for i in range(1, n1) if parents[i] == c] for c in range(n1)}
  probs = np.zeros(n1)

  def run(alpha, r, qp, removed, weight):
    v, c = 0, None
    while [k for k in kids[v] if k not in removed]:
      c, v = v, [k for k in kids[v] if k not in removed][0]
      if v not in alpha:
        x = tokens[v]
        alpha[v] = min(1.0, alpha[c] * r[c][x] / qp[c][x])
    a = 1.0 if v == 0 else alpha[v]
    probs[v] += weight * a
    if a >= 1.0:
      return
    c, x = parents[v], tokens[v]
    w = np.maximum(alpha[c] * r[c] - qp[c], 0.0)
    delta = w.sum()
    alpha, r, qp = dict(alpha), dict(r), dict(qp)
    alpha[c] = delta / (delta + 1.0 - alpha[c])
    r[c] = w / delta if delta > 0.0 else w  # delta = 0: alpha_c = 0, r_c is never used
    rest = qp[c].copy()
    rest[x] = 0.0
    qp[c] = rest / rest.sum()
    run(alpha, r, qp, removed | {v}, weight * (1.0 - a))

  p64 = p.astype(np.float64)
  r = {c: p64[c] / p64[c].sum() for c in range(n1)}
  qp = {c: q[q_row[kids[c][0]]].astype(np.float64) / q[q_row[kids[c][0]]].sum()
        for c in range(n1) if kids[c]}
  run({0: 1.0}, r, qp, frozenset(), 1.0)
  return probs


def _fixed_tree(seed, num_cols):
  """A tree of 9 nodes (root: 3 children; the first two with 2 and 1; below them one
  more level), tokens drawn without replacement from q at each parent."""
  rng = np.random.default_rng(seed)
  parents = np.array([-1, 0, 0, 0, 1, 1, 2, 4, 5], np.int32)
  n1 = len(parents)
  p = rng.dirichlet(np.full(num_cols, 0.6), size=n1).astype(np.float32)
  q = rng.dirichlet(np.full(num_cols, 0.6), size=n1).astype(np.float32)
  q_row = np.maximum(parents, 0).astype(np.int32)
  tokens = np.zeros(n1, np.int32)
  for c in range(n1):
    kids = [i for i in range(1, n1) if parents[i] == c]
    if kids:
      qc = q[c].astype(np.float64)
      tokens[kids] = rng.choice(num_cols, size=len(kids), replace=False, p=qc / qc.sum())
  return tokens, parents, q, q_row, p


@pytest.mark.parametrize("seed", [0, 1])
def test_accepted_node_distribution_is_exact(seed):
  """The accepted node's frequencies over fresh coins fit the enumerated probabilities
  (chi-square, alpha 1e-3); the mean accept length is the exact one within 4 standard
  errors."""
  num_cols, n = 8, 20000
  tokens, parents, q, q_row, p = _fixed_tree(seed, num_cols)
  expected = _accepted_node_probs(tokens, parents, q, q_row, p)
  assert abs(expected.sum() - 1.0) < 1e-9 and expected[1:].max() > 0.05
  rng = np.random.default_rng(100 + seed)
  rep = lambda x: np.broadcast_to(x, (n,) + x.shape)
  out = traversal_sample_reference(
      rep(tokens), rep(parents), rep(q), rep(q_row), rep(p), np.zeros(n, bool),
      rng.uniform(size=(n, len(tokens) + 1)).astype(np.float32), num_cols, max_depth=3)
  acc = np.asarray(out.accept_len)
  last = np.asarray(out.path)[np.arange(n), acc]
  counts = np.bincount(last, minlength=len(tokens))
  keep = expected > 0
  assert np.all(counts[~keep] == 0)
  assert chi2_pvalue(counts[keep], expected[keep]) > ALPHA
  depth = np.array([0, 1, 1, 1, 2, 2, 2, 3, 3])
  mean, var = expected @ depth, expected @ depth ** 2 - (expected @ depth) ** 2
  assert abs(acc.mean() - mean) < 4 * np.sqrt(var / n)


def test_kernel_matches_reference_on_a_fixed_tree():
  """The kernel's decisions are the reference's on the tree above, coin for coin."""
  num_cols, n = 8, 64
  tokens, parents, q, q_row, p = _fixed_tree(0, num_cols)
  rep = lambda x: np.broadcast_to(x, (n,) + x.shape)
  u = np.random.default_rng(7).uniform(size=(n, len(tokens) + 1)).astype(np.float32)
  args = (rep(tokens), rep(parents), rep(q), rep(q_row), rep(p), np.zeros(n, bool), u,
          num_cols)
  out = traversal_sample(*args, max_depth=3)
  ref = traversal_sample_reference(*args, max_depth=3)
  np.testing.assert_array_equal(out.path, ref.path)
  assert len(np.unique(np.asarray(out.accept_len))) >= 3


def test_the_last_round_of_passes_is_reached():
  """A comb (each level: 3 children, tokens 0, 1, 2, the last one expanded) puts node 9's
  pass in round 9 = max_depth x max_children, the kernels' last. p gives the first two
  children's tokens no mass (alpha 0: rejected whatever the coin) and the third a large
  one, so node 9 is tested, with the state the last round computed, in every row: the
  paths equal the reference's, and node 9 is accepted in many rows."""
  num_cols, n = 12, 64
  parents = np.array([-1, 0, 0, 0, 3, 3, 3, 6, 6, 6], np.int32)
  rng = np.random.default_rng(21)
  q = rng.dirichlet(np.full(num_cols, 0.8), size=(n, 10)).astype(np.float32)
  p = rng.dirichlet(np.full(num_cols, 0.8), size=(n, 10))
  p[..., :2] = 0.0
  p[..., 2] += rng.uniform(0.5, 2.0, size=(n, 10))
  p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  tokens = np.broadcast_to(np.array([0, 0, 1, 2, 0, 1, 2, 0, 1, 2], np.int32), (n, 10))
  q_row = np.broadcast_to(np.maximum(parents, 0), (n, 10)).astype(np.int32)
  u = rng.uniform(size=(n, 11)).astype(np.float32)
  args = (tokens, np.broadcast_to(parents, (n, 10)), q, q_row, p, np.zeros(n, bool), u,
          num_cols)
  out = traversal_sample(*args, max_depth=3, max_children=3)
  ref = traversal_sample_reference(*args, max_depth=3, max_children=3)
  for name in ("path", "accept_len", "num_fallback"):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  assert np.sum(np.asarray(out.path)[:, 3] == 9) >= n // 4


# --------------------------------------------------------------------------------------
# Guards (seed 004).
# --------------------------------------------------------------------------------------


def test_fault_injection_never_emits_invalid_ids():
  check_poisoned_rows(traversal_sample)


def test_missing_draft_probabilities_are_an_error():
  tokens, parents, q, q_row, p, greedy, u, active = random_tree_inputs(5, 2, 4, 8, 8, 2)
  with pytest.raises(ValueError, match="draft_probs"):
    traversal_sample(tokens, parents, None, None, p, greedy, u, 8, active, max_depth=2)


def test_flagged_q_rows_are_set_aside_and_counted():
  check_flagged_rows(traversal_sample)


# --------------------------------------------------------------------------------------
# Export.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("platform,target", [("cuda", "sm_90"), ("rocm", "gfx942")])
def test_exports_triton_kernel(platform, target):
  """The kernels lower through the Triton path for CUDA and ROCm on a CPU machine: the
  passes (one call in the rounds' loop), the draw, and the greedy rows' argmax walk."""
  s = jax.ShapeDtypeStruct
  i32, f32 = jnp.int32, jnp.float32
  b, n1, e, v = 4, 7, 3, 1024

  def fn(tok, par, q, qr, p, g, u, a):
    return traversal_sample(tok, par, q, qr, p, g, u, 1000, a, max_depth=3, interpret=False)

  args = [s((b, n1), i32), s((b, n1), i32), s((b, e, v), f32), s((b, n1), i32),
          s((b, n1, v), f32), s((b,), jnp.bool_), s((b, n1 + 1), f32), s((b,), jnp.bool_)]
  with compiled_kernels(target=target):
    exported = jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(*args)
  assert exported.mlir_module().count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}") == 3
