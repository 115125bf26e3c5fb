"""Speculative verify sampler: kernel vs reference, greedy path, statistics, guards."""

import jax
import numpy as np
import pytest

from eagle_jax.kernels.draft_proposal import propose_from_probs
from eagle_jax.kernels.filters import sampling_probs
from eagle_jax.kernels.spec_sampler import PAD_TOKEN, speculative_sample, speculative_sample_reference
from eagle_jax.sampling import TOP_K_ALL, SamplingRows
from eagle_jax.testutil.stats import chi2_pvalue

# Chi-square test: false-alarm rate alpha = 1e-3 per statistic (p-value from the
# regularised upper incomplete gamma function, scipy is not installed).
ALPHA = 1e-3


def _inputs(seed, batch, num_draft, num_cols, vocab):
  rng = np.random.default_rng(seed)
  logits = (rng.standard_normal((batch, num_draft + 1, num_cols)) * 2).astype(np.float32)
  q = rng.dirichlet(np.full(num_cols, 0.2), size=(batch, num_draft)).astype(np.float32)
  d = np.stack([[rng.choice(num_cols, p=q[b, i] / q[b, i].sum()) for i in range(num_draft)]
                for b in range(batch)]).astype(np.int32)
  # Some drafts equal the target argmax so that greedy rows accept sometimes.
  am = np.argmax(logits[:, :num_draft, :vocab], -1)
  d = np.where(rng.uniform(size=d.shape) < 0.5, am, d).astype(np.int32)
  q[np.arange(batch)[:, None], np.arange(num_draft)[None], d] += 0.05  # q(d) > 0
  q /= q.sum(-1, keepdims=True)
  temperature = rng.choice([0.7, 1.0, 1.3], batch).astype(np.float32)
  top_k = rng.choice([1, 5, TOP_K_ALL], batch).astype(np.int32)
  top_p = rng.choice([1.0, 0.9], batch).astype(np.float32)
  min_p = rng.choice([0.0, 0.05], batch).astype(np.float32)
  u = rng.uniform(size=(batch, num_draft + 1)).astype(np.float32)
  active = rng.uniform(size=batch) < 0.8
  active[0] = True
  return d, q, logits, temperature, top_k, top_p, min_p, u, active


def _check_against_reference(out, ref):
  np.testing.assert_array_equal(out.accept_len, ref.accept_len)
  np.testing.assert_array_equal(out.num_tokens, ref.num_tokens)
  np.testing.assert_array_equal(out.num_malformed_q, ref.num_malformed_q)
  np.testing.assert_array_equal(out.num_fallback, ref.num_fallback)
  tokens, ref_tokens = np.asarray(out.tokens), np.asarray(ref.tokens)
  # Accepted prefixes and PAD are exact; the final draw may differ only where float
  # summation order moves a CDF boundary (probability ~1e-5 per draw).
  assert np.mean(tokens == ref_tokens) >= 0.98
  np.testing.assert_array_equal(tokens == PAD_TOKEN, ref_tokens == PAD_TOKEN)


@pytest.mark.parametrize("batch,num_draft,num_cols,vocab,with_q,blocks", [
    (1, 1, 1000, 1000, True, (128, 256)),
    (5, 3, 1531, 1500, True, (128, 512)),
    (6, 4, 1024, 1000, False, (256, 256)),
    (4, 2, 1000, 990, True, (None, None)),
])
def test_matches_reference(batch, num_draft, num_cols, vocab, with_q, blocks):
  d, q, logits, t, k, tp, mp, u, active = _inputs(batch * 100 + num_cols, batch, num_draft, num_cols, vocab)
  q = q if with_q else None
  out = speculative_sample(d, q, logits, SamplingRows(t, k, tp, mp), u, vocab, active,
                           block_v=blocks[0], chunk_v=blocks[1])
  ref = speculative_sample_reference(d, q, logits, SamplingRows(t, k, tp, mp), u, vocab, active)
  _check_against_reference(out, ref)
  assert np.all(np.asarray(out.tokens)[~active] == PAD_TOKEN)
  assert np.all(np.asarray(out.num_tokens)[~active] == 0)


def test_greedy_rows_follow_argmax_path():
  batch, num_draft, num_cols, vocab = 8, 4, 1000, 990
  d, q, logits, t, _, tp, mp, u, _ = _inputs(7, batch, num_draft, num_cols, vocab)
  # Ties on the maximum: the first index wins.
  logits[:, :, 3] = logits[:, :, 700] = logits.max() + 1.0
  d[:4, 0] = 3
  d[4:, 0] = 700
  k = np.ones(batch, np.int32)
  t = np.ones(batch, np.float32)  # greedy is detected by top_k, not temperature (001)
  out = speculative_sample(d, q, logits, SamplingRows(t, k, tp, mp), u, vocab, block_v=128,
                           chunk_v=256)
  am = np.argmax(logits[..., :vocab], -1)
  for b in range(batch):
    n = 0
    while n < num_draft and d[b, n] == am[b, n]:
      n += 1
    expect = list(d[b, :n]) + [am[b, n]] + [PAD_TOKEN] * (num_draft - n)
    assert int(out.accept_len[b]) == n
    assert list(np.asarray(out.tokens[b])) == expect


