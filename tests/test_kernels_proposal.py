"""Draft proposal kernel: greedy by top_k (seed 001), goodness of fit, d2t mapping."""

import numpy as np

from eagle_jax.kernels.draft_proposal import (
    probs_row_ok, propose_draft_tokens, propose_draft_tokens_reference, propose_from_probs,
    propose_from_probs_reference)
from eagle_jax.kernels.filters import sampling_probs
from eagle_jax.sampling import TOP_K_ALL, SamplingRows
from eagle_jax.testutil.stats import chi2_pvalue

ALPHA = 1e-3  # false-alarm rate per chi-square statistic


def test_greedy_rows_propose_argmax_at_temperature_one():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((6, 1000)).astype(np.float32) * 0.3  # flat: sampling would wander
  logits[:, 17] = logits[:, 600] = 2.0  # tie: first index
  t = np.ones(6, np.float32)
  k = np.array([1, 1, 1, TOP_K_ALL, TOP_K_ALL, 1], np.int32)
  u = rng.uniform(size=6).astype(np.float32)
  tokens, q, ok = propose_draft_tokens(logits, SamplingRows(t, k, t, 0 * t), u, block_v=128)
  tokens, q = np.asarray(tokens), np.asarray(q)
  assert np.asarray(ok).all()
  assert np.all(tokens[k == 1] == 17)
  assert np.all(q[k == 1, 17] == 1.0) and np.all(q[k == 1].sum(-1) == 1.0)
  assert np.all(q[np.arange(6), tokens] > 0)


def test_matches_reference_with_d2t():
  rng = np.random.default_rng(1)
  batch, draft_vocab, target_vocab = 5, 1000, 1531
  logits = rng.standard_normal((batch, draft_vocab)).astype(np.float32) * 2
  d2t = (np.sort(rng.choice(target_vocab, draft_vocab, replace=False)) - np.arange(draft_vocab)).astype(np.int32)
  t = rng.choice([0.7, 1.0], batch).astype(np.float32)
  k = np.array([1, TOP_K_ALL, 20, TOP_K_ALL, 1], np.int32)
  tp = np.array([1.0, 0.9, 1.0, 1.0, 1.0], np.float32)
  u = rng.uniform(size=batch).astype(np.float32)
  rows = SamplingRows(t, k, tp, 0 * t)
  for d2t_arg, width in ((d2t, target_vocab), (None, None)):
    tok, q, ok = propose_draft_tokens(logits, rows, u, d2t=d2t_arg, target_vocab_size=width,
                                      vocab_size=990, block_v=256)
    rtok, rq, rok = propose_draft_tokens_reference(logits, rows, u, d2t=d2t_arg,
                                                   target_vocab_size=width, vocab_size=990)
    np.testing.assert_array_equal(tok, rtok)
    np.testing.assert_array_equal(q, rq)  # every element written (zeros included)
    np.testing.assert_array_equal(ok, rok)
    assert np.all(np.asarray(q)[np.arange(batch), np.asarray(tok)] > 0)
  draft_ids = np.asarray(propose_draft_tokens(logits, rows, u).tokens)
  mapped = np.asarray(propose_draft_tokens(logits, rows, u, d2t=d2t,
                                           target_vocab_size=target_vocab).tokens)
  np.testing.assert_array_equal(mapped, draft_ids + d2t[draft_ids])


def test_sampled_rows_follow_q():
  rng = np.random.default_rng(2)
  rows = 6000
  base = rng.standard_normal(12).astype(np.float32)
  logits = np.broadcast_to(base, (rows, 12)).copy()
  t = np.full(rows, 0.8, np.float32)
  k = np.where(np.arange(rows) < rows // 2, TOP_K_ALL, 5).astype(np.int32)
  tp = np.ones(rows, np.float32)
  u = rng.uniform(size=rows).astype(np.float32)
  tokens = np.asarray(propose_draft_tokens(logits, SamplingRows(t, k, tp, 0 * t), u).tokens)
  for sl in (slice(0, rows // 2), slice(rows // 2, rows)):
    q = np.asarray(sampling_probs(base, SamplingRows(0.8, k[sl.start], 1.0, 0.0)))
    assert chi2_pvalue(np.bincount(tokens[sl], minlength=12), q) > ALPHA


def test_row_check_flags_malformed_rows():
  """004: the proposal checks the row it draws from; a flagged row keeps a valid draw."""
  rng = np.random.default_rng(3)
  batch, vocab = 8, 700
  q = rng.dirichlet(np.full(vocab, 0.5), size=batch).astype(np.float32)
  q[0, 5] = np.nan
  q[1, 6] = np.inf
  q[2, 7] = -np.inf
  q[3, 8] = -0.25
  q[4, 9] = 1.5
  q[5] *= 0.9  # entries fine, the sum is 0.9
  q[6] *= 1.0 + 1e-5  # float drift within the tolerance
  greedy = np.array([False, True] * 4)
  u = rng.uniform(size=batch).astype(np.float32)
  out = propose_from_probs(q, greedy, u, block_v=128)
  ref = propose_from_probs_reference(q, greedy, u)
  expect = [False, False, False, False, False, False, True, True]
  np.testing.assert_array_equal(out.probs_ok, expect)
  np.testing.assert_array_equal(ref.probs_ok, expect)
  np.testing.assert_array_equal(probs_row_ok(q), expect)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.probs, ref.probs)
  tok = np.asarray(out.tokens)
  assert np.all((q[np.arange(batch), tok] > 0) & (q[np.arange(batch), tok] <= 1))
