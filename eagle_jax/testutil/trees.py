"""Random draft trees for the tree samplers' tests (``tree_sampler``, ``traversal_sampler``)
and the structural check of their output."""

from __future__ import annotations

import numpy as np

from eagle_jax.kernels.tree_common import PAD_TOKEN


def random_tree_inputs(seed, batch, num_nodes, num_cols, vocab, max_depth):
  """Random trees of N = num_nodes draft nodes with depth <= max_depth, absent nodes,
  random q / p, mixed greedy and sampling rows, inactive rows: (tokens, parents, q,
  q_row, p, greedy, uniforms, active) as the samplers take them."""
  rng = np.random.default_rng(seed)
  n1 = num_nodes + 1
  parents = np.full((batch, n1), -1, np.int32)
  depth = np.zeros((batch, n1), np.int32)
  for b in range(batch):
    for i in range(1, n1):
      cands = [j for j in range(i) if (j == 0 or parents[b, j] >= 0) and depth[b, j] < max_depth]
      if rng.uniform() < 0.15 or not cands:
        parents[b, i] = -1 - rng.integers(3)  # absent
        continue
      parents[b, i] = rng.choice(cands)
      depth[b, i] = depth[b, parents[b, i]] + 1
  p = rng.dirichlet(np.full(num_cols, 0.5), size=(batch, n1)).astype(np.float32)
  num_rows = n1  # one q row per node (row j: the q of node j's children)
  q = rng.dirichlet(np.full(num_cols, 0.5), size=(batch, num_rows)).astype(np.float32)
  q_row = np.where(parents >= 0, parents, 0).astype(np.int32)
  tokens = np.zeros((batch, n1), np.int32)
  for b in range(batch):
    for i in range(1, n1):
      if parents[b, i] < 0:
        tokens[b, i] = rng.integers(num_cols)
        continue
      # Half the time the argmax of the target after the parent, so greedy rows accept.
      if rng.uniform() < 0.5:
        tokens[b, i] = np.argmax(p[b, parents[b, i], :vocab])
      else:
        tokens[b, i] = rng.choice(num_cols, p=q[b, q_row[b, i]] / q[b, q_row[b, i]].sum())
  greedy = rng.uniform(size=batch) < 0.4
  u = rng.uniform(size=(batch, n1 + 1)).astype(np.float32)
  active = rng.uniform(size=batch) < 0.85
  active[0] = True
  return tokens, parents, q, q_row, p, greedy, u, active


def check_tree_output(out, tokens, parents, vocab, active, max_depth):
  """A sampler's output is a path of the tree from node 0, its tokens, then one token in
  [0, vocab), then PAD; inactive rows are all PAD with zero counters."""
  out_tok, path = np.asarray(out.tokens), np.asarray(out.path)
  acc, num = np.asarray(out.accept_len), np.asarray(out.num_tokens)
  assert out_tok.shape == path.shape == (tokens.shape[0], max_depth + 1)
  for b in range(tokens.shape[0]):
    if not active[b]:
      assert np.all(out_tok[b] == PAD_TOKEN) and np.all(path[b] == PAD_TOKEN)
      assert num[b] == 0 and acc[b] == 0
      assert out.num_malformed_q[b] == 0 and out.num_fallback[b] == 0
      continue
    a = acc[b]
    assert num[b] == a + 1 and 0 <= a <= max_depth
    assert path[b, 0] == 0
    for j in range(a):
      node = path[b, j + 1]
      assert node > 0 and parents[b, node] == path[b, j]
      assert out_tok[b, j] == tokens[b, node]
    assert 0 <= out_tok[b, a] < vocab
    assert np.all(out_tok[b, a + 1:] == PAD_TOKEN) and np.all(path[b, a + 1:] == PAD_TOKEN)


def check_poisoned_rows(sample):
  """A tree sampler ``sample(tokens, parents, q, q_row, p, greedy, uniforms, vocab,
  active, max_depth=, draft_probs_ok=)`` on ``poisoned_tree_inputs``: it emits only ids
  in the vocabulary, accepts nothing from the poisoned rows 0-7, counts rows 0-6's
  malformed q (not row 7's out-of-vocabulary tokens) and row 9's fallback."""
  args, ok = poisoned_tree_inputs()
  tokens, parents, vocab, active = args[0], args[1], args[7], args[8]
  out = sample(*args, max_depth=3, draft_probs_ok=ok)
  out_tok, acc = np.asarray(out.tokens), np.asarray(out.accept_len)
  for b in range(tokens.shape[0]):
    assert np.all(out_tok[b, :acc[b] + 1] >= 0) and np.all(out_tok[b, :acc[b] + 1] < vocab)
  assert np.all(acc[:8] == 0)
  mal = np.asarray(out.num_malformed_q)
  assert np.all(mal[:7] > 0) and mal[7] == 0
  assert out.num_fallback[9] == 1  # no mass in p: still a draw, with the final coin
  check_tree_output(out, tokens, parents, vocab, active, 3)


def check_flagged_rows(sample):
  """A tree sampler (as ``check_poisoned_rows``) with every q row flagged by
  ``draft_probs_ok`` and coins of 0 (any well-formed candidate with p(x) > 0 would be
  accepted): it accepts nothing and counts each row's root children as malformed."""
  batch, num_nodes, vocab, max_depth = 6, 6, 8, 2
  tokens, parents, q, q_row, p, greedy, u, active = random_tree_inputs(
      10, batch, num_nodes, vocab, vocab, max_depth)
  active[:], greedy[:] = True, False
  u[:] = 0.0
  ok = np.zeros((batch, num_nodes + 1), bool)
  out = sample(tokens, parents, q, q_row, p, greedy, u, vocab, active, max_depth=max_depth,
               draft_probs_ok=ok)
  np.testing.assert_array_equal(out.accept_len, 0)
  root_children = ((parents == 0) & (np.arange(num_nodes + 1) > 0)).sum(1)
  np.testing.assert_array_equal(out.num_malformed_q, root_children)


def poisoned_tree_inputs():
  """random_tree_inputs (seed 9, 12 rows of 8 nodes over 16 columns, vocabulary 12,
  depth <= 3), every row active, then poisoned (seed 004's faults): rows 0-5 q at the
  drawn tokens NaN, +inf, -inf, 0, -0.5, 1.5; row 6 q all -inf (a recycled buffer); row
  7 tokens out of the vocabulary; row 8 p with NaN; row 9 p without mass; rows 10-11
  greedy, row 10 with +inf in p, row 11 with every q row flagged; padding columns of p
  1.0 (never to be emitted). Returns the sampler's inputs and ``draft_probs_ok``."""
  batch, num_nodes, vocab = 12, 8, 12
  tokens, parents, q, q_row, p, greedy, u, active = random_tree_inputs(
      9, batch, num_nodes, 16, vocab, 3)
  active[:] = True
  greedy[:] = False
  greedy[10:] = True
  for b, bad in enumerate([np.nan, np.inf, -np.inf, 0.0, -0.5, 1.5]):
    for i in range(1, num_nodes + 1):
      q[b, q_row[b, i], tokens[b, i]] = bad
  q[6] = -np.inf
  tokens[7, 1:] = np.where(np.arange(num_nodes) % 2 == 0, vocab + 1, -5)
  p[8, :, ::3] = np.nan
  p[9] = 0.0
  p[:, :, vocab:] = 1.0
  p[10, :, ::2] = np.inf
  ok = np.ones((batch, num_nodes + 1), bool)
  ok[11] = False
  return (tokens, parents, q, q_row, p, greedy, u, vocab, active), ok