def _group_inputs(seed, rows_per_group, num_cols=12, num_draft=2):
  """Rows in 8 groups: T in {0.7, 1.0} x filters {none, top-k/top-p} x q {one-hot, real}."""
  rng = np.random.default_rng(seed)
  groups = [(t, f, qr) for t in (0.7, 1.0) for f in (False, True) for qr in (False, True)]
  n = rows_per_group * len(groups)
  base = rng.standard_normal((num_draft + 1, num_cols)).astype(np.float32)
  draft_logits = rng.standard_normal((num_draft, num_cols)).astype(np.float32)
  q_real = np.asarray(jax.nn.softmax(draft_logits, -1))
  q_onehot_src = np.asarray(jax.nn.softmax(draft_logits * 3, -1))  # the draft's choice
  logits = np.broadcast_to(base, (n, num_draft + 1, num_cols)).copy()
  temperature = np.repeat([g[0] for g in groups], rows_per_group).astype(np.float32)
  top_k = np.repeat([6 if g[1] else TOP_K_ALL for g in groups], rows_per_group).astype(np.int32)
  top_p = np.repeat([0.8 if g[1] else 1.0 for g in groups], rows_per_group).astype(np.float32)
  min_p = np.zeros(n, np.float32)
  real = np.repeat([g[2] for g in groups], rows_per_group)
  # d ~ q (real rows: q_real; one-hot rows: a draw from another distribution, q = delta).
  cdf_r, cdf_o = np.cumsum(q_real, -1), np.cumsum(q_onehot_src, -1)
  coins = rng.uniform(size=(n, num_draft))
  d = np.where(real[:, None],
               np.stack([np.searchsorted(cdf_r[i], coins[:, i] * cdf_r[i, -1], side="right")
                         for i in range(num_draft)], 1),
               np.stack([np.searchsorted(cdf_o[i], coins[:, i] * cdf_o[i, -1], side="right")
                         for i in range(num_draft)], 1)).astype(np.int32)
  d = np.minimum(d, num_cols - 1)
  q = np.broadcast_to(q_real, (n, num_draft, num_cols)).copy()
  q = np.where(real[:, None, None], q, np.eye(num_cols, dtype=np.float32)[d])
  u = rng.uniform(size=(n, num_draft + 1)).astype(np.float32)
  return groups, d, q, logits, temperature, top_k, top_p, min_p, u


def test_first_token_and_second_token_follow_target():
  rows = 2500
  groups, d, q, logits, t, k, tp, mp, u = _group_inputs(11, rows)
  out = speculative_sample(d, q, logits, SamplingRows(t, k, tp, mp), u, 12)
  tokens, accept_len = np.asarray(out.tokens), np.asarray(out.accept_len)
  assert tokens.min() >= 0 and tokens.max() < 12 or np.all(tokens[tokens < 0] == PAD_TOKEN)
  for g, (temp, filt, real) in enumerate(groups):
    sl = slice(g * rows, (g + 1) * rows)
    p = np.asarray(sampling_probs(logits[sl.start], SamplingRows(
        np.full(3, temp, np.float32), np.full(3, k[sl.start]), np.full(3, tp[sl.start]),
        np.zeros(3, np.float32))))
    first = np.bincount(tokens[sl, 0], minlength=12)
    assert chi2_pvalue(first, p[0]) > ALPHA, (temp, filt, real)
    accepted = accept_len[sl] >= 1
    second = np.bincount(tokens[sl][accepted, 1], minlength=12)
    if accepted.sum() > 200:
      assert chi2_pvalue(second, p[1]) > ALPHA, (temp, filt, real, "position 1")


