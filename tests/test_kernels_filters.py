"""sampling_probs / sample_from_probs against a sort-based numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels.filters import sample_from_probs, sampling_probs
from eagle_jax.sampling import TOP_K_ALL, SamplingRows


def numpy_sampling_probs(logits, t, k, p_top, p_min, vocab):
  x = logits.astype(np.float64)[:vocab] / t
  p = np.exp(x - x.max())
  p /= p.sum()
  if k <= 1:
    out = np.zeros(logits.shape[-1])
    out[np.argmax(logits[:vocab])] = 1
    return out
  if k < vocab:
    p = np.where(p >= np.sort(p)[::-1][k - 1], p, 0)
  if p_top < 1:
    s = np.sort(p)[::-1]
    cut = s[np.searchsorted(np.cumsum(s), p_top * p.sum() * (1 - 1e-6))]
    p = np.where(p >= cut, p, 0)
  p = np.where(p >= p_min * p.max(), p, 0)
  out = np.zeros(logits.shape[-1])
  out[:vocab] = p / p.sum()
  return out


@pytest.mark.parametrize("seed,num_cols,vocab", [(0, 50, 50), (1, 1000, 990), (2, 1531, 1531)])
def test_matches_numpy(seed, num_cols, vocab):
  rng = np.random.default_rng(seed)
  rows = 8
  logits = (rng.standard_normal((rows, num_cols)) * 2).astype(np.float32)
  t = rng.choice([0.5, 0.7, 1.0, 1.5], rows).astype(np.float32)
  k = rng.choice([1, 2, 7, 40, TOP_K_ALL], rows).astype(np.int32)
  tp = rng.choice([1.0, 0.9, 0.5], rows).astype(np.float32)
  mp = rng.choice([0.0, 0.1], rows).astype(np.float32)
  out = np.asarray(sampling_probs(logits, SamplingRows(t, k, tp, mp), vocab))
  assert np.all(out[:, vocab:] == 0)
  for r in range(rows):
    expect = numpy_sampling_probs(logits[r], t[r], k[r], tp[r], mp[r], vocab)
    np.testing.assert_allclose(out[r], expect, atol=2e-6, rtol=1e-4)


def test_greedy_ties_first_index_and_padding_ignored():
  logits = np.zeros((3, 2, 20), np.float32)
  logits[..., 4] = logits[..., 9] = 5.0
  logits[..., 19] = 100.0  # padding column, beyond vocab_size
  rows = SamplingRows(np.ones(3), np.ones(3, np.int32), np.ones(3), np.zeros(3))
  out = np.asarray(sampling_probs(logits, rows, vocab_size=18))  # [3] rows over [3, 2]
  assert np.all(out[..., 4] == 1.0) and np.all(out.sum(-1) == 1.0)


def test_sample_from_probs_never_zero_probability():
  rng = np.random.default_rng(3)
  probs = rng.uniform(size=(64, 300)).astype(np.float32)
  probs[:, ::2] = 0
  probs[:, -5:] = 0
  probs /= probs.sum(-1, keepdims=True)
  u = rng.uniform(size=64).astype(np.float32)
  u[:8] = np.nextafter(np.float32(1), np.float32(0))  # the top end
  ids = np.asarray(sample_from_probs(probs, u))
  assert np.all(probs[np.arange(64), ids] > 0)
  assert ids.max() < 300
  assert int(sample_from_probs(jnp.zeros((1, 10)), jnp.array([0.5]))[0]) == 0
