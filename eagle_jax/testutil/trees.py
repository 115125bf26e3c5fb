"""Random draft trees for the tree samplers' tests (``tree_sampler``, ``traversal_sampler``)
and the structural check of their output."""

from __future__ import annotations

import numpy as np

from eagle_jax.kernels.tree_sampler import PAD_TOKEN


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
