"""Goodness of fit on the GPU: tokens committed by chain and tree verification follow the
target's exact (filtered) distribution, with the samplers compiled for the GPU.

* chain (rejection sampling, ``spec_sampler``): the CPU test's rows at T 0.7 / 1.0, with
  and without top-k + top-p, real and one-hot q; and the same rows with min-p;
* trees (Traversal Verification and recursive rejection, both kernels) over the trees the
  engine drafts (``build_draft_tree``), at T = 1, with top-k, top-p and min-p;
* the engine end to end (chain drafting on a 16-token pair): the joint law of two
  committed tokens, at T = 1 and with top-k + top-p.

Each statistic rejects a correct sampler with probability ALPHA = 1e-3 (seeds fixed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels.filters import sampling_probs
from eagle_jax.kernels.spec_sampler import speculative_sample
from eagle_jax.kernels.traversal_sampler import traversal_sample
from eagle_jax.kernels.tree_sampler import tree_speculative_sample
from eagle_jax.sampling import TOP_K_ALL, SamplingRows
from eagle_jax.testutil.stats import chi2_pvalue
from tests import test_draft_tree, test_engine_sampling, test_kernels_sampler
from tests.test_engine_sampling import engines, pair  # noqa: F401  (the 16-token pair, its engines)

pytestmark = pytest.mark.gpu
ALPHA = 1e-3

# Chain: the CPU test itself (T 0.7 / 1.0 x {no filter, top-k 6 + top-p 0.8} x q).
test_chain_two_tokens_follow_the_target = (
    test_kernels_sampler.test_first_token_and_second_token_follow_target)


@pytest.mark.parametrize("min_p", [0.1, 0.3])
def test_chain_two_tokens_follow_the_target_with_min_p(min_p):
  rows = 2500
  groups, d, q, logits, t, k, tp, _, u = test_kernels_sampler._group_inputs(11, rows)
  mp = np.full(len(t), min_p, np.float32)
  out = speculative_sample(d, q, logits, SamplingRows(t, k, tp, mp), u, 12)
  tokens, accept_len = np.asarray(out.tokens), np.asarray(out.accept_len)
  assert int(np.sum(out.num_malformed_q)) == 0 and int(np.sum(out.num_fallback)) == 0
  for g, group in enumerate(groups):
    sl = slice(g * rows, (g + 1) * rows)
    p = np.asarray(sampling_probs(logits[sl.start], SamplingRows(
        np.full(3, t[sl.start]), np.full(3, k[sl.start]), np.full(3, tp[sl.start]),
        np.full(3, min_p, np.float32))))
    assert chi2_pvalue(np.bincount(tokens[sl, 0], minlength=12), p[0]) > ALPHA, group
    accepted = accept_len[sl] >= 1
    if accepted.sum() > 200:
      second = np.bincount(tokens[sl][accepted, 1], minlength=12)
      assert chi2_pvalue(second, p[1]) > ALPHA, (group, "position 1")


# Trees: test_draft_tree's step (the engine's build_draft_tree, then the sampler), with
# both kernels; its recursive-rejection entry is the reference, the kernel is added here.
TREE_SAMPLERS = {
    "traversal": test_draft_tree.SAMPLERS["traversal"],
    "recursive_rejection_kernel": tree_speculative_sample,
}


@pytest.mark.parametrize("verify", sorted(TREE_SAMPLERS))
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, TOP_K_ALL, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.0, TOP_K_ALL, 0.8, 0.0),
    (1.0, TOP_K_ALL, 1.0, 0.2)])
def test_tree_two_tokens_follow_the_target(monkeypatch, verify, temperature, top_k, top_p,
                                           min_p):
  monkeypatch.setitem(test_draft_tree.SAMPLERS, verify, TREE_SAMPLERS[verify])
  V, n, root = test_draft_tree.V, test_draft_tree.N_STAT, test_draft_tree.ROOT
  log_p, log_q = test_draft_tree._chains(7)
  rows = SamplingRows(*(jnp.full((n,), x, dt) for x, dt in (
      (temperature, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32),
      (min_p, jnp.float32))))
  key1, key2 = jax.random.split(jax.random.key(0))
  step = functools.partial(test_draft_tree._verify_step, log_p=log_p, log_q=log_q, rows=rows,
                           rerank=False, verify=verify)
  tok1, acc1 = step(jax.random.key_data(key1), jnp.full((n,), root, jnp.int32))
  first = tok1[:, 0]
  tok2, _ = step(jax.random.key_data(key2), first)
  second = jnp.where(acc1 >= 1, tok1[:, 1], tok2[:, 0])
  counts = np.zeros((V, V), np.int64)
  np.add.at(counts, (np.asarray(first), np.asarray(second)), 1)
  p = np.asarray(sampling_probs(jnp.asarray(log_p, jnp.float32), SamplingRows(
      *(np.full(V, x, dt) for x, dt in ((temperature, np.float32), (top_k, np.int32),
                                         (top_p, np.float32), (min_p, np.float32))))),
      np.float64)
  assert chi2_pvalue(counts, p[root][:, None] * p) > ALPHA
  assert np.mean(np.asarray(acc1) >= 2) > 0.1  # paths reach the levels the ranking cut


# The engine end to end, at a fixed draft length and up to 4 prompt chunks per forward
# (the GPU's defaults, adaptive lengths and 16 chunks, compile many more executables).
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 6, 0.9)])
def test_engine_two_tokens_follow_the_target(  # noqa: F811
    pair, engines, monkeypatch, temperature, top_k, top_p):
  monkeypatch.setitem(test_engine_sampling.ENGINE, "speculative_policy", "fixed")
  monkeypatch.setitem(test_engine_sampling.ENGINE, "max_num_partial_prefills", 4)
  s, counts, expected = test_engine_sampling._sample(
      pair, engines, "probabilistic", temperature, top_k, top_p)
  pvalue, stat, dof = test_engine_sampling.chi_square_pvalue(counts.ravel(), expected.ravel())
  assert pvalue > ALPHA, (stat, dof, pvalue)
  assert 0 < s.num_accepted_tokens < s.num_draft_tokens
  assert s.num_malformed_draft_probs == 0 and s.num_sampler_fallbacks == 0
  assert counts[expected == 0].sum() == 0
