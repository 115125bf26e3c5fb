"""Tree verify sampler (recursive rejection sampling): structure, greedy chain,
statistics against the exact target distribution, acceptance rate, guards, export."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import tree_sampler
from eagle_jax.kernels._common import TRITON_CUSTOM_CALL, compiled_kernels
from eagle_jax.kernels.tree_common import PAD_TOKEN, TreeSamplerOutput
from eagle_jax.kernels.tree_sampler import (
    tree_speculative_sample, tree_speculative_sample_reference)
from eagle_jax.testutil.stats import chi2_pvalue
from eagle_jax.testutil.trees import (
    check_flagged_rows, check_poisoned_rows, check_tree_output, random_tree_inputs)

# Chi-square / z tests: false-alarm rate alpha = 1e-3 per statistic (p-value from the
# regularised upper incomplete gamma function, scipy is not installed).
ALPHA = 1e-3
Z_CRIT = 3.29  # two-sided normal quantile for alpha = 1e-3


# --------------------------------------------------------------------------------------
# Random trees (structure / guard tests).
# --------------------------------------------------------------------------------------


def _check_against_reference(out, ref):
  for name in ("accept_len", "num_tokens", "num_malformed_q", "num_fallback", "path"):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  tokens, ref_tokens = np.asarray(out.tokens), np.asarray(ref.tokens)
  # Accepted prefixes and PAD are exact; the final draw may differ only where the
  # kernel's blockwise float sums move a CDF boundary (probability ~1e-6 per draw).
  assert np.mean(tokens == ref_tokens) >= 0.98
  np.testing.assert_array_equal(tokens == PAD_TOKEN, ref_tokens == PAD_TOKEN)


@pytest.mark.parametrize("seed,batch,num_nodes,num_cols,vocab,max_depth,target_only,block", [
    (0, 8, 8, 16, 16, 3, False, None),
    (1, 8, 6, 16, 13, 2, False, 4),
    (2, 6, 8, 8, 8, 8, True, 2),
    (3, 6, 7, 40, 37, 3, False, 8),
])
def test_random_trees_kernel_matches_reference(
    seed, batch, num_nodes, num_cols, vocab, max_depth, target_only, block):
  """The public function (the Pallas kernel, interpreted on a CPU) against the
  reference: random parents, absent nodes, duplicate siblings, random q / p, greedy and
  sampling rows mixed, inactive rows, padding columns, several vocabulary blocks."""
  tokens, parents, q, q_row, p, greedy, u, active = random_tree_inputs(
      seed, batch, num_nodes, num_cols, vocab, max_depth)
  args = (tokens, parents, q, q_row, p, greedy, u, vocab, active)
  out = tree_speculative_sample(*args, max_depth=max_depth, target_only=target_only,
                                block_v=block)
  ref = tree_speculative_sample_reference(*args, max_depth=max_depth, target_only=target_only)
  _check_against_reference(out, ref)
  check_tree_output(out, tokens, parents, vocab, active, max_depth)
  # Duplicate siblings (q'(x) = 0) are the only malformed candidates here.
  assert np.all(np.asarray(out.num_malformed_q)[greedy] == 0)
  assert np.all(np.asarray(out.num_fallback) == 0)


def test_greedy_rows_follow_argmax_chain():
  batch, num_nodes, vocab, max_depth = 12, 8, 16, 3
  tokens, parents, q, q_row, p, _, u, active = random_tree_inputs(
      7, batch, num_nodes, vocab, vocab, max_depth)
  greedy = np.ones(batch, bool)
  out = tree_speculative_sample(tokens, parents, q, q_row, p, greedy, u, vocab, active,
                                max_depth=max_depth)
  for b in range(batch):
    if not active[b]:
      continue
    c, expected, path = 0, [], [0]
    for _ in range(max_depth + 1):
      am = int(np.argmax(p[b, c, :vocab]))
      kids = [i for i in range(1, num_nodes + 1)
              if parents[b, i] == c and tokens[b, i] == am and len(path) <= max_depth]
      expected.append(am)
      if not kids:
        break
      c = kids[0]
      path.append(c)
    expected += [PAD_TOKEN] * (max_depth + 1 - len(expected))
    path += [PAD_TOKEN] * (max_depth + 1 - len(path))
    np.testing.assert_array_equal(out.tokens[b], expected)
    np.testing.assert_array_equal(out.path[b], path)


def _depths(parents):
  """Each node's depth below the root through present parents; -1 where the chain breaks
  (an absent node or one below it)."""
  depth = np.full(parents.shape, -1)
  depth[:, 0] = 0
  for b in range(parents.shape[0]):
    for i in range(1, parents.shape[1]):
      j = parents[b, i]
      if 0 <= j < i and depth[b, j] >= 0:
        depth[b, i] = depth[b, j] + 1
  return depth


@pytest.mark.parametrize("target_only", [False, True])
def test_node_outcomes_and_walk_match_reference(monkeypatch, target_only):
  """The kernel decides every node's outcome in a program of its own, then the walk
  follows them from the root. Trees deeper than max_depth (the walk must stop there),
  absent nodes, greedy, sampling and inactive rows, q rows flagged malformed on and off
  the accepted path, a row whose p has no mass: every output equals the reference's
  exactly (the final draws included: none of these lands where the kernel's blockwise
  sums could move a CDF boundary). The kernel writes every node's outcome, whatever the
  output buffer held (Pallas' interpreter starts int32 outputs at int32 min): in range
  where the walk can arrive, (-1, PAD, 0, 0) where it cannot."""
  batch, num_nodes, num_cols, vocab, max_depth, block = 10, 12, 16, 14, 2, 4
  tokens, parents, q, q_row, p, greedy, u, active = random_tree_inputs(
      21, batch, num_nodes, num_cols, vocab, max_depth + 2)
  greedy[:] = False
  greedy[[0, 5]] = True
  active[:] = True
  active[[1, 7]] = False
  u[:, 1:-1] *= 0.3  # children's coins: accept often, so paths run several nodes deep
  ok = np.random.default_rng(21).uniform(size=q.shape[:2]) > 0.25
  p[3] = 0.0  # no mass at any node: the fallback counts, the token is uniform
  outcomes = []

  def walk_spy(outcome, *args):
    outcomes.append(np.asarray(outcome))
    return walk(outcome, *args)

  walk = tree_sampler._walk
  monkeypatch.setattr(tree_sampler, "_walk", walk_spy)
  args = (tokens, parents, q, q_row, p, greedy, u, vocab, active)
  kwargs = dict(max_depth=max_depth, draft_probs_ok=ok, target_only=target_only)
  out = tree_speculative_sample(*args, block_v=block, **kwargs)
  ref = tree_speculative_sample_reference(*args, **kwargs)
  for name in TreeSamplerOutput._fields:
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  check_tree_output(out, tokens, parents, vocab, active, max_depth)

  depth = _depths(parents)
  acc = np.asarray(out.accept_len)
  assert np.any((acc == max_depth) & (depth.max(1) > max_depth))  # max_depth cut a path
  assert out.num_fallback[3] == 1

  [outcome] = outcomes
  assert outcome.shape == (batch, num_nodes + 1, 4)
  child, token, malformed, fallback = np.moveaxis(outcome, -1, 0)
  nodes = np.arange(num_nodes + 1)
  reachable = active[:, None] & (depth >= 0) & (depth <= max_depth)
  unreachable = ~reachable
  np.testing.assert_array_equal(child[unreachable], -1)
  np.testing.assert_array_equal(token[unreachable], PAD_TOKEN)
  np.testing.assert_array_equal(malformed[unreachable], 0)
  np.testing.assert_array_equal(fallback[unreachable], 0)
  moves = reachable & (child >= 0)
  assert not np.any(moves & (depth == max_depth))
  b_idx, c_idx = np.nonzero(moves)
  np.testing.assert_array_equal(parents[b_idx, child[moves]], c_idx)
  np.testing.assert_array_equal(token[moves], tokens[b_idx, child[moves]])
  stops = reachable & (child < 0)
  assert np.all((token[stops] >= 0) & (token[stops] < vocab))
  assert np.all((malformed >= 0) & (malformed <= num_nodes))
  assert np.all((fallback == 0) | (fallback == 1))
  assert np.all(malformed[greedy] == 0) and np.all(fallback[greedy] == 0)
  assert np.any(moves[:, nodes > 0])  # outcomes below the root decide some paths
  if not target_only:
    # A node counted malformed candidates off the accepted path: they are not counted.
    path = np.asarray(out.path)
    on_path = np.zeros_like(reachable)
    for b in range(batch):
      on_path[b, path[b][path[b] >= 0]] = True
    assert np.any((malformed > 0) & ~on_path)


# --------------------------------------------------------------------------------------
# Statistics: the first two committed tokens against the exact target distribution.
# --------------------------------------------------------------------------------------

V = 6
K = 2  # children per expanded node


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _top_k_filter(probs, k):
  kth = np.sort(probs, -1)[..., -k][..., None]
  out = np.where(probs >= kth, probs, 0.0)
  return out / out.sum(-1, keepdims=True)


def _problem(seed, top_k=None):
  """Target p0 (root) and p1[a] (after first token a); draft q0 and q1[a]."""
  rng = np.random.default_rng(seed)
  p0 = _softmax(rng.standard_normal(V) * 1.2)
  p1 = _softmax(rng.standard_normal((V, V)) * 1.2)
  if top_k is not None:
    p0, p1 = _top_k_filter(p0, top_k), _top_k_filter(p1, top_k)
  q0 = _softmax(rng.standard_normal(V) * 1.2)
  q1 = _softmax(rng.standard_normal((V, V)) * 1.2)
  return p0, p1, q0, q1


def _draw_without_replacement(rng, q, k):
  """Gumbel-top-k: the k largest of log q + Gumbel, in decreasing order, are k sequential
  draws without replacement from q. q [n, V] -> [n, k]."""
  keys = np.log(q) + rng.gumbel(size=q.shape)
  return np.argsort(-keys, axis=-1)[:, :k]


def _build_trees(rng, root_p, root_q, p1, q1, deterministic):
  """Per row: root -> K children (from root_q) -> K children each (from q1[child]).

  Nodes: 0 root, 1..K depth 1, then K per depth-1 node. Returns the kernel inputs for
  max_depth 2. ``deterministic``: the top-K of q instead of draws."""
  n = root_p.shape[0]
  n1 = 1 + K + K * K

  def pick(q):
    if deterministic:
      return np.argsort(-q, axis=-1, kind="stable")[:, :K]
    return _draw_without_replacement(rng, q, K)

  first = pick(root_q)  # [n, K]
  tokens = np.zeros((n, n1), np.int32)
  parents = np.full((n, n1), -1, np.int32)
  q_row = np.zeros((n, n1), np.int32)
  q = np.zeros((n, 1 + K, V), np.float32)
  p = np.full((n, n1, V), 1.0 / V, np.float32)
  q[:, 0] = root_q
  p[:, 0] = root_p
  for j in range(K):
    node = 1 + j
    tokens[:, node], parents[:, node], q_row[:, node] = first[:, j], 0, 0
    q[:, 1 + j] = q1[first[:, j]]
    p[:, node] = p1[first[:, j]]
    second = pick(q1[first[:, j]])
    for m in range(K):
      leaf = 1 + K + j * K + m
      tokens[:, leaf], parents[:, leaf], q_row[:, leaf] = second[:, m], node, 1 + j
  u = rng.uniform(size=(n, n1 + 1)).astype(np.float32)
  return tokens, parents, q, q_row, p, u


def _two_token_counts(seed, p0, p1, q0, q1, n, *, target_only=False, deterministic=False,
                      **ref_kwargs):
  rng = np.random.default_rng(seed)
  sample = jax.jit(functools.partial(
      tree_speculative_sample_reference, vocab_size=V, max_depth=2, target_only=target_only,
      **ref_kwargs))
  greedy = np.zeros(n, bool)

  def step(root_p, root_q):
    tokens, parents, q, q_row, p, u = _build_trees(rng, root_p, root_q, p1, q1, deterministic)
    out = sample(tokens, parents, None if target_only else q, q_row, p, greedy, u)
    return np.asarray(out.tokens), np.asarray(out.accept_len)

  tok1, acc1 = step(np.tile(p0, (n, 1)), np.tile(q0, (n, 1)))
  first = tok1[:, 0]
  # Rows that committed one token take their second from the next verify step, rooted
  # at that token.
  tok2, _ = step(p1[first], q1[first])
  second = np.where(acc1 >= 1, tok1[:, 1], tok2[:, 0])
  assert np.all((first >= 0) & (first < V) & (second >= 0) & (second < V))
  counts = np.zeros((V, V), np.int64)
  np.add.at(counts, (first, second), 1)
  return counts, acc1


N_STAT = 40000


@pytest.mark.parametrize("top_k", [None, 3])
def test_first_two_tokens_follow_target(top_k):
  p0, p1, q0, q1 = _problem(11, top_k)
  counts, acc = _two_token_counts(3, p0, p1, q0, q1, N_STAT)
  assert chi2_pvalue(counts, p0[:, None] * p1) > ALPHA
  assert np.mean(acc >= 1) > 0.3  # the tree is exercised beyond the root


def test_target_only_exact_for_deterministic_candidates():
  p0, p1, q0, q1 = _problem(12, 4)
  counts, acc = _two_token_counts(4, p0, p1, q0, q1, N_STAT, target_only=True,
                                  deterministic=True)
  assert chi2_pvalue(counts, p0[:, None] * p1) > ALPHA
  assert np.mean(acc >= 1) > 0.1


def test_target_only_exact_but_accepts_less_for_stochastic_candidates():
  """The target-only rule is exact given any candidates (it conditions on them), but
  ignores q: on the same problem RRS with the draft's q accepts more often."""
  p0, p1, q0, q1 = _problem(11)
  counts, acc_t = _two_token_counts(3, p0, p1, q0, q1, N_STAT, target_only=True)
  assert chi2_pvalue(counts, p0[:, None] * p1) > ALPHA
  _, acc_r = _two_token_counts(3, p0, p1, q0, q1, N_STAT)
  assert np.mean(acc_r) > np.mean(acc_t) + 0.02


@pytest.mark.parametrize("target_only", [False, True])
def test_kernel_matches_reference_on_rrs_trees(target_only):
  """Trees of distinct siblings drawn without replacement (every rejection subtracts
  q'), V = 6 in blocks of 2: kernel and reference agree."""
  rng = np.random.default_rng(8)
  p0, p1, q0, q1 = _problem(14)
  n = 48
  tokens, parents, q, q_row, p, u = _build_trees(
      rng, np.tile(p0, (n, 1)), np.tile(q0, (n, 1)), p1, q1, deterministic=target_only)
  greedy = rng.uniform(size=n) < 0.25
  active = rng.uniform(size=n) < 0.9
  args = (tokens, parents, q, q_row, p, greedy, u, V, active)
  out = tree_speculative_sample(*args, max_depth=2, target_only=target_only, block_v=2)
  ref = tree_speculative_sample_reference(*args, max_depth=2, target_only=target_only)
  _check_against_reference(out, ref)
  assert np.any(np.asarray(out.accept_len) == 2) and np.any(np.asarray(out.accept_len) == 0)


def test_with_replacement_q_is_detected_as_biased():
  """Accepting with q instead of q' (ignoring that siblings were drawn without
  replacement) must fail the same goodness-of-fit test."""
  p0, p1, q0, q1 = _problem(11)
  counts, _ = _two_token_counts(3, p0, p1, q0, q1, N_STAT, _without_replacement=False)
  assert chi2_pvalue(counts, p0[:, None] * p1) < ALPHA


def test_first_step_acceptance_matches_analytic():
  """K = 2 root children without replacement: P(accept some child) =
  sum min(q, p) + sum_{x1} (q(x1) - min(q, p)(x1)) * sum_x min(q'_{x1}(x), r1(x)),
  r1 = max(p - q, 0) / sum max(p - q, 0), q'_{x1} = q without x1, renormalised."""
  p0, p1, q0, q1 = _problem(13)
  first = np.minimum(q0, p0).sum()
  r1 = np.maximum(p0 - q0, 0.0)
  r1 /= r1.sum()
  second = 0.0
  for x1 in range(V):
    qp = q0.copy()
    qp[x1] = 0.0
    qp /= qp.sum()
    second += (q0[x1] - min(q0[x1], p0[x1])) * np.minimum(qp, r1).sum()
  expected = first + second
  _, acc = _two_token_counts(5, p0, p1, q0, q1, N_STAT)
  rate = np.mean(acc >= 1)
  z = (rate - expected) / np.sqrt(expected * (1 - expected) / N_STAT)
  assert abs(z) < Z_CRIT, (rate, expected)
  assert second > 0.02  # the second sibling matters in this problem


# --------------------------------------------------------------------------------------
# Guards (seed 004).
# --------------------------------------------------------------------------------------


def test_fault_injection_never_emits_invalid_ids():
  check_poisoned_rows(tree_speculative_sample)


def test_malformed_row_rejected_and_counted():
  check_flagged_rows(tree_speculative_sample)


# --------------------------------------------------------------------------------------
# Export.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target_only", [False, True])
@pytest.mark.parametrize("platform,target", [("cuda", "sm_90"), ("rocm", "gfx942")])
def test_exports_triton_kernel(platform, target, target_only):
  """The kernel lowers through the Triton path for CUDA and ROCm on a CPU machine (as in
  tests/test_kernels_export.py: the Triton custom call allowed explicitly)."""
  s = jax.ShapeDtypeStruct
  i32, f32 = jnp.int32, jnp.float32
  b, n1, e, v = 4, 7, 3, 1024

  def fn(tok, par, q, qr, p, g, u, a):
    return tree_speculative_sample(tok, par, q, qr, p, g, u, 1000, a, max_depth=3,
                                   target_only=target_only, interpret=False)

  args = [s((b, n1), i32), s((b, n1), i32), s((b, e, v), f32), s((b, n1), i32),
          s((b, n1, v), f32), s((b,), jnp.bool_), s((b, n1 + 1), f32), s((b,), jnp.bool_)]
  with compiled_kernels(target=target):
    exported = jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(*args)
  assert exported.mlir_module().count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}") == 1