def test_fault_injection_never_emits_invalid_ids():
  batch, num_draft, num_cols, vocab = 16, 3, 1024, 1000
  rng = np.random.default_rng(5)
  p = rng.dirichlet(np.full(num_cols, 0.3), size=(batch, num_draft + 1)).astype(np.float32)
  q = rng.dirichlet(np.full(num_cols, 0.3), size=(batch, num_draft)).astype(np.float32)
  d = rng.integers(0, vocab, size=(batch, num_draft)).astype(np.int32)
  rows = np.arange(batch)
  # q poisoned at the draft token (rows 0-5: NaN, +inf, -inf, 0, -0.5, 1.5).
  for r, v in enumerate([np.nan, np.inf, -np.inf, 0.0, -0.5, 1.5]):
    q[r, 0, d[r, 0]] = v
  q[6, 0, ::3] = -np.inf  # a -inf-filled row (seed 004), entry d valid
  q[6, 0, d[6, 0]] = 0.5
  p[7:10, :, ::4] = np.inf  # p poisoned (target_is_probs)
  p[8, :, :] = np.nan
  p[9, :, :] = -1.0
  d[10, 0] = vocab + 5  # out of range (padding column)
  d[11, 0] = -3
  d[12, 0] = num_cols + 100
  p[:, :, vocab:] = 1.0  # mass on padding columns must never be emitted
  u = rng.uniform(size=(batch, num_draft + 1)).astype(np.float32)
  ones = np.ones(batch, np.float32)
  k = np.full(batch, TOP_K_ALL, np.int32)
  kw = dict(target_is_probs=True, block_v=128, chunk_v=256)
  rows = SamplingRows(ones, k, ones, 0 * ones)
  out = speculative_sample(d, q, p, rows, u, vocab, **kw)
  ref = speculative_sample_reference(d, q, p, rows, u, vocab, target_is_probs=True)
  tokens = np.asarray(out.tokens)
  assert np.all(((tokens >= 0) & (tokens < vocab)) | (tokens == PAD_TOKEN))
  assert np.all(np.asarray(out.num_tokens) >= 1)
  for r in list(range(6)) + [10, 11, 12]:
    assert int(out.accept_len[r]) == 0, r  # malformed q / bad draft: rejected
  assert np.all(np.asarray(out.num_malformed_q)[:7] >= 1)
  _check_against_reference(out, ref)
  # Even if every coin says "accept", a malformed q entry is rejected.
  out0 = speculative_sample(d, q, p, rows, np.zeros_like(u), vocab, **kw)
  assert np.all(np.asarray(out0.accept_len)[:6] == 0)
  # Greedy rows with poisoned p still emit valid ids.
  greedy = SamplingRows(ones, np.ones(batch, np.int32), ones, 0 * ones)
  outg = speculative_sample(d, q, p, greedy, u, vocab, **kw)
  tg = np.asarray(outg.tokens)
  assert np.all(((tg >= 0) & (tg < vocab)) | (tg == PAD_TOKEN))


def test_draft_row_malformed_elsewhere_is_never_accepted_and_is_counted():
  """004, the whole row: q valid at the draft token but malformed elsewhere (NaN, -inf,
  > 1, or a row that does not sum to 1) is flagged by the proposal's row check; the
  sampler never accepts a token from it, counts it, and draws from p instead."""
  batch, num_draft, vocab = 6, 2, 512
  rng = np.random.default_rng(21)
  q = rng.dirichlet(np.full(vocab, 0.5), size=(batch, num_draft)).astype(np.float32)
  q[0, 0, 7] = np.nan
  q[1, 0, 9] = -np.inf
  q[2, 0, 11] = 7.0
  q[3, 0] *= 0.5  # every entry a probability, the row sums to 0.5
  uniform = rng.uniform(size=(batch, num_draft)).astype(np.float32)
  greedy = np.zeros(batch, bool)
  proposals = [propose_from_probs(q[:, i], greedy, uniform[:, i], block_v=128)
               for i in range(num_draft)]
  d = np.stack([np.asarray(x.tokens) for x in proposals], 1)
  ok = np.stack([np.asarray(x.probs_ok) for x in proposals], 1)
  np.testing.assert_array_equal(ok[:, 0], [False, False, False, False, True, True])
  assert ok[:, 1].all()
  assert all(0.0 < q[r, 0, d[r, 0]] <= 1.0 for r in range(4))  # valid where drawn
  # The target agrees with the draft and every coin says accept: only the row check
  # can reject.
  p_sane = np.where((q >= 0) & (q <= 1), q, 0.0)
  p = np.concatenate([p_sane / p_sane.sum(-1, keepdims=True),
                      np.full((batch, 1, vocab), 1.0 / vocab, np.float32)], 1)
  ones = np.ones(batch, np.float32)
  rows = SamplingRows(ones, np.full(batch, TOP_K_ALL, np.int32), ones, 0 * ones)
  u = np.zeros((batch, num_draft + 1), np.float32)
  kw = dict(target_is_probs=True, draft_probs_ok=ok)
  out = speculative_sample(d, q, p, rows, u, vocab, block_v=128, chunk_v=256, **kw)
  ref = speculative_sample_reference(d, q, p, rows, u, vocab, **kw)
  for res in (out, ref):
    np.testing.assert_array_equal(res.accept_len, [0, 0, 0, 0, 2, 2])
    malformed = np.asarray(res.num_malformed_q)
    assert np.all(malformed[:4] >= 1) and np.all(malformed[4:] == 0)
    emitted = np.asarray(res.tokens)[:4, 0]
    assert np.all(p[np.arange(4), 0, emitted] > 0)  # drawn from p_0, a real token
  np.testing.assert_array_equal(out.tokens, ref.tokens)
